"""The peers (transformers + torch, llama.cpp) in clean worker processes, for benchmarks that run them in turn with ours.

A peer loaded into our process is not what its users get: ``zoo_cpu.blas`` loads MKL with Intel's
OpenMP (``KMP_BLOCKTIME=0``), which then also serves the OpenMP calls of libraries loaded after it
(llama.cpp decoded 2-3x slower beside us; docs/speed.md, "Measured"). So ``Peer(stack, path)``
starts ``python -m benchmarks.peers`` with the environment the benchmark was started with
(``benchmarks.speed.PEER_ENV``: ``GEMMA_ZOO_BLAS=off``),
loads the stack there as ``benchmarks.speed.setup`` does, and computes only when handed a run:
``generate(prompt, gen)`` (first-token and remaining seconds, and the ids) or ``prefill(prompt)``
(seconds). A worker that finds MLX or our BLAS in its process refuses to answer
(``benchmarks.speed.check_clean``). Requests and answers are JSON lines on its stdin and stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.speed import PEER_ENV, ROOT, check_clean, run_llama, run_torch, setup


class Peer:
    """A peer stack (``"torch"`` on a float32 folder, ``"llama.cpp"`` on a GGUF file) in its own process."""

    def __init__(self, stack: str, path: Path, threads: int = 2):
        cmd = [sys.executable, "-m", "benchmarks.peers", stack, str(path), "--threads", str(threads)]
        self.stack = stack
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**PEER_ENV, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.notes = self._ask(None)["notes"]

    def _ask(self, request: dict | None) -> dict:
        if request is not None:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.stack} worker exited (code {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def generate(self, prompt: list[int], gen: int) -> tuple[float, float, list[int]]:
        """Greedy generation as ``benchmarks.speed`` times it: (first-token s, remaining s, ids)."""
        r = self._ask({"generate": prompt, "gen": gen})
        return r["first"], r["rest"], r["ids"]

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to feed ``prompt`` to a fresh cache (torch: ``model(ids, logits_to_keep=1)``, as
        its ``generate`` prefills; llama.cpp: ``eval``)."""
        return self._ask({"prefill": prompt})["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def _prefill(stack: str, state: dict, prompt: list[int]) -> float:
    if stack == "llama.cpp":
        state["model"].reset()
        start = time.perf_counter()
        state["model"].eval(prompt)
        return time.perf_counter() - start
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        state["model"](ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - start


def serve(stack: str, path: str, threads: int) -> None:
    """The worker's side: load the peer, say so, then answer each request read from stdin."""
    state = setup(stack, Path(path), {"threads": threads})
    print(json.dumps({"notes": state["notes"]}), flush=True)
    run = {"llama.cpp": run_llama, "torch": run_torch}[stack]
    for line in sys.stdin:
        request = json.loads(line)
        if "prefill" in request:
            answer = {"seconds": _prefill(stack, state, request["prefill"])}
        else:
            first, rest, ids = run(state, request["generate"], request["gen"])
            answer = {"first": first, "rest": rest, "ids": ids}
        check_clean(stack)
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("stack", choices=("torch", "llama.cpp"))
    parser.add_argument("path")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    serve(args.stack, args.path, args.threads)
