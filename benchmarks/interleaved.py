"""Decode and prefill of several stacks, run after run in turn: ratios on a busy machine.

    python -m benchmarks.interleaved                                  # 270M: float32, 8-bit, 4-bit, llama.cpp
    python -m benchmarks.interleaved --models gemma-3-270m-8bit,llama.cpp --rounds 9
    python -m benchmarks.interleaved --smoke   # a tiny random Gemma 3 (llama.cpp: the real GGUF), one round

``benchmarks.speed`` runs each stack in its own process, minutes apart; on a shared machine whose
load swings a slow spell then hits one stack and not the next. Here every stack is loaded once and the timed runs go
round-robin (stack A, B, C, A, B, C, ...), so a slow spell hits every stack alike; each cell is the
median of ``--rounds`` runs with its range, and the ratios are taken per round (each against the
first stack's run of the same round) before the median. Workload as ``benchmarks.speed``: a
``--prompt``-token prompt of random ids (``numpy.random.default_rng(0)``), then ``--gen`` greedy
tokens; every run starts after ``GAP`` seconds of idle (threads still spinning after the
previous stack's run, ours or a peer's, have gone to sleep).

Our stacks (zoo names or folders, through ``models.load``, as a user gets them) share this
process. The peers run as their users get them, each in its own worker process that imports
nothing of the zoo (``benchmarks.peers``) and runs only when this process hands it a run and
waits: ``llama.cpp`` (llama-cpp-python on the 270M's Q4_K_M GGUF, 2 threads) and ``torch``
(transformers on the float32 270M, 2 threads), set up as in ``benchmarks.speed``. In one process
with ours, llama.cpp decoded 2-3x slower: MKL's Intel OpenMP (loaded by ``zoo_cpu.blas``, with
``KMP_BLOCKTIME=0``) then serves ggml's OpenMP calls too (docs/speed.md, "Measured").
Peak memory is not reported: our stacks share the process.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.peers import Peer
from benchmarks.speed import PEERS, cell, gemma3_folder, gemma3_gguf, prompt_ids, quantized_folder, run_ours, setup

GAP = 0.5  # seconds of idle before every timed run


def load(name: str, folder: Path) -> tuple[str, callable]:
    """``(notes, run(prompt, gen))`` for a stack name; torch loads the float32 ``folder``."""
    if name in PEERS:
        peer = Peer(name, gemma3_gguf() if name == "llama.cpp" else folder)
        return peer.notes, peer.generate
    from models.zoo import zoo_folder

    state = setup("ours", zoo_folder(name) or Path(name), {})
    return state["notes"], lambda prompt, gen: run_ours(state, prompt, gen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,gemma-3-270m-8bit,gemma-3-270m-4bit,llama.cpp")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    folder = gemma3_folder()
    record = smoke.Record("interleaved")
    if args.smoke:
        folder = smoke.tiny_checkpoint("gemma3")
        args.models, args.prompt, args.gen, args.rounds = f"{folder},{quantized_folder(folder, 8)},torch,llama.cpp", 32, 4, 1
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if "llama.cpp" in names and not smoke.installed("llama_cpp"):
        names.remove("llama.cpp")
        record.missing("llama.cpp", "llama-cpp-python is not installed (optional)", ours=False, package="llama_cpp")
        print("llama.cpp: llama-cpp-python is not installed (optional); its row is left out", flush=True)
    stacks = {name: load(name, folder) for name in names}
    prompt = prompt_ids(args.prompt)
    for _, run in stacks.values():
        run(prompt[:64], 8)  # warm-up
    prefill = {n: [] for n in names}
    decode = {n: [] for n in names}
    ids = {}
    start_load = os.getloadavg()[0]
    for _ in range(args.rounds):
        for name, (_, run) in stacks.items():
            time.sleep(GAP)
            first, rest, out = run(prompt, args.gen)
            prefill[name].append(args.prompt / first)
            decode[name].append((len(out) - 1) / rest)
            ids[name] = out[:8]
    base = names[0]
    print(
        f"Prompt {args.prompt}, {args.gen} greedy tokens, {args.rounds} rounds, stacks in turn (peers in their own "
        f"processes); load average {start_load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end on "
        f"{os.cpu_count()} CPUs."
    )
    print(f"| stack | prefill tok/s | decode tok/s | prefill vs {base} | decode vs {base} | notes |")
    print("|---|---|---|---|---|---|")
    for name in names:
        p, d = prefill[name], decode[name]
        pr = [a / b for a, b in zip(p, prefill[base])]
        dr = [a / b for a, b in zip(d, decode[base])]
        print(
            f"| {name} | {cell(p, 1)} | {cell(d, 2)} | {cell(pr, 2)}x | {cell(dr, 2)}x | "
            f"{stacks[name][0]}; first ids {ids[name][:4]} |"
        )
        record.row(name, ids[name], ours=name not in PEERS, prefill=min(p), decode=min(d))
    if args.smoke:
        record.agree(str(folder), "torch")  # float32, the same weights
        record.finish()


if __name__ == "__main__":
    main()
