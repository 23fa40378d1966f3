"""Long contexts: prefill and decode at each prompt length, with float keys and values and with 8-bit
ones on the full-attention layers, and what the 8-bit ones cost in quality (KL against float).

    python -m benchmarks.long_context                       # the real 270M, 8-bit and float32 weights
    python -m benchmarks.long_context --models gemma-3-270m-8bit --prompt-tokens 512,8192,32704 --gen 32
    python -m benchmarks.long_context --smoke               # a tiny random Gemma 3 (benchmarks.smoke)
    python -m benchmarks.long_context --reads --prompt-tokens 512,8192,32704   # one layer's decode read

For each model (zoo names or folders, loaded as users load them) and prompt length: the prompt
(``benchmarks.speed.prompt_ids``) but its last token is prefilled once into a fresh cache
(``models.generation.generate.prefill``, chunks of 512: the prefill rate), and the filled cache
is copied (``state`` / ``from_state``) for each variant:

- ``float KV``: the copy as it is;
- ``8-bit KV on full layers``: its full-attention caches replaced by their 8-bit twins (group 64,
  ``to_quantized``); the sliding layers keep float keys and values (they hold one window).

Each variant then decodes ``--gen`` greedy tokens from the last prompt token through
``generate_tokens`` (the loop users get; decode tok/s as ``benchmarks.speed`` counts it), and the
bytes one decode step reads are the weights (as stored) plus every cache's stored planes at the
end of the prompt; the ceiling is the measured bandwidth (``benchmarks.speed.bandwidth_gbs``) over
those bytes. Quality: the float variant's tokens are fed again to fresh copies of both variants
one by one (teacher forcing), and the KL of the 8-bit variant's next-token distribution from the
float one's is averaged over the positions (max also shown), with top-1 agreement.

``--reads``: one full-attention layer's decode read alone (the 270M's shape: 4 query heads over one
kv head of width 256), the same run of T stored rows through the float decode kernel, the 8- and
4-bit decode kernel and MLX's ``quantized_matmul`` pair (the zoo's decode kernels off), interleaved, the
median of ``--repeats`` calls each; GB/s is the planes' bytes over the time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import zoo_cpu  # noqa: F401  (the fast BLAS, before mlx)

import mlx.core as mx
import numpy as np

from benchmarks import smoke
from benchmarks.speed import bandwidth_gbs, prompt_ids, quantized_folder
from cache import KVCache


def copy_cache(cache: list, kv_bits: int | None) -> list:
    """A copy of a filled cache; with ``kv_bits``, its full-attention caches quantized."""
    out = []
    for c in cache:
        twin = type(c).from_state(c.state)
        if kv_bits and type(twin) is KVCache:
            twin = twin.to_quantized(kv_bits, 64)
        out.append(twin)
    return out


def decode(model, last: int, cache: list, gen: int) -> tuple[float, list[int]]:
    """Greedy tokens after ``last`` through the users' loop: (decode tok/s, the ids)."""
    from models.generation.generate import generate_tokens

    tokens = generate_tokens(model.forward, [last], cache, max_tokens=gen, overlap=model.overlap)
    ids = [next(tokens)]
    first = time.perf_counter()
    ids += list(tokens)
    return (len(ids) - 1) / (time.perf_counter() - first), ids


def log_probs(model, tokens: list[int], cache: list) -> np.ndarray:
    """Next-token log-probabilities after each of ``tokens``, fed one by one."""
    out = []
    for t in tokens:
        logits = model.forward(mx.array([[t]]), cache)[0, -1].astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits)))
    return np.stack(out).astype(np.float64)


def measure(model, n_prompt: int, gen: int, bandwidth: float, weight_bytes: int) -> dict:
    from models.generation.generate import prefill

    prompt = prompt_ids(n_prompt)
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model.forward, prompt[:-1], cache))
    result = {"prefill_tps": (n_prompt - 1) / (time.perf_counter() - start)}
    for name, bits in (("float KV", None), ("8-bit KV on full layers", 8)):
        variant = copy_cache(cache, bits)
        step_bytes = weight_bytes + sum(c.nbytes for c in variant)
        tps, ids = decode(model, prompt[-1], variant, gen)
        result[name] = {"decode_tps": tps, "ids": ids, "step_mb": step_bytes / 1e6,
                        "ceiling_tps": bandwidth * 1e9 / step_bytes}  # fmt: skip
    fed = [prompt[-1]] + result["float KV"]["ids"][:-1]
    ref, mine = (log_probs(model, fed, copy_cache(cache, bits)) for bits in (None, 8))
    kl = (np.exp(ref) * (ref - mine)).sum(-1)
    result["kl_mean"], result["kl_max"] = float(kl.mean()), float(kl.max())
    result["top1"] = float((ref.argmax(-1) == mine.argmax(-1)).mean())
    return result


def read_rates(lengths: list[int], repeats: int) -> None:
    """Print one layer's decode read at each length: ms and GB/s per way of reading the planes."""
    from dataclasses import replace

    from cache.codecs import Dense, Quantized
    from zoo_cpu import backend

    rng = np.random.default_rng(0)
    ways = {"float kernel": (Dense(), True), "8-bit kernel": (Quantized(8, 64), True),
            "4-bit kernel": (Quantized(4, 64), True), "8-bit, MLX quantized_matmul": (Quantized(8, 64), False)}  # fmt: skip
    print(f"one layer's decode read (q [1, 4, 1, 256] over [1, 1, T, 256] keys and values), median of {repeats}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print("| T | read | MB | ms | GB/s | vs float kernel |")
    print("|---|---|---|---|---|---|")
    for T in lengths:
        q = mx.array(rng.standard_normal((1, 4, 1, 256)).astype(np.float32))
        kv = [mx.array(rng.standard_normal((1, 1, T, 256)).astype(np.float32)) for _ in range(2)]
        planes = {name: [codec.pack(x) for x in kv] for name, (codec, _) in ways.items()}
        mx.eval(planes)
        times = {name: [] for name in ways}
        for _ in range(repeats):
            for name, (codec, kernels) in ways.items():
                with backend.using(replace(backend.active(), decode=kernels)):
                    start = time.perf_counter()
                    mx.eval(codec.attend(q, *planes[name], 0.0625, None))
                    times[name].append(time.perf_counter() - start)
        base = statistics.median(times["float kernel"])
        for name in ways:
            t = statistics.median(times[name])
            mb = sum(p.nbytes for x in planes[name] for p in x) / 1e6
            print(f"| {T} | {name} | {mb:.1f} | {1e3 * t:.2f} | {mb / 1e3 / t:.1f} | {base / t:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m-8bit,gemma-3-270m")
    parser.add_argument("--prompt-tokens", default="512,8192,32704", help="comma-separated prompt lengths")
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--runs", type=int, default=1, help="measurements per (model, length); cells are medians")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    parser.add_argument("--reads", action="store_true", help="time one layer's decode read only (see above)")
    parser.add_argument("--repeats", type=int, default=15, help="calls per read with --reads")
    args = parser.parse_args()
    if args.reads:
        read_rates([int(n) for n in args.prompt_tokens.split(",")], args.repeats)
        return
    record = smoke.Record("long_context")
    if args.smoke:
        tiny = smoke.tiny_checkpoint("gemma3")
        args.models, args.prompt_tokens, args.gen, args.runs = f"{tiny},{quantized_folder(tiny, 8)}", "64", 4, 1
    import models
    from mlx.utils import tree_flatten
    from models.zoo import zoo_folder

    bandwidth = bandwidth_gbs(gib=0.125 if args.smoke else 1.0)
    print(f"{args.gen} greedy tokens after each prompt, median of {args.runs}; bandwidth ceiling {bandwidth:.1f} GB/s "
          f"(numpy read, 2 threads, best of 7); load average {os.getloadavg()[0]:.1f} at the start on {os.cpu_count()} CPUs")  # fmt: skip
    print("| model | prompt | prefill tok/s | KV | decode tok/s | MB read per step | % of ceiling | KL mean (max) | top-1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = models.load(str(zoo_folder(name) or name), tokenizer=False)
        weight_bytes = sum(a.nbytes for _, a in tree_flatten(model.graph.parameters()))
        measure(model, 64, 4, bandwidth, weight_bytes)  # warm-up: compiles, allocations
        for n_prompt in (int(n) for n in args.prompt_tokens.split(",")):
            runs = [measure(model, n_prompt, args.gen, bandwidth, weight_bytes) for _ in range(args.runs)]
            prefill = statistics.median(r["prefill_tps"] for r in runs)
            label = os.path.basename(name.rstrip("/"))
            for kv in ("float KV", "8-bit KV on full layers"):
                tps = statistics.median(r[kv]["decode_tps"] for r in runs)
                r = runs[-1]
                quality = "- | -" if kv == "float KV" else f"{r['kl_mean']:.2e} ({r['kl_max']:.2e}) | {r['top1']:.2f}"
                print(f"| {label} | {n_prompt} | {prefill:.1f} | {kv} | {tps:.2f} | {r[kv]['step_mb']:.0f} | "
                      f"{100 * tps / r[kv]['ceiling_tps']:.0f}% of {r[kv]['ceiling_tps']:.1f} | {quality} |", flush=True)  # fmt: skip
                record.row(f"{label} {n_prompt} {kv}", r[kv]["ids"], prefill=prefill, decode=tps)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
