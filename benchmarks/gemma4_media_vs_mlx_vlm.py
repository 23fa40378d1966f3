"""Gemma 4 audio and video encoders: ours against mlx-vlm 0.7.10's on the same random checkpoint.

The checkpoint (built once, cached in ``.assets/bench/gemma4-media-small``) is the image benchmark's
(``benchmarks.gemma4_vision_vs_mlx_vlm``: text hidden 512, 8 layers, vision tower hidden 384, 4
layers) plus an audio tower of the released size (transformers' default ``Gemma4AudioConfig``: 12
Conformer layers of width 1024), random, float32, saved by transformers.

What is timed, in one process, the two stacks taking turns run by run (ours, mlx-vlm, mlx-vlm,
ours, ...; ratios are the median of adjacent pairs): the **encoder part of the time to first
token** on identical inputs, i.e. the tower plus the embedder into the text space, evaluated:

- audio: one 30 s clip (a tone plus noise, 16 kHz) as 3000 log-mel frames from our processor
  (transformers' extractor), ours through ``Model.encode_audio``, mlx-vlm through
  ``model.audio_tower(features, mask)`` and ``model.embed_audio``;
- video: 32 frames (360x480, budget 70: 630 patches each) as patches from our video processor, ours
  through ``Model.encode_videos`` (frames batched 4 at a time), mlx-vlm through
  ``model.vision_tower`` on all 32 frames as one ``[1, 32, L, 768]`` video and ``model.embed_vision``.

Preprocessing and the text prefill are not in these numbers (our prefill against mlx-vlm's on an image
prompt is in ``docs/multimodal.md``); the outputs of the two stacks are compared (max difference).

    python -m benchmarks.gemma4_media_vs_mlx_vlm --mlx-vlm-path /tmp/mlxvlm [--runs 3]
    python -m benchmarks.gemma4_media_vs_mlx_vlm --smoke   # a 2 s clip and 2 frames, one run (benchmarks.smoke)
    python -m benchmarks.gemma4_media_vs_mlx_vlm --only audio --profile --runs 3   # and where our audio tower's time goes

``--profile`` times the pieces of our audio tower on the clip (each piece evaluated on its own,
``--runs`` times, taking turns; the minimum and the median): the subsampling convolutions, one
Conformer layer and its feed-forward, attention and light-convolution blocks, and each of the
layer's products (``x @ W.T``) with its GFLOP/s next to a 2048x2048x2048 product's, the BLAS rate
of the moment. Its last line is the bound the products set: their share of a layer, and the ratio
to mlx-vlm that the tower would reach if everything but the products took no time.

Without mlx-vlm (neither installed nor ``--mlx-vlm-path``) only our rows are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / ".assets" / "bench" / "gemma4-media-small"


def build_checkpoint() -> Path:
    if (CHECKPOINT / "config.json").exists():
        return CHECKPOINT
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from benchmarks.gemma4_vision_vs_mlx_vlm import TEXT, VISION

    torch.manual_seed(0)
    config = Gemma4Config(text_config=TEXT, vision_config=VISION, audio_config={}, initializer_range=0.02)
    tmp = CHECKPOINT.with_name(CHECKPOINT.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    Gemma4ForConditionalGeneration(config).eval().save_pretrained(tmp)
    written = json.loads((tmp / "config.json").read_text())
    written["text_config"].update(global_head_dim=TEXT["global_head_dim"])
    (tmp / "config.json").write_text(json.dumps(written, indent=2))
    shutil.rmtree(CHECKPOINT, ignore_errors=True)
    tmp.rename(CHECKPOINT)
    return CHECKPOINT


def profile_audio_tower(tower, features, runs: int, whole: dict) -> None:
    """Print where our audio tower's time goes on ``features [1, T, 128]`` (see the module's docstring);
    ``whole`` maps "ours" (and "mlx-vlm" when it runs) to the timed encoders, timed in the same turns."""
    import mlx.core as mx

    from graphs.gemma4_audio import ChunkLayout

    sub = tower.subsample_conv_projection
    x = sub(features)
    mx.eval(x)
    steps, hidden = x.shape[1], x.shape[2]
    layer, layout, positions = tower.layers[0], ChunkLayout(steps, tower.config), tower._positions
    ffw, attn, lconv = layer.feed_forward1, layer.self_attn, layer.lconv1d
    first = sub.layer0(features[..., None])
    square = mx.random.normal((2048, 2048))
    mx.eval(first, square)
    inputs: dict[int, mx.array] = {}

    def product(linear):  # the layer's ``x @ W.T`` on an input of its width
        width = linear.weight.shape[1]
        if width not in inputs:
            inputs[width] = mx.random.normal((1, steps, width))
            mx.eval(inputs[width])
        return (lambda: linear(inputs[width])), 2 * steps * linear.weight.size

    products = {
        "feed-forward W1 (x2 per layer)": (*product(ffw.ffw_layer_1.linear), 2),
        "feed-forward W2 (x2 per layer)": (*product(ffw.ffw_layer_2.linear), 2),
        "attention q/k/v/post (x4 per layer)": (*product(attn.q_proj.linear), 4),
        "light conv linear_start": (*product(lconv.linear_start.linear), 1),
        "light conv linear_end": (*product(lconv.linear_end.linear), 1),
    }
    pieces = {
        "subsampling conv 1": lambda: sub.layer0(features[..., None]),
        "subsampling conv 2": lambda: sub.layer1(first),
        "one Conformer layer": lambda: layer(x, positions, layout),
        "  feed-forward block (x2 per layer)": lambda: ffw(x),
        "  attention block": lambda: attn(x, positions, layout),
        "  light convolution block": lambda: lconv(x),
        **{f"  {name}": fn for name, (fn, _, _) in products.items()},
        "2048x2048x2048 product": lambda: square @ square,
        **{f"{who}: tower and embedder": fn for who, fn in whole.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for _ in range(runs):
        for name, fn in pieces.items():
            start = time.perf_counter()
            mx.eval(fn())
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in times.items()}
    flops = {f"  {name}": f for name, (_, f, _) in products.items()}
    flops["2048x2048x2048 product"] = 2 * 2048**3
    print(f"\naudio tower profile: {steps} steps of width {hidden}, {runs} runs each, load average {os.getloadavg()[0]:.1f}")
    print("| piece | min ms | median ms | GFLOP | GFLOP/s at min |\n|---|---|---|---|---|")
    for name, t in times.items():
        rate = f"{flops[name] / best[name] / 1e9:.0f}" if name in flops else ""
        gflop = f"{flops[name] / 1e9:.2f}" if name in flops else ""
        print(f"| {name} | {best[name] * 1e3:.1f} | {statistics.median(t) * 1e3:.1f} | {gflop} | {rate} |")
    in_layer = sum(best[f"  {name}"] * count for name, (_, _, count) in products.items())
    layer_flops = sum(f * count for _, f, count in products.values())
    share = in_layer / best["one Conformer layer"]
    print(f"products per layer: {layer_flops / 1e9:.1f} GFLOP, {in_layer * 1e3:.0f} ms of the layer's {best['one Conformer layer'] * 1e3:.0f} ms "
          f"({share:.0%}); the {len(tower.layers)} layers' products {in_layer * len(tower.layers):.2f} s of our encoder's {best['ours: tower and embedder']:.2f} s")
    if "mlx-vlm" in whole:
        floor = in_layer * len(tower.layers) / best["mlx-vlm: tower and embedder"]
        print(f"bound: the layers' products alone (everything else free) take {floor:.2f}x mlx-vlm's encoder time "
              f"(ours {best['ours: tower and embedder'] / best['mlx-vlm: tower and embedder']:.2f}x, minima)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mlx-vlm-path", help="a folder holding the mlx_vlm package")
    parser.add_argument("--seconds", type=float, default=30.0, help="audio clip length")
    parser.add_argument("--frames", type=int, default=32, help="video frames")
    parser.add_argument("--only", choices=("audio", "video"), help="measure one input kind")
    parser.add_argument("--profile", action="store_true", help="also time the pieces of our audio tower (see above)")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.seconds, args.frames = 1, 2.0, 2
    path = build_checkpoint()
    if args.mlx_vlm_path:
        sys.path.append(args.mlx_vlm_path)
    record = smoke.Record("gemma4_media_vs_mlx_vlm")
    peer = bool(args.mlx_vlm_path) or smoke.installed("mlx_vlm")
    if not peer:
        record.missing("mlx-vlm", "mlx-vlm is not installed and no --mlx-vlm-path", ours=False, package="mlx_vlm")
        print("mlx-vlm is not installed (and no --mlx-vlm-path): our rows only", flush=True)

    import numpy as np

    import models  # before mlx.core (loads the BLAS)
    import mlx.core as mx

    ours = models.load(str(path), tokenizer=False)
    mx.eval(ours.graph.parameters())
    if peer:
        from mlx_vlm.utils import load_model

        theirs = load_model(path)

    rng = np.random.default_rng(0)
    t = np.arange(int(args.seconds * 16_000)) / 16_000
    clip = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    (audio,) = ours.process_audio([(clip, 16_000)])
    frames = rng.integers(0, 256, (args.frames, 360, 480, 3), dtype=np.uint8)
    (video,) = ours.process_videos([frames], max_soft_tokens=70)
    feats = mx.array(audio.features)[None]
    mask = mx.zeros(feats.shape[:2], dtype=mx.bool_)
    patches = mx.array(np.stack(video.patches))[None]
    positions = mx.array(np.broadcast_to(video.position_ids, (1, len(video.patches), *video.position_ids.shape)).astype(np.int32))

    def ours_audio():
        return ours.encode_audio([audio])[0]

    def theirs_audio():
        out = theirs.embed_audio(theirs.audio_tower(feats, mask)[0])[0]
        mx.eval(out)
        return out

    def ours_video():
        return mx.concatenate(ours.encode_videos([video])[0].frames)

    def theirs_video():
        out = theirs.embed_vision(theirs.vision_tower(patches, positions)).reshape(-1, ours.config.text.hidden_size)
        mx.eval(out)
        return out

    print(f"checkpoint {path.name}; audio: {args.seconds:g} s, {audio.features.shape[0]} mel frames, {audio.num_soft_tokens} soft tokens; "
          f"video: {len(video.patches)} frames {video.height}x{video.width}, {video.patches[0].shape[0]} patches and "
          f"{video.num_soft_tokens} soft tokens each", flush=True)
    for name, mine, other in ((f"audio {args.seconds:g} s", ours_audio, theirs_audio),
                              (f"video {args.frames} frames", ours_video, theirs_video)):  # fmt: skip
        if args.only and not name.startswith(args.only):
            continue
        if not peer:
            times = smoke.alone(mine, args.runs)
            print(f"| {name} | {statistics.median(times):.2f} s [{min(times):.2f}-{max(times):.2f}] | - | - | |", flush=True)
            record.row(f"ours {name}", seconds=statistics.median(times))
            if args.profile and name.startswith("audio"):
                profile_audio_tower(ours.graph.audio_tower, feats, args.runs, {"ours": mine})
            continue
        a, b = mine(), other()  # warm-up, and the outputs compared
        diff = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()) if a.shape == b.shape else float("nan")
        times: dict[str, list[float]] = {"ours": [], "mlx-vlm": []}
        for i in range(args.runs):
            order = (("ours", mine), ("mlx-vlm", other)) if i % 2 == 0 else (("mlx-vlm", other), ("ours", mine))
            for who, fn in order:
                start = time.perf_counter()
                fn()
                times[who].append(time.perf_counter() - start)
        ratio = statistics.median(x / y for x, y in zip(times["ours"], times["mlx-vlm"]))
        print(f"| {name} | {statistics.median(times['ours']):.2f} s [{min(times['ours']):.2f}-{max(times['ours']):.2f}] | "
              f"{statistics.median(times['mlx-vlm']):.2f} s [{min(times['mlx-vlm']):.2f}-{max(times['mlx-vlm']):.2f}] | "
              f"{ratio:.2f}x | shapes {list(a.shape)} / {list(b.shape)}, max diff {diff:.1e} |", flush=True)
        record.row(f"ours {name}", seconds=statistics.median(times["ours"]))
        if args.profile and name.startswith("audio"):
            profile_audio_tower(ours.graph.audio_tower, feats, args.runs, {"ours": mine, "mlx-vlm": other})
        if a.shape == b.shape and diff <= 1e-3 * max(1.0, float(mx.abs(a).max())):
            record.row(f"mlx-vlm {name}", ours=False, seconds=statistics.median(times["mlx-vlm"]))
        else:
            record.missing(f"mlx-vlm {name}", f"outputs differ from ours: shapes {a.shape} / {b.shape}, max diff {diff:.1e}", ours=False)
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
