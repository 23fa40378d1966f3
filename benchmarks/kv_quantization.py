"""Quantized KV caches: storage per token, peak memory, prefill and decode speed, against full precision
and against mlx-lm's ``--kv-bits`` on the same checkpoint, in one run.

Uses the E2B-shaped random Gemma 4 of ``benchmarks.gemma4_text_vs_mlx_lm`` (sliding and full
layers, KV sharing). Each configuration runs in its own process: a prompt of ``--prompt`` tokens
(prefill chunks of 512), then ``--gen`` greedy tokens; the median of ``--runs`` runs. A smoke run
takes one process per stack for all three configurations (its numbers are not measurements).

    python -m benchmarks.kv_quantization [--prompt 4096 --gen 64 --runs 3]
    python -m benchmarks.kv_quantization --smoke   # a tiny random Gemma 4, one run (benchmarks.smoke)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import zoo_cpu  # noqa: F401  (the same fast BLAS for both stacks, loaded before MLX in each child)
from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("full precision", None), ("kv 8-bit", 8), ("kv 4-bit", 4)]


def run_ours(path: str, prompt: list[int], gen: int, bits: int | None):
    import mlx.core as mx

    import models
    from models.generation.generate import KVQuantization, generate_tokens
    from cache import owning_caches

    mx.reset_peak_memory()
    model = models.load(path, tokenizer=False)
    cache = model.make_cache()
    kv = KVQuantization(bits, 64, start=0) if bits else None
    began = time.perf_counter()
    tokens = generate_tokens(model.forward, prompt, cache, max_tokens=gen, kv_quantization=kv, overlap=model.overlap)
    next(tokens)
    start = time.perf_counter()
    n = sum(1 for _ in tokens)
    per_token = (time.perf_counter() - start) / max(n, 1)
    layers = owning_caches(cache)
    return {
        "prefill_tps": len(prompt) / (start - began),
        "decode_tps": 1 / per_token,
        "cache_mb": sum(c.nbytes for c in layers) / 1e6,
        "bytes_per_token": sum(c.bytes_per_token for c in layers),
        "peak_gb": mx.get_peak_memory() / 1e9,
    }


def run_mlx_lm(path: str, prompt: list[int], gen: int, bits: int | None):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    mx.reset_peak_memory()
    model, _ = load_model(Path(path))
    options = dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=0) if bits else {}
    began = time.perf_counter()
    steps = generate_step(mx.array(prompt), model, max_tokens=gen + 1, prefill_step_size=512, **options)
    next(steps)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    return {"prefill_tps": len(prompt) / (start - began), "decode_tps": n / (time.perf_counter() - start),
            "peak_gb": mx.get_peak_memory() / 1e9}  # fmt: skip


def child(which: str, path: str, n_prompt: int, gen: int, runs: int, configs: list[int | None]) -> None:
    """Prints one JSON object: each configuration's (its bits, "None" for full precision) medians or error."""
    import zoo_cpu  # noqa: F401  (the same BLAS for both stacks, loaded before MLX)

    import numpy as np

    prompt = [2] + np.random.default_rng(0).integers(1000, 200000, n_prompt - 1).tolist()
    run = run_ours if which == "ours" else run_mlx_lm
    out = {}
    for bits in configs:
        try:
            results = [run(path, prompt, gen, bits) for _ in range(runs)]
        except Exception as err:  # a peer that crashes is a measured result, reported as such
            out[str(bits)] = {"error": f"{type(err).__name__}: {err}"[:160]}
            continue
        out[str(bits)] = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(json.dumps(out))


def spawn(which: str, path: Path, args, configs: list[int | None]) -> dict:
    """``configs`` run in one child process: {bits: result or {"error": ...}}."""
    command = [sys.executable, "-m", "benchmarks.kv_quantization", "--child", which, "--path", str(path),
               "--prompt", str(args.prompt), "--gen", str(args.gen), "--runs", str(args.runs),
               "--bits", ",".join(str(bits or 0) for bits in configs)]  # fmt: skip
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if not lines:
        return {bits: {"error": out.stderr.strip()[-160:]} for bits in configs}
    results = json.loads(lines[-1])
    return {bits: results[str(bits)] for bits in configs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    parser.add_argument("--child", choices=["ours", "mlx_lm"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--bits", default="0", help=argparse.SUPPRESS)  # comma-separated; 0: full precision
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.prompt, args.gen, args.runs, [int(b) or None for b in args.bits.split(",")])
        return
    from benchmarks.gemma4_text_vs_mlx_lm import build_checkpoint

    if args.smoke:
        args.prompt, args.gen, args.runs = 80, 4, 1
    path = smoke.tiny_checkpoint("gemma4") if args.smoke else build_checkpoint()
    record = smoke.Record("kv_quantization")
    rows = {}
    for which in ("ours", "mlx_lm"):
        # one process per configuration (its own peak memory), except in a smoke run: one per stack
        batches = [[bits for _, bits in CONFIGS]] if args.smoke else [[bits] for _, bits in CONFIGS]
        results = {bits: r for configs in batches for bits, r in spawn(which, path, args, configs).items()}
        for name, bits in CONFIGS:
            rows[which, name] = results[bits]
            label, result = f"{which} {name}", rows[which, name]
            if "error" in result and which == "mlx_lm" and result["error"].startswith("NotImplementedError"):
                record.unsupported(label, result["error"])  # mlx-lm quantizes no rotating cache: a measured result
            elif "error" in result:
                record.missing(label, result["error"], ours=which == "ours", package="mlx_lm")
            else:
                record.row(label, None, ours=which == "ours", prefill=result["prefill_tps"], decode=result["decode_tps"])
    print(f"E2B-shaped random Gemma 4, prompt {args.prompt}, {args.gen} greedy tokens, median of {args.runs}")
    print("| cache | ours prefill tok/s | ours decode tok/s | ours cache MB | ours bytes/token | ours peak GB | "
          "mlx-lm prefill tok/s | mlx-lm decode tok/s | mlx-lm peak GB | decode ours/mlx-lm |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in CONFIGS:
        ours, peer = rows["ours", name], rows["mlx_lm", name]
        if "error" in ours:
            print(f"| {name} | error: {ours['error']} |")
            continue
        peer_cells = (f"{peer['prefill_tps']:.1f} | {peer['decode_tps']:.2f} | {peer['peak_gb']:.2f} | "
                      f"{ours['decode_tps'] / peer['decode_tps']:.2f}x"
                      if "error" not in peer else f"fails: {peer['error']} | – | – | –")  # fmt: skip
        print(f"| {name} | {ours['prefill_tps']:.1f} | {ours['decode_tps']:.2f} | {ours['cache_mb']:.1f} | "
              f"{ours['bytes_per_token']} | {ours['peak_gb']:.2f} | {peer_cells} |")  # fmt: skip
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
