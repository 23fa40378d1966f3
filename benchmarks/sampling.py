"""One token's sampling over the vocabulary, three ways in one process, in turn: ours on the CPU
plan (``TokenSampler`` on the extension's sampling primitives, ``zoo_cpu.sampling``), the same
sampler on MLX's ops (the accelerator plan's path, run here on MLX's CPU device) and mlx-lm's
``make_sampler`` (its filters, then its categorical draw), each from the logits of one position.

    python -m benchmarks.sampling                          # 262,144 words, peaked and flat rows
    python -m benchmarks.sampling --vocab 32768 --rounds 9
    python -m benchmarks.sampling --smoke                  # tiny sizes, one round (benchmarks.smoke)

Each way includes its log-softmax (ours and the MLX path: ``fast_math.log_softmax``; mlx-lm:
``logits - logsumexp``, as its ``generate_step`` does). Requests: temperature alone, top-p alone,
min-p alone and the released Gemma checkpoints' own (top_k 64, top_p 0.95). Rows: a peaked one (20
words far above the rest, as a trained model's next-token row mostly is) and a flat one (random
logits of standard deviation 3: a top-p 0.95 nucleus of tens of thousands of words). A round times
``--calls`` draws of each way in turn; cells are medians over the rounds [range], with the time one
read of the row takes at the machine's read bandwidth as the floor no way can beat.
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
from benchmarks.speed import bandwidth_gbs
from models.generation.generate import SamplingOptions, TokenSampler
from zoo_cpu import backend

REQUESTS = {
    "temperature 0.8": dict(temp=0.8),
    "top_p 0.95": dict(temp=1.0, top_p=0.95),
    "min_p 0.05": dict(temp=1.0, min_p=0.05),
    "checkpoint's (top_k 64, top_p 0.95)": dict(temp=1.0, top_k=64, top_p=0.95),
}
WAYS = ("ours", "ours on MLX's ops", "mlx-lm")


def row_of(kind: str, vocab: int) -> mx.array:
    """Logits [1, vocab] of a peaked or a flat row."""
    rng = np.random.default_rng(vocab)
    if kind == "peaked":
        x = rng.standard_normal(vocab) * 2.0
        x[rng.choice(vocab, min(20, vocab), replace=False)] += 16.0  # 99% of the mass
    else:
        x = rng.standard_normal(vocab) * 3.0
    return mx.array(x[None].astype(np.float32))


def draw_of(way: str, options: dict):
    """A function drawing one token from logits [1, V] the given way (None: mlx-lm not installed)."""
    if way == "mlx-lm":
        if not smoke.installed("mlx_lm"):
            return None
        from mlx_lm.sample_utils import make_sampler

        sampler = make_sampler(temp=options["temp"], top_p=options.get("top_p", 0.0), min_p=options.get("min_p", 0.0),
                               top_k=options.get("top_k", 0))  # fmt: skip
        return lambda logits: sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    plan = backend.for_cpu() if way == "ours" else backend.MLX
    sampler = TokenSampler(SamplingOptions(seed=0, **options))

    def draw(logits):
        with backend.using(plan):
            return sampler(logits)

    return draw


def seconds(draw, logits: mx.array, calls: int) -> float:
    """The median seconds of ``calls`` draws (each evaluated), after one warm-up draw."""
    mx.eval(draw(logits))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(draw(logits))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cell(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):.2f} [{1e3 * min(values):.2f}-{1e3 * max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=9, help="draws a way makes in a round (their median is its time)")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    record = smoke.Record("sampling")
    if args.smoke:
        args.vocab, args.rounds, args.calls = 1024, 1, 2
    bandwidth = bandwidth_gbs(gib=0.125 if args.smoke else 1.0)
    floor_us = 1e6 * args.vocab * 4 / (bandwidth * 1e9)
    print(f"One token's sampling over {args.vocab} words, medians of {args.rounds} rounds [range] (each way's median of "
          f"{args.calls} draws a round, the ways in turn); one read of the row at the read bandwidth "
          f"({bandwidth:.1f} GB/s, numpy, 2 threads): {floor_us:.1f} us; load average {os.getloadavg()[0]:.1f} at the "
          f"start on {os.cpu_count()} CPUs; ours on the extension: {backend.for_cpu().decode}.")  # fmt: skip
    print("| row | request | ours ms | ours on MLX's ops ms | mlx-lm ms | MLX's ops / ours | mlx-lm / ours |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("peaked", "flat"):
        logits = row_of(kind, args.vocab)
        mx.eval(logits)
        for request, options in REQUESTS.items():
            draws = {way: draw_of(way, options) for way in WAYS}
            times = {way: [] for way, draw in draws.items() if draw is not None}
            for _ in range(args.rounds):
                for way in times:
                    times[way].append(seconds(draws[way], logits, args.calls))
            ours = statistics.median(times["ours"])
            cells = [cell(times[way]) if way in times else "not installed" for way in WAYS]
            ratios = [f"{statistics.median(times[way]) / ours:.1f}x" if way in times else "-" for way in WAYS[1:]]
            print(f"| {kind} | {request} | {' | '.join(cells)} | {' | '.join(ratios)} |", flush=True)
            for way in WAYS:
                label = f"{way}, {kind}, {request}"
                if way in times:
                    record.row(label, ours=way != "mlx-lm", ms=1e3 * statistics.median(times[way]))
                else:
                    record.missing(label, "mlx-lm is not installed", ours=False, package="mlx_lm")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
