"""Where a batched decode step's time goes on the real Gemma 3 270M: the rows' attention reads
(each row's cache write and read) against the whole step (projections, MLPs and head shared by all rows).

    python -m benchmarks.batch_step [--rows 16 --prompt 128 --steps 20]
    python -m benchmarks.batch_step --smoke   # a tiny random Gemma 3, 3 rows, one step (benchmarks.smoke)

``--rows`` conversations are prefilled alone (BOS + random ids, lengths staggered by 8 as in
``benchmarks.batching``), then, interleaved ``--steps`` times: one decode step of all rows as
``BatchGenerator`` makes it (``batch_caches`` + one forward, greedy), its graph-building time alone
(Python, before evaluation), and the layers' cache reads alone (each layer's ``BatchCache.decode``
with random queries, keys and values of that layer's shapes, evaluated together). Every timed step
is trimmed back, so the rows keep their lengths. Medians [range] in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks import smoke
from benchmarks.batching import prompts
from benchmarks.speed import cell, gemma3_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        args.rows, args.prompt, args.steps = 3, 16, 1

    import models  # first: the fast BLAS loads before MLX (zoo_cpu.blas)

    import mlx.core as mx
    from cache import batch_caches
    from models.generation.generate import prefill
    from zoo_cpu import backend

    model = models.load(str(smoke.tiny_checkpoint("gemma3") if args.smoke else gemma3_folder()), tokenizer=False)
    rows = []
    for ids in prompts(args.rows, args.prompt):
        cache = model.make_cache()
        prefill(model._forward, ids, cache)
        rows.append(cache)
    config = model.graph.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    tokens = mx.array([[5] for _ in rows])
    B = len(rows)

    def step() -> tuple[float, float]:
        t = time.perf_counter()
        logits = model.graph(tokens, cache=batch_caches(rows), last_only=True)[:, -1]
        built = time.perf_counter() - t
        mx.eval(mx.argmax(logits, axis=-1))
        return time.perf_counter() - t, built

    def reads() -> float:
        layers = batch_caches(rows)
        q = mx.random.normal((B, heads, 1, head_dim))
        k, v = mx.random.normal((B, kv_heads, 1, head_dim)), mx.random.normal((B, kv_heads, 1, head_dim))
        mx.eval(q, k, v)
        t = time.perf_counter()
        mx.eval([layer.decode(q, k, v, scale=0.0625) for layer in layers])
        return time.perf_counter() - t

    def trim() -> None:
        for caches in rows:
            for cache in caches:
                cache.trim(1)

    step(), trim(), reads(), trim()  # warm-up: allocations off the clock
    steps, builds, attention = [], [], []
    for _ in range(args.steps):
        s, b = step()
        trim()
        steps.append(s * 1e3)
        builds.append(b * 1e3)
        attention.append(reads() * 1e3)
        trim()
    if args.smoke:
        record = smoke.Record("batch_step")
        record.row("ours", step_ms=statistics.median(steps), building_ms=statistics.median(builds),
                   reads_ms=statistics.median(attention))  # fmt: skip
        record.finish()
        return
    print(f"{B} rows, prompts ~{args.prompt} tokens staggered by 8, {args.steps} interleaved steps; decode kernels "
          f"{'on' if backend.active().decode else 'off'}; load average {os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    print(f"| step ms | graph building ms (in the step) | cache reads alone ms | reads / step |")
    print(f"|---|---|---|---|")
    share = sorted(a / s for a, s in zip(attention, steps))[len(steps) // 2]
    print(f"| {cell(steps)} | {cell(builds)} | {cell(attention)} | {share:.2f} |")


if __name__ == "__main__":
    main()
