"""Decode and prefill of several stacks in one process, run after run in turn: ratios on a busy box.

    python -m benchmarks.interleaved                                  # 270M: float32, 8-bit, 4-bit, llama.cpp
    python -m benchmarks.interleaved --models gemma-3-270m-8bit,llama.cpp --rounds 9

``benchmarks.speed`` runs each stack in its own process, minutes apart; on a shared machine whose
load swings (the project's 2-core box often runs other tenants' test suites) a slow spell then
hits one stack and not the next. Here every stack is loaded once into one process and the timed
runs go round-robin (stack A, B, C, A, B, C, ...), so a slow spell hits every stack alike; each
cell is the median of ``--rounds`` runs with its range, and the ratios are taken per round (each
against the first stack's run of the same round) before the median. Workload as ``benchmarks.speed``:
a ``--prompt``-token prompt of random ids (``numpy.random.default_rng(0)``), then ``--gen`` greedy
tokens. Stacks are zoo names or folders (ours, through ``models.load``, as a user gets them) and
``llama.cpp`` (llama-cpp-python on the 270M's Q4_K_M GGUF, 2 threads, as in ``benchmarks.speed``)
and ``torch`` (transformers on the float32 270M, 2 threads, as there).
Peak memory is not reported: every stack shares the process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import zoo_blas  # noqa: F401  (before mlx)


from benchmarks.speed import gemma3_folder, prompt_ids, run_llama, run_ours, run_torch, setup


def load(name: str) -> tuple[dict, callable]:
    if name == "llama.cpp":
        return setup("llama.cpp", Path("."), {}), run_llama
    if name == "torch":
        return setup("torch", gemma3_folder(), {}), run_torch
    from models.zoo import zoo_folder

    return setup("ours", zoo_folder(name) or Path(name), {}), run_ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,gemma-3-270m-8bit,gemma-3-270m-4bit,llama.cpp")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    stacks = {name: load(name) for name in names}
    prompt = prompt_ids(args.prompt)
    for state, run in stacks.values():
        run(state, prompt[:64], 8)  # warm-up
    prefill = {n: [] for n in names}
    decode = {n: [] for n in names}
    ids = {}
    for _ in range(args.rounds):
        for name, (state, run) in stacks.items():
            first, rest, out = run(state, prompt, args.gen)
            prefill[name].append(args.prompt / first)
            decode[name].append((len(out) - 1) / rest)
            ids[name] = out[:8]
    base = names[0]
    print(
        f"Prompt {args.prompt}, {args.gen} greedy tokens, {args.rounds} rounds in one process, stacks in turn; "
        f"load average {os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} CPUs."
    )
    print(f"| stack | prefill tok/s | decode tok/s | prefill vs {base} | decode vs {base} | notes |")
    print("|---|---|---|---|---|---|")
    for name in names:
        p, d = prefill[name], decode[name]
        pr = [a / b for a, b in zip(p, prefill[base])]
        dr = [a / b for a, b in zip(d, decode[base])]
        print(
            f"| {name} | {_cell(p, 1)} | {_cell(d, 2)} | {_cell(pr, 2)}x | {_cell(dr, 2)}x | "
            f"{stacks[name][0]['notes']}; first ids {ids[name][:4]} |"
        )


def _cell(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


if __name__ == "__main__":
    main()
