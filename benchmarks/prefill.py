"""Prefill only: ours (float32 with and without the prefill kernels, 8-bit, 4-bit) against
transformers + torch float32, runs in turn, ratios per round.

    python -m benchmarks.prefill                       # the real Gemma 3 270M and its zoo 8/4-bit folders
    python -m benchmarks.prefill --gemma4              # the E2B-shaped Gemma 4 (benchmarks.speed's folders)
    python -m benchmarks.prefill --models gemma-3-270m --torch gemma-3-270m --prompt 2048 --rounds 9
    python -m benchmarks.prefill --smoke     # a tiny random Gemma 3 and its 8-bit folder, one round

The workload is a prompt of ``--prompt`` random ids (``benchmarks.speed.prompt_ids``) fed to a
fresh cache as a user's generation does (``models.generation.generate.prefill``: chunks of 512,
logits of the last position); torch runs ``model(ids, logits_to_keep=1)`` with a fresh cache, as
its ``generate`` prefills (``attn_implementation="sdpa"``), with 2 threads (the comparison) and 1
(``--torch-threads``): on a shared machine torch's two OpenMP threads collapse when another process
holds a core, and the one-thread row shows how much. Our stacks share this process
(``kernels off`` is the float32 model with ``GEMMA_ZOO_PREFILL_KERNELS=0``, the compiled MLX
chains and MKL's GEMM); torch runs in worker processes that import nothing of the zoo
(``benchmarks.peers``: MKL's Intel OpenMP, which ``zoo_cpu.blas`` loads, would otherwise also serve
torch's OpenMP calls) and computes only when handed a run. Runs go round-robin after ``GAP``
seconds of idle each, so a slow spell of a shared machine hits every stack alike; each cell is the median [range] of ``--rounds``, the ratios are per
round (against torch with 2 threads, and against our float32 model with the kernels off). The load
average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks import smoke
from benchmarks.peers import Peer
from benchmarks.speed import cell, prompt_ids, quantized_folder

GAP = 0.5  # seconds of idle before every timed run
GEMMA3 = ("gemma-3-270m", "gemma-3-270m-8bit", "gemma-3-270m-4bit")


class Ours:
    """One of our stacks: a zoo name or folder loaded as users load it; ``switches`` are in effect
    (``switches.override``) during its runs."""

    def __init__(self, name: str, label: str, switches: dict[str, str] | None = None, model=None):
        import models
        from models.zoo import zoo_folder

        self.label, self.switches = label, switches or {}
        self.model = model or models.load(str(zoo_folder(name) or name), tokenizer=False)

    def run(self, prompt: list[int]) -> float:
        from zoo_cpu import switches
        from models.generation.generate import prefill

        with switches.override(**self.switches):
            start = time.perf_counter()
            prefill(self.model.forward, prompt, self.model.make_cache())
            return time.perf_counter() - start


class Torch:
    """transformers + torch on a float32 folder with ``threads`` threads, in a clean worker process
    (``benchmarks.peers``)."""

    def __init__(self, folder: Path, threads: int):
        self.label = f"transformers + torch float32, {threads} thread{'s' if threads > 1 else ''}"
        self.peer = Peer("torch", folder, threads)
        self.notes, self.run, self.close = self.peer.notes, self.peer.prefill, self.peer.close


def gemma4_folders() -> tuple[list[str], Path]:
    """The E2B-shaped Gemma 4 (built once by ``benchmarks.gemma4_text_vs_mlx_lm``) and the 8/4-bit
    folders ``benchmarks.speed`` converted beside it, where they exist."""
    from benchmarks.gemma4_text_vs_mlx_lm import build_checkpoint

    folder = build_checkpoint()
    quantized = [str(p) for bits in (8, 4) for p in sorted(folder.parent.glob(f"{folder.name}-{bits}bit-*"))[:1]]
    return [str(folder), *quantized], folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="our stacks, comma-separated zoo names or folders (first: float32)")
    parser.add_argument("--torch", help="the float32 folder or zoo name torch loads (default: the first of --models)")
    parser.add_argument("--gemma4", action="store_true", help="the E2B-shaped Gemma 4 and its 8/4-bit folders")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--torch-threads", default="2,1", help="a torch worker per thread count (the first: the ratios)")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    if args.smoke:
        tiny = smoke.tiny_checkpoint("gemma3")
        args.models, args.prompt, args.rounds, args.torch_threads = f"{tiny},{quantized_folder(tiny, 8)}", 32, 1, "2"
    if args.gemma4:
        names, torch_folder = gemma4_folders()
    else:
        from models.zoo import zoo_folder

        names = args.models.split(",") if args.models else list(GEMMA3)
        torch_folder = zoo_folder(args.torch or names[0]) or Path(args.torch or names[0])
    load_start = os.getloadavg()[0]
    torches = [Torch(torch_folder, int(n)) for n in args.torch_threads.split(",")]
    torch_stack = torches[0]
    first = Ours(names[0], f"ours {Path(names[0]).name}, float32")
    stacks = [
        first,
        Ours(names[0], "  the same, GEMMA_ZOO_PREFILL_KERNELS=0", {"GEMMA_ZOO_PREFILL_KERNELS": "0"}, first.model),
        *(Ours(name, f"ours {Path(name).name}") for name in names[1:]),
        *torches,
    ]
    prompt = prompt_ids(args.prompt)
    for stack in stacks:
        stack.run(prompt[:64])  # warm-up
    times: dict[str, list[float]] = {s.label: [] for s in stacks}
    for _ in range(args.rounds):
        for stack in stacks:
            time.sleep(GAP)
            times[stack.label].append(stack.run(prompt))
    for worker_stack in torches:
        worker_stack.close()
    print(
        f"Prefill of a {args.prompt}-token prompt, {args.rounds} rounds, stacks in turn (torch in its own process); "
        f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end on {os.cpu_count()} CPUs."
    )
    record = smoke.Record("prefill")
    print(f"| stack | prefill tok/s | vs torch ({torch_stack.label.split(', ')[-1]}) | vs kernels off |")
    print("|---|---|---|---|")
    for stack in stacks:
        rates = [args.prompt / t for t in times[stack.label]]
        ratios = [cell([r / t for t, r in zip(times[stack.label], times[s.label])], 2) for s in (torch_stack, stacks[1])]
        print(f"| {stack.label} | {cell(rates, 1)} | {ratios[0]}x | {ratios[1]}x |")
        record.row(stack.label, ours=not isinstance(stack, Torch), prefill=min(rates))
    print(f"\ntorch: {torch_stack.notes}; ours: {'; '.join(first.model.device_notes)}")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
