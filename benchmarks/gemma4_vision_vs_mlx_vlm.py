"""Gemma 4 with one image: our stack against mlx-vlm's ``gemma4`` on the same checkpoint and photo.

Builds (once, cached under ``.assets/bench``) a random Gemma 4 multimodal checkpoint saved by
transformers (``Gemma4ForConditionalGeneration``), small enough for a CPU but with the real shapes
that matter: the released 262,144-token vocabulary (the real tokenizer is copied in, so the chat
template and the image ids are the released ones), per-layer embeddings, KV sharing, a 3:1
sliding/full pattern with proportional RoPE on the full layers, ``use_bidirectional_attention=
"vision"``, and a 4-layer, 384-wide vision tower with the default 10,240-entry position tables.
Weights are float32, as transformers writes them, and both stacks keep them so.

Each stack runs in its own process (so peak memory is its own) on the same chat prompt (the
template's rendering of one image and a question) and the same photo at ``--max-soft-tokens``:

- ours: ``Model.process_images`` (tokenization, decode, resize, patches), ``Model.prompt`` (vision
  tower + embedder, placeholder expansion), then ``models.generation.generate.generate_tokens`` (prefill
  through ``vision_prefill``, greedy decode);
- mlx-vlm: ``mlx_vlm.utils.prepare_inputs`` (tokenization, image processor, placeholder
  expansion), ``Model.encode_image`` (vision tower + embedder, handed on as
  ``cached_image_features``, as its own ``vision_cache`` path does), then
  ``mlx_vlm.generate.generate_step`` (prefill, greedy decode).

Time to first token = preprocessing + vision tower + prefill (to the first sampled token, on the
host); the vision tower column is its part (tower + embedder, evaluated alone). Decode tokens/s is
measured over the ``--gen`` greedy tokens after the first. No stop token ends a run (random weights
may sample one), so every run does the same work.

Both processes are started and loaded side by side, then take turns: each waits on its stdin
while the other runs, so they never compete for the cores, and their timed runs alternate (ours,
mlx-vlm, mlx-vlm, ours, ...) so that a shared machine's drifting load hits both alike. After one
warm-up each, ``--runs`` timed runs per stack; reported: each stack's median, and the ratios
ours / mlx-vlm as the median of the ratios of adjacent runs (time ratios below 1 and tokens/s
ratios above 1 mean we are faster). Peak memory is MLX's, in each process, from the end of its
load (all weights resident) to the end of its timed runs.

Checks: both stacks must produce the same prompt ids (so the same number of image tokens), and
their first greedy tokens are compared. mlx-vlm 0.7.10 ORs its bidirectional image block into the
full-attention layers' masks too, where transformers keeps full layers causal, so with random
weights the greedy tokens differ; the mlx-vlm child therefore also reruns its greedy tokens (untimed,
after the timed runs) with the overlay kept to the sliding layers, which should agree with ours.

Both children load the same BLAS (``zoo_cpu.blas.preload()`` before MLX, when that module is present;
``GEMMA_ZOO_BLAS=off`` gives MLX's bundled reference BLAS to both). mlx-vlm is imported from the
environment or from ``--mlx-vlm-path`` (``pip install --no-deps --target DIR mlx-vlm==0.7.10``; the
packages its import needs, transformers, Pillow, requests and the like, were already installed here).

    python -m benchmarks.gemma4_vision_vs_mlx_vlm --mlx-vlm-path /tmp/mlxvlm [--gen 64 --runs 5]
    python -m benchmarks.gemma4_vision_vs_mlx_vlm --smoke   # tiny sizes, 70 image tokens, 4 tokens, one run (benchmarks.smoke)

Without mlx-vlm (neither installed nor ``--mlx-vlm-path``) only our row is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / ".assets" / "bench" / "gemma4-vision-small"

TEXT = dict(
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=64,
    global_head_dim=128,
    hidden_size_per_layer_input=32,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2,
    final_logit_softcapping=30.0,
    max_position_embeddings=32768,
    use_bidirectional_attention="vision",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
VISION = dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6,
              head_dim=64)  # fmt: skip
# --smoke: the same layout at the tiny sizes of benchmarks.smoke (the full vocabulary, as the real
# tokenizer's ids need it), so that the two stacks load about 0.15 GB side by side instead of 1 GB
SMOKE_TEXT = dict(TEXT, hidden_size=64, intermediate_size=128, num_attention_heads=2, hidden_size_per_layer_input=8)
SMOKE_VISION = dict(VISION, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2)  # fmt: skip
IMAGE_TOKEN = 258880
QUESTION = "Describe this image."
COMPARED = 8  # greedy tokens compared between the stacks


def build_checkpoint(smoke_sizes: bool = False) -> Path:
    """Random weights saved by transformers (``TEXT`` and ``VISION``, or the ``SMOKE_`` sizes), the real
    tokenizer files, and the plain ``global_head_dim`` mlx-vlm reads (transformers writes it as
    ``per_layer_config``)."""
    text, vision = (SMOKE_TEXT, SMOKE_VISION) if smoke_sizes else (TEXT, VISION)
    folder = CHECKPOINT.with_name("gemma4-vision-smoke") if smoke_sizes else CHECKPOINT
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from models.assets.gemma4_tokenizer import gemma4_tokenizer_dir

    torch.manual_seed(0)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, initializer_range=0.02)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    Gemma4ForConditionalGeneration(config).eval().save_pretrained(tmp)
    written = json.loads((tmp / "config.json").read_text())
    written["text_config"].update(global_head_dim=text["global_head_dim"])
    (tmp / "config.json").write_text(json.dumps(written, indent=2))
    for file in gemma4_tokenizer_dir().iterdir():
        shutil.copy(file, tmp / file.name)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def chat_prompt(path: Path) -> str:
    """The chat template's rendering of one user turn (an image, then the question)."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    return AutoTokenizer.from_pretrained(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------- children
def take(tokens, n: int) -> tuple[list[int], float, float]:
    """The first ``n`` tokens of a stream, the time the first arrived and the time the last did
    (each stack queues the next step before handing over a token; that step is not waited for)."""
    out = [next(tokens)]
    first = time.perf_counter()
    out += [next(tokens) for _ in range(n - 1)]
    return out, first, time.perf_counter()


def ours(path: str, text: str, photo: str, budget: int):
    import mlx.core as mx

    import models
    from models.generation.generate import generate_tokens

    model = models.load(path)
    mx.eval(model.graph.parameters())  # resident, like mlx-vlm's (its loader evaluates every weight)

    def run(gen: int) -> dict:
        start = time.perf_counter()
        ids = model.encode(text)
        images = model.process_images([photo], budget)
        processed = time.perf_counter()
        prompt = model.prompt(ids, images)  # vision tower + embedder (evaluated), placeholder expansion
        encoded = time.perf_counter()
        tokens = generate_tokens(model.forward, prompt.ids, model.make_cache(), max_tokens=gen + 1, images=prompt.images, overlap=model.overlap)
        out, first, end = take(tokens, gen + 1)
        tokens.close()
        mx.synchronize()  # the step queued behind the last token, before the next run
        return {"preprocess_s": processed - start, "vision_s": encoded - processed, "prefill_s": first - encoded,
                "ttft_s": first - start, "decode_tps": (len(out) - 1) / (end - first), "tokens": out,
                "ids": prompt.ids, "image_tokens": sum(s.end - s.start for s in prompt.images)}  # fmt: skip

    return run, None


def mlx_vlm(path: str, text: str, photo: str, budget: int):
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step, generation_stream
    from mlx_vlm.utils import prepare_inputs

    model, processor = load(path)
    processor.image_processor.max_soft_tokens = budget  # prepare_inputs does not forward it

    def run(gen: int) -> dict:
        start = time.perf_counter()
        inputs = prepare_inputs(processor, images=[photo], prompts=text, add_special_tokens=False)
        mx.eval(inputs["pixel_values"])
        processed = time.perf_counter()
        features = model.encode_image(inputs["pixel_values"])
        mx.eval(features)
        encoded = time.perf_counter()
        ids = inputs["input_ids"]
        steps = generate_step(ids, model, inputs["pixel_values"], inputs["attention_mask"], max_tokens=gen + 1,
                              temperature=0.0, mm_token_type_ids=inputs["mm_token_type_ids"],
                              cached_image_features=features)  # fmt: skip
        out, first, end = take((token for token, _ in steps), gen + 1)
        steps.close()
        mx.synchronize(generation_stream)  # the step queued behind the last token, before the next run
        return {"preprocess_s": processed - start, "vision_s": encoded - processed, "prefill_s": first - encoded,
                "ttft_s": first - start, "decode_tps": (len(out) - 1) / (end - first), "tokens": out,
                "ids": ids[0].tolist(), "image_tokens": int((ids == IMAGE_TOKEN).sum().item())}  # fmt: skip

    def sliding_only_overlay() -> None:
        """transformers' rule: the image block is bidirectional on sliding layers only."""
        cls = type(model.language_model.model)
        original = cls._make_masks

        def masks(self, h, cache, mm_token_type_ids=None):
            vision, causal = original(self, h, cache, mm_token_type_ids), original(self, h, cache, None)
            return [v if layer.layer_type == "sliding_attention" else c for layer, v, c in zip(self.layers, vision, causal)]

        cls._make_masks = masks

    return run, sliding_only_overlay


METRICS = ("preprocess_s", "vision_s", "prefill_s", "ttft_s", "decode_tps")


def child(which: str, path: str, text: str, photo: str, budget: int) -> None:
    """Load, then serve the parent's commands on stdin, one JSON line each on stdout:
    ``run N`` (one run with N greedy tokens after the first), ``reset`` (peak memory), ``check``
    (mlx-vlm: greedy tokens again under transformers' overlay rule) and ``done`` (the summary)."""
    try:
        import zoo_cpu  # noqa: F401  (before mlx; both children alike)

        blas = zoo_cpu.blas.describe()
    except ImportError:
        blas = "BLAS: MLX's bundled one (zoo_cpu not present)"
    import mlx.core as mx

    start = time.perf_counter()
    run, patch = (ours if which == "ours" else mlx_vlm)(path, text, photo, budget)
    summary = {"load_s": time.perf_counter() - start, "weights_gb": mx.get_active_memory() / 1e9, "blas": blas}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command, *arg = line.split()
        if command == "run":
            reply = run(int(arg[0]))
        elif command == "reset":
            mx.reset_peak_memory()
            reply = {}
        elif command == "check":
            patch()
            reply = {"tokens": run(COMPARED)["tokens"]}
        else:  # done
            print(json.dumps(dict(summary, peak_gb=mx.get_peak_memory() / 1e9)), flush=True)
            return
        print(json.dumps(reply), flush=True)


class Child:
    """One stack's process, driven line by line (its stderr goes to a file, read on failure)."""

    def __init__(self, which: str, path: Path, text: str, photo: str, budget: int, mlx_vlm_path: str | None):
        env = dict(os.environ)
        if mlx_vlm_path and which == "mlx_vlm":
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), mlx_vlm_path, env.get("PYTHONPATH")]))
        self.which, self.stderr = which, tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.gemma4_vision_vs_mlx_vlm", "--child", which, "--path", str(path),
             "--text", text, "--photo", photo, "--max-soft-tokens", str(budget)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
        )  # fmt: skip

    def read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                self.process.wait()
                self.stderr.seek(0)
                last = (self.stderr.read().strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"{self.which} exited ({self.process.returncode}): {last}")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, command: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()


# ----------------------------------------------------------------------------------------- main
def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen", type=int, default=64, help="greedy tokens after the first")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per stack, alternating, after a warm-up")
    parser.add_argument("--max-soft-tokens", type=int, default=280)
    # A path, not a built-in name: the library ships no sample photos. The measured runs used scikit-image's
    # chelsea.png, which `python -m tests.real_media chelsea.png` fetches (pinned wheel, sha256) and prints.
    parser.add_argument("--photo", metavar="PATH", help="the photo both stacks read (e.g. chelsea.png); --smoke without it: a synthetic picture")
    parser.add_argument("--mlx-vlm-path", help="a folder holding the mlx_vlm package (added to its child's path only)")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    parser.add_argument("--child", choices=["ours", "mlx_vlm"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--text", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.gen, args.runs, args.max_soft_tokens = 4, 1, 70
        args.photo = args.photo or str(smoke.synthetic_photo())
    if args.photo is None:
        parser.error("--photo PATH is required (the library ships no sample photos)")
    if args.child:
        child(args.child, args.path, args.text, args.photo, args.max_soft_tokens)
        return

    began = time.perf_counter()
    path = build_checkpoint(smoke_sizes=args.smoke)
    text_sizes, vision_sizes = (SMOKE_TEXT, SMOKE_VISION) if args.smoke else (TEXT, VISION)
    photo = str(Path(args.photo).resolve())
    text = chat_prompt(path)
    record = smoke.Record("gemma4_vision_vs_mlx_vlm")
    stacks = ("ours", "mlx_vlm") if args.mlx_vlm_path or smoke.installed("mlx_vlm") else ("ours",)
    if len(stacks) == 1:
        record.missing("mlx_vlm", "mlx-vlm is not installed and no --mlx-vlm-path", ours=False, package="mlx_vlm")
        print("mlx-vlm is not installed (and no --mlx-vlm-path): our row only", flush=True)
    children = {which: Child(which, path, text, photo, args.max_soft_tokens, args.mlx_vlm_path) for which in stacks}
    loads = [os.getloadavg()[0]]
    try:
        for c in children.values():
            c.read()  # loaded (the two load side by side)
        for c in children.values():
            c.ask("run 4")  # warm-up, one at a time
            c.ask("reset")
        runs: dict[str, list[dict]] = {which: [] for which in stacks}
        for i in range(args.runs):
            for which in stacks if i % 2 == 0 else stacks[::-1]:
                runs[which].append(children[which].ask(f"run {args.gen}"))
                loads.append(os.getloadavg()[0])
        check = children["mlx_vlm"].ask("check")["tokens"] if "mlx_vlm" in children else None
        summaries = {which: c.ask("done") for which, c in children.items()}
    finally:
        for c in children.values():
            if c.process.poll() is None:
                c.process.kill()
    rows = {}
    for which, found in runs.items():
        row = {key: statistics.median(r[key] for r in found) for key in METRICS}
        row.update(summaries[which], tokens=found[0]["tokens"], ids=found[0]["ids"], image_tokens=found[0]["image_tokens"],
                   same_tokens_every_run=all(r["tokens"] == found[0]["tokens"] for r in found))  # fmt: skip
        rows[which] = row
        record.row(which, row["tokens"], ours=which == "ours", **{key: row[key] for key in METRICS})
    if "mlx_vlm" not in rows:
        o = rows["ours"]
        print(f"ours: {o['image_tokens']} image tokens; " + ", ".join(f"{key} {o[key]:.3f}" for key in METRICS))
        return record.finish() if args.smoke else None
    o, p = rows["ours"], rows["mlx_vlm"]
    ratio = {key: statistics.median(a[key] / b[key] for a, b in zip(runs["ours"], runs["mlx_vlm"])) for key in METRICS}
    t, v = text_sizes, vision_sizes
    print(f"Gemma 4 random multimodal checkpoint (text: hidden {t['hidden_size']}, {t['num_hidden_layers']} layers, "
          f"vocab {t['vocab_size']}, PLE {t['hidden_size_per_layer_input']}, {t['num_kv_shared_layers']} KV-shared; "
          f"vision: hidden {v['hidden_size']}, {v['num_hidden_layers']} layers; float32), photo {Path(args.photo).name}, "
          f"budget {args.max_soft_tokens}: {o['image_tokens']} image tokens, {len(o['ids'])} prompt positions; "
          f"{args.gen} greedy tokens after the first; median of {args.runs} alternating runs per stack after a warm-up")  # fmt: skip
    print(f"{o['blas']}; 1-minute load average {min(loads):.1f}-{max(loads):.1f}")
    print()
    print("| stack | preprocess s | vision tower s | prefill s | time to first token s | decode tok/s | peak memory GB |")
    print("|---|---|---|---|---|---|---|")
    for name, row in (("ours", o), ("mlx-vlm 0.7.10 `gemma4`", p)):
        print(f"| {name} | {row['preprocess_s']:.3f} | {row['vision_s']:.2f} | {row['prefill_s']:.2f} | "
              f"{row['ttft_s']:.2f} | {row['decode_tps']:.1f} | {row['peak_gb']:.2f} |")  # fmt: skip
    print(f"| ours / mlx-vlm | {ratio['preprocess_s']:.2f}x | {ratio['vision_s']:.2f}x | {ratio['prefill_s']:.2f}x | "
          f"{ratio['ttft_s']:.2f}x | {ratio['decode_tps']:.2f}x | {o['peak_gb'] / p['peak_gb']:.2f}x |")
    print()
    same_ids = o["ids"] == p["ids"]
    print(f"prompt ids identical: {same_ids} ({len(o['ids'])} vs {len(p['ids'])} positions; "
          f"image tokens {o['image_tokens']} vs {p['image_tokens']})")
    n = agreeing_prefix(o["tokens"][:COMPARED], p["tokens"][:COMPARED])
    print(f"first {COMPARED} greedy tokens: ours {o['tokens'][:COMPARED]}, mlx-vlm {p['tokens'][:COMPARED]}: "
          f"{'agree' if n == COMPARED else f'agree on the first {n}'}")
    m = agreeing_prefix(o["tokens"][:COMPARED], check[:COMPARED])
    print(f"mlx-vlm with its image overlay on sliding layers only (transformers' rule): {check[:COMPARED]}: "
          f"{'agree' if m == COMPARED else f'agree on the first {m}'} with ours")
    if not same_ids:
        print("WARNING: the stacks did not read the same prompt; the comparison is not like for like")
    for name, which in (("ours", "ours"), ("mlx-vlm", "mlx_vlm")):
        row, found = rows[which], runs[which]
        spread = ", ".join(f"{key} {min(r[key] for r in found):.2f}-{max(r[key] for r in found):.2f}"
                           for key in ("vision_s", "prefill_s", "ttft_s", "decode_tps"))  # fmt: skip
        print(f"{name}: load {row['load_s']:.1f} s (side by side), weights resident {row['weights_gb']:.2f} GB; "
              f"runs: {spread}; same greedy tokens in every run: {row['same_tokens_every_run']}")
    print(f"total {time.perf_counter() - began:.0f} s")
    if args.smoke:
        if not same_ids:
            record.missing("mlx_vlm", "did not read the same prompt ids as ours", ours=False)
        record.stacks["mlx_vlm (transformers' overlay rule)"] = dict(record.stacks["mlx_vlm"], ids=check[: len(o["tokens"])])
        record.agree("ours", "mlx_vlm (transformers' overlay rule)")
        record.finish()


if __name__ == "__main__":
    main()
