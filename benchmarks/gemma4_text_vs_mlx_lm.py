"""Gemma 4 text: our stack against mlx-lm's ``gemma4_text`` on the same checkpoint, in one run.

Builds (once, cached under ``.assets/bench``) a random E2B-shaped checkpoint scaled to fit a small
machine: the full 262,144-token vocabulary, per-layer embeddings, a 4:1 sliding/full pattern,
KV sharing, double-wide MLP on reuse layers, softcap 30. Each implementation runs in its own
process (so peak memory is its own): a prompt of ``--prompt`` random tokens, then ``--gen``
greedy tokens; the median of ``--runs`` timed runs after one warm-up is reported, with the ratios
ours / mlx-lm (above 1 = we are faster, or use less memory for the memory column's inverse).

    python -m benchmarks.gemma4_text_vs_mlx_lm [--prompt 512 --gen 128 --runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / ".assets" / "bench" / "gemma4-e2b-shaped"

E2B_SHAPED = dict(
    vocab_size=262144,
    vocab_size_per_layer_input=262144,
    hidden_size=512,
    intermediate_size=2048,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=1,
    head_dim=64,
    global_head_dim=128,
    hidden_size_per_layer_input=32,
    num_kv_shared_layers=4,
    use_double_wide_mlp=True,
    sliding_window=512,
    layer_types=["sliding_attention"] * 4 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"],
    final_logit_softcapping=30.0,
    max_position_embeddings=32768,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)


def build_checkpoint() -> Path:
    """Random weights saved by transformers (the layout users have), plus a config mlx-lm reads."""
    if (CHECKPOINT / "model.safetensors").exists():
        return CHECKPOINT
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**E2B_SHAPED, initializer_range=0.02)).eval()
    model.save_pretrained(CHECKPOINT)
    # mlx-lm reads global_head_dim as a plain field; transformers writes per_layer_config instead.
    config = json.loads((CHECKPOINT / "config.json").read_text())
    config.update(global_head_dim=E2B_SHAPED["global_head_dim"])
    (CHECKPOINT / "config.json").write_text(json.dumps(config, indent=2))
    return CHECKPOINT


def run_ours(path: Path, prompt: list[int], gen: int) -> tuple[float, float]:
    import mlx.core as mx

    import models
    from models.generate import generate_tokens, prefill

    model = models.load(str(path), tokenizer=False)
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model.forward, prompt, cache))
    prefill_s = time.perf_counter() - start
    cache = model.make_cache()
    tokens = generate_tokens(model.forward, prompt, cache, max_tokens=gen)
    next(tokens)  # prefill + first token
    start = time.perf_counter()
    n = sum(1 for _ in tokens)
    return prefill_s, (time.perf_counter() - start) / max(n, 1)


def run_mlx_lm(path: Path, prompt: list[int], gen: int) -> tuple[float, float]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    for i in range(0, len(prompt), 512):
        out = model(mx.array([prompt[i : i + 512]]), cache=cache)
        mx.eval(out[:, -1])
    prefill_s = time.perf_counter() - start
    steps = generate_step(mx.array(prompt), model, max_tokens=gen + 1)
    next(steps)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    return prefill_s, (time.perf_counter() - start) / max(n, 1)


def child(which: str, path: str, n_prompt: int, gen: int, runs: int) -> None:
    import zoo_blas  # noqa: F401  (the same BLAS for both stacks, loaded before MLX)

    import mlx.core as mx
    import numpy as np

    prompt = [2] + np.random.default_rng(0).integers(1000, 200000, n_prompt - 1).tolist()
    run = run_ours if which == "ours" else run_mlx_lm
    run(Path(path), prompt[:64], 8)  # warm-up
    results = [run(Path(path), prompt, gen) for _ in range(runs)]
    print(
        json.dumps(
            {
                "prefill_tps": statistics.median(n_prompt / p for p, _ in results),
                "decode_tps": statistics.median(1 / d for _, d in results),
                "peak_gb": mx.get_peak_memory() / 1e9,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", choices=["ours", "mlx_lm"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.prompt, args.gen, args.runs)
        return
    path = build_checkpoint()
    rows = {}
    for which in ("ours", "mlx_lm"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.gemma4_text_vs_mlx_lm", "--child", which, "--path", str(path),
             "--prompt", str(args.prompt), "--gen", str(args.gen), "--runs", str(args.runs)],
            cwd=ROOT, capture_output=True, text=True, check=True,
        )
        rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
    ours, peer = rows["ours"], rows["mlx_lm"]
    print(f"Gemma 4 E2B-shaped random checkpoint, prompt {args.prompt}, {args.gen} greedy tokens, median of {args.runs}")
    print("| stack | prefill tok/s | decode tok/s | peak memory GB |")
    print("|---|---|---|---|")
    for name, row in (("ours", ours), ("mlx-lm", peer)):
        print(f"| {name} | {row['prefill_tps']:.1f} | {row['decode_tps']:.2f} | {row['peak_gb']:.2f} |")
    print(
        f"| ours / mlx-lm | {ours['prefill_tps'] / peer['prefill_tps']:.2f}x | "
        f"{ours['decode_tps'] / peer['decode_tps']:.2f}x | {ours['peak_gb'] / peer['peak_gb']:.2f}x |"
    )


if __name__ == "__main__":
    main()
