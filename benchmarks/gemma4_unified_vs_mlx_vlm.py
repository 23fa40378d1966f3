"""Gemma 4 unified: ours against mlx-vlm 0.7.10's ``gemma4_unified`` on the same random checkpoint.

The checkpoint (built once, cached in ``.assets/bench/gemma4-unified-small``) has the released
media embedders (a vision embedder of width 3840 over 6912-value merged patches with the 1120-row
position table, the 640-sample audio embedder) in front of a small text decoder (hidden 512, 8
layers, 3 sliding : 1 full with K=V on the full layers, window 512, the released 262,144-token
vocabulary), random, float32, saved by transformers. mlx-vlm loads it through its own ``sanitize``.

What is timed, in one process, the two stacks taking turns run by run (ours, mlx-vlm, mlx-vlm,
ours, ...; ratios are the median of adjacent pairs), on identical inputs (our processors' output):

- image features: one 640x480 photo-like array at budgets 280 and 1120 (ours ``Model.encode_images``,
  mlx-vlm ``get_image_features`` on the unpadded rows);
- audio features: a 30 s clip, 750 waveform frames (ours ``Model.encode_audio``, mlx-vlm
  ``get_audio_features``);
- time to first token: a chat-sized prompt (text, the budget-280 image, a 5 s clip: 444 positions)
  from processed inputs: the image and the clip embedded, the prompt prefilled into a fresh cache up
  to the last position's logits (ours ``Model.prompt`` and ``models.generation.generate.prefill``,
  one read; mlx-vlm ``get_input_embeddings`` and its language model with ``mm_token_type_ids``, as
  its generate loop passes them);
- decode: 32 greedy steps after that prefill (ours ``Model.forward``, mlx-vlm its language model),
  tokens per second; the two stacks' tokens are compared.

The last logits of the two prefills are compared too (mlx-vlm is a secondary oracle), and one more
case that only checks numbers: the image prefilled after the text was cached (a chat's later turn),
where mlx-vlm 0.7.10 drops the bidirectional overlay (its mask overlay needs a square mask).

``--quality`` instead measures our quantized weights on the same checkpoint and prompt: KL(fp32 ||
quantized) per position over the whole prompt (teacher forcing, no cache), mean and max, and top-1
agreement, for 8 and 4 bits (group 64) under the default policy (vision embedder kept in full
precision) and with ``quantize_vision``.

    python -m benchmarks.gemma4_unified_vs_mlx_vlm --mlx-vlm-path /tmp/mlxvlm [--runs 3]
    python -m benchmarks.gemma4_unified_vs_mlx_vlm --quality
    python -m benchmarks.gemma4_unified_vs_mlx_vlm --smoke   # one run, 4 decode steps (benchmarks.smoke)

Without mlx-vlm (neither installed nor ``--mlx-vlm-path``) only our side is timed (``ours_alone``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / ".assets" / "bench" / "gemma4-unified-small"

TEXT = dict(
    vocab_size=262144,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
    final_logit_softcapping=30.0,
    use_bidirectional_attention="vision",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
IMAGE, AUDIO = 258880, 258881
DECODE_STEPS = 32


def build_checkpoint() -> Path:
    """Random weights saved by transformers, plus the plain ``global_head_dim`` /
    ``num_global_key_value_heads`` mlx-vlm reads (transformers writes ``per_layer_config``)."""
    if (CHECKPOINT / "config.json").exists():
        return CHECKPOINT
    import torch
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma4UnifiedConfig(text_config=TEXT, vision_config={}, audio_config={}, initializer_range=0.02)
    tmp = CHECKPOINT.with_name(CHECKPOINT.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    Gemma4UnifiedForConditionalGeneration(config).eval().save_pretrained(tmp)
    written = json.loads((tmp / "config.json").read_text())
    written["text_config"].update(global_head_dim=TEXT["global_head_dim"], num_global_key_value_heads=1)
    (tmp / "config.json").write_text(json.dumps(written, indent=2))
    shutil.rmtree(CHECKPOINT, ignore_errors=True)
    tmp.rename(CHECKPOINT)
    return CHECKPOINT


def alternate(runs: int, mine, peer) -> tuple[dict[str, list[float]], float]:
    times: dict[str, list[float]] = {"ours": [], "mlx-vlm": []}
    for i in range(runs):
        order = (("ours", mine), ("mlx-vlm", peer)) if i % 2 == 0 else (("mlx-vlm", peer), ("ours", mine))
        for who, fn in order:
            start = time.perf_counter()
            fn()
            times[who].append(time.perf_counter() - start)
    return times, statistics.median(x / y for x, y in zip(times["ours"], times["mlx-vlm"]))


def cell(values: list[float], scale: float = 1.0, unit: str = " s") -> str:
    values = [v * scale for v in values]
    return f"{statistics.median(values):.3g}{unit} [{min(values):.3g}-{max(values):.3g}]"


def inputs(model):
    """The benchmark's photo-like image (640x480) and 30 s clip, processed by ``model``."""
    import numpy as np

    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:480, 0:640]
    photo = np.clip(np.stack([xs / 2.5, ys / 1.9, (xs + ys) % 200], -1) + rng.normal(0, 20, (480, 640, 3)), 0, 255).astype(np.uint8)
    t = np.arange(30 * 16_000) / 16_000
    clip = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)
    images = {budget: model.process_images([photo], budget)[0] for budget in (280, 1120)}
    (audio,) = model.process_audio([clip])
    (short,) = model.process_audio([clip[: 5 * 16_000]])
    return images, audio, short


def chat_prompt(model, image, clip):
    """Text, the image and the clip: the prompt whose prefill and decode are timed."""
    return model.prompt([2, 1, 2, 3, IMAGE, 4, 5, AUDIO, 6, 7, 8] + list(range(20, 60)), images=[image], audio=[clip])


def quality(path: Path) -> None:
    import numpy as np

    import models  # before mlx.core (loads the BLAS)
    import mlx.core as mx
    from weights.quantize import QuantizationPolicy

    def log_softmax(x):
        x = np.asarray(x, dtype=np.float64)[0]
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    full = models.load(str(path), tokenizer=False)
    images, _, short = inputs(full)
    reference = log_softmax(full.logits(chat_prompt(full, images[280], short)))
    print("| weights | KL mean (max), nats | top-1 agreement |\n|---|---|---|\n| float32 | 0 | 1 |")
    for bits in (8, 4):
        for vision in (False, True):
            model = models.load(str(path), tokenizer=False, q_policy=QuantizationPolicy(bits, 64, quantize_vision=vision))
            mine = log_softmax(model.logits(chat_prompt(model, images[280], short)))
            kl = (np.exp(reference) * (reference - mine)).sum(-1)
            top1 = float((reference.argmax(-1) == mine.argmax(-1)).mean())
            what = f"{bits}-bit g64" + (", vision embedder too" if vision else "")
            print(f"| {what} | {kl.mean():.4f} ({kl.max():.4f}) | {top1:.3f} |", flush=True)
            del model
            mx.clear_cache()


def ours_alone(path: Path, args) -> None:
    """Our side of every timing when mlx-vlm is not there (its rows: not installed)."""
    import models  # before mlx.core (loads the BLAS)
    import mlx.core as mx

    from models.generation.generate import prefill

    record = smoke.Record("gemma4_unified_vs_mlx_vlm")
    record.missing("mlx-vlm", "mlx-vlm is not installed and no --mlx-vlm-path", ours=False, package="mlx_vlm")
    print("mlx-vlm is not installed (and no --mlx-vlm-path): our side only", flush=True)
    ours = models.load(str(path), tokenizer=False)
    mx.eval(ours.graph.parameters())
    images, audio, short = inputs(ours)

    def first_token():
        prompt = chat_prompt(ours, images[280], short)
        cache = ours.make_cache()
        return prompt, cache, prefill(ours.forward, prompt.ids, cache, 2048, prompt.images)

    def greedy():
        _, cache, logits = first_token()
        tokens = [int(mx.argmax(logits).item())]
        start = time.perf_counter()
        for _ in range(DECODE_STEPS - 1):
            tokens.append(int(mx.argmax(ours.forward(mx.array([[tokens[-1]]]), cache)[0, -1]).item()))
        return tokens, (DECODE_STEPS - 1) / (time.perf_counter() - start)

    cases = [(f"image features, budget {b}", lambda im=im: mx.eval(ours.encode_images([im])[0])) for b, im in images.items()]
    cases += [("audio features, 30 s", lambda: mx.eval(ours.encode_audio([audio])[0])),
              ("time to first token", lambda: mx.eval(first_token()[2]))]  # fmt: skip
    print("| what | ours |\n|---|---|")
    for name, fn in cases:
        times = smoke.alone(fn, args.runs)
        print(f"| {name} | {cell(times)} |", flush=True)
        record.row(f"ours {name}", seconds=statistics.median(times))
    runs = [greedy() for _ in range(args.runs)]
    print(f"| decode, {DECODE_STEPS} greedy tokens | {cell([r[1] for r in runs], unit=' tok/s')} |", flush=True)
    record.row("ours decode", runs[0][0], decode=statistics.median(r[1] for r in runs))
    if args.smoke:
        record.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mlx-vlm-path", help="a folder holding the mlx_vlm package")
    parser.add_argument("--quality", action="store_true", help="KL of our 8- and 4-bit weights to fp32 instead of timings")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    path = build_checkpoint()
    if args.quality:
        return quality(path)
    if args.mlx_vlm_path:
        sys.path.append(args.mlx_vlm_path)
    if args.smoke:
        global DECODE_STEPS
        args.runs, DECODE_STEPS = 1, 4
    if not (args.mlx_vlm_path or smoke.installed("mlx_vlm")):
        return ours_alone(path, args)

    import numpy as np

    import models  # before mlx.core (loads the BLAS)
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from models.generation.generate import prefill

    ours = models.load(str(path), tokenizer=False)
    mx.eval(ours.graph.parameters())
    theirs = load_model(path)
    mx.eval(theirs.parameters())

    images, audio, short = inputs(ours)
    record = smoke.Record("gemma4_unified_vs_mlx_vlm")

    def theirs_image(image):
        out = theirs.get_image_features(mx.array(image.patches)[None], mx.array(image.position_ids)[None])
        mx.eval(out)
        return out

    def theirs_audio(frames):
        out = theirs.get_audio_features(mx.array(frames)[None], mx.ones((1, frames.shape[0]), dtype=mx.bool_))
        mx.eval(out)
        return out

    print(f"checkpoint {path.name}; image 640x480 at budgets 280 / 1120: {images[280].num_soft_tokens} / "
          f"{images[1120].num_soft_tokens} soft tokens; audio 30 s: {audio.num_soft_tokens} frames", flush=True)
    print("| what | ours | mlx-vlm 0.7.10 | ours / mlx-vlm (time) | outputs |\n|---|---|---|---|---|")
    cases = [(f"image features, budget {b}", (lambda im=im: ours.encode_images([im])[0]), (lambda im=im: theirs_image(im)))
             for b, im in images.items()]
    cases.append(("audio features, 30 s", lambda: ours.encode_audio([audio])[0], lambda: theirs_audio(audio.features)))
    for name, mine, peer in cases:
        a, b = mine(), peer()
        diff = float(mx.abs(a - b).max())
        times, ratio = alternate(args.runs, mine, peer)
        print(f"| {name} | {cell(times['ours'])} | {cell(times['mlx-vlm'])} | {ratio:.2f}x | max diff {diff:.1e} |", flush=True)
        for who in times:
            record.row(f"{who} {name}", ours=who == "ours", seconds=statistics.median(times[who]))

    prompt = chat_prompt(ours, images[280], short)
    ids = mx.array([prompt.ids])
    kinds = np.zeros(len(prompt.ids), np.int32)
    kinds[np.array(prompt.ids) == IMAGE], kinds[np.array(prompt.ids) == AUDIO] = 1, 3
    types = mx.array(kinds)[None]
    state = {}

    def ours_prefill():
        fresh = chat_prompt(ours, images[280], short)  # the image and the clip embedded again, as mlx-vlm does below
        cache = ours.make_cache()
        logits = prefill(ours.forward, fresh.ids, cache, 2048, fresh.images)
        mx.eval(logits)
        state["ours"] = (cache, logits)

    def theirs_prefill():
        embedded = theirs.get_input_embeddings(
            input_ids=ids, pixel_values=mx.array(images[280].patches)[None], image_position_ids=mx.array(images[280].position_ids)[None],
            input_features=mx.array(short.features)[None], input_features_mask=mx.ones((1, short.num_soft_tokens), dtype=mx.bool_),
        )  # fmt: skip
        cache = theirs.make_cache()
        logits = theirs.language_model(inputs_embeds=embedded.inputs_embeds, cache=cache, mm_token_type_ids=types, logits_to_keep=1).logits
        mx.eval(logits)
        state["mlx-vlm"] = (cache, logits[0, -1])

    def decode(who, step):
        cache, logits = state[who]
        tokens = []
        token = int(mx.argmax(logits).item())  # the prefill's last logits [V]
        for _ in range(DECODE_STEPS):
            tokens.append(token)
            logits = step(mx.array([[token]]), cache)
            token = int(mx.argmax(logits[0, -1]).item())
        state[who + " tokens"] = tokens

    def ours_decode():
        decode("ours", lambda x, cache: ours.forward(x, cache))

    def theirs_decode():
        decode("mlx-vlm", lambda x, cache: theirs.language_model(inputs=x, cache=cache).logits)

    ours_prefill(), theirs_prefill()
    last = float(mx.abs(state["ours"][1] - state["mlx-vlm"][1]).max())
    times, ratio = alternate(args.runs, ours_prefill, theirs_prefill)
    n = len(prompt.ids)
    print(f"| time to first token, {n} positions | {cell(times['ours'])} | {cell(times['mlx-vlm'])} | {ratio:.2f}x | "
          f"last logits max diff {last:.1e} |", flush=True)
    decode_times: dict[str, list[float]] = {"ours": [], "mlx-vlm": []}
    for i in range(args.runs):
        order = (("ours", ours_prefill, ours_decode), ("mlx-vlm", theirs_prefill, theirs_decode))
        for who, fill, dec in order if i % 2 == 0 else order[::-1]:
            fill()
            start = time.perf_counter()
            dec()
            decode_times[who].append(DECODE_STEPS / (time.perf_counter() - start))
    ratio = statistics.median(x / y for x, y in zip(decode_times["ours"], decode_times["mlx-vlm"]))
    same = sum(a == b for a, b in zip(state["ours tokens"], state["mlx-vlm tokens"]))
    print(f"| decode, {DECODE_STEPS} greedy tokens | {cell(decode_times['ours'], unit=' tok/s')} | "
          f"{cell(decode_times['mlx-vlm'], unit=' tok/s')} | {ratio:.2f}x (speed) | {same}/{DECODE_STEPS} tokens equal |", flush=True)
    for who in decode_times:  # random weights: the tokens are printed, not required to agree
        record.row(f"{who} decode", state[who + " tokens"], ours=who == "ours", decode=statistics.median(decode_times[who]))

    # The image after cached text: our cache reads keep the overlay; compare both with one whole prefill.
    split = prompt.images[0].start - 1  # before boi
    cache = ours.make_cache()
    ours.forward(mx.array([prompt.ids[:split]]), cache)
    rest = prompt.suffix(split)
    ours_split = prefill(ours.forward, rest.ids, cache, 2048, rest.images)
    embedded = theirs.get_input_embeddings(
        input_ids=ids, pixel_values=mx.array(images[280].patches)[None], image_position_ids=mx.array(images[280].position_ids)[None],
        input_features=mx.array(short.features)[None], input_features_mask=mx.ones((1, short.num_soft_tokens), dtype=mx.bool_),
    ).inputs_embeds  # fmt: skip
    cache = theirs.make_cache()
    theirs.language_model(inputs_embeds=embedded[:, :split], cache=cache, mm_token_type_ids=types[:, :split])
    theirs_split = theirs.language_model(inputs_embeds=embedded[:, split:], cache=cache, mm_token_type_ids=types[:, split:]).logits
    print(f"image after cached text, last logits vs one whole prefill: ours max diff "
          f"{float(mx.abs(ours_split - state['ours'][1]).max()):.1e}, mlx-vlm {float(mx.abs(theirs_split[0, -1] - state['mlx-vlm'][1]).max()):.1e}")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
