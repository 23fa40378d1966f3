"""What a decode switch buys, the step with it off and on in turn, in one process: by default the
decode step compiled whole (``graphs.decode_step``), or ``--switch GEMMA_ZOO_DECODE_KERNELS`` (the
decode kernels, ``zoo_cpu.decode``).

    python -m benchmarks.compiled_step                                  # the 270M: float32, 8-bit, 4-bit
    python -m benchmarks.compiled_step --models e2b,e2b-8bit --rounds 5  # the E2B-shaped Gemma 4 of benchmarks.speed
    python -m benchmarks.compiled_step --switch GEMMA_ZOO_DECODE_KERNELS
    python -m benchmarks.compiled_step --smoke   # a tiny random Gemma 3 and its 8-bit folder (benchmarks.smoke)

Each model is loaded once; every round generates ``--gen`` greedy tokens after a ``--prompt``-token
prompt (``benchmarks.speed.prompt_ids``) with the switch off, then on (the order alternates
between rounds), so a slow spell of a shared machine hits both alike; the ratio is taken per round
before the median. The first compiled round includes tracing (one trace per buffer shape), so a
warm-up run of each precedes the rounds. The token ids of both paths must be equal (or, for a
switch that changes the arithmetic's order, the count of differing ones is printed).
Models: zoo names or folders, and ``e2b`` / ``e2b-8bit`` / ``e2b-4bit`` (``benchmarks.speed``'s
E2B-shaped checkpoint and its quantized folders).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import zoo_cpu  # noqa: F401  (before mlx)

import models
from benchmarks import smoke
from benchmarks.speed import cell, gemma4_folder, prompt_ids, quantized_folder, run_ours
from zoo_cpu import switches

E2B = {"e2b": None, "e2b-8bit": 8, "e2b-4bit": 4}  # quantized under the zoo's policy for those bits


def folder_of(name: str) -> Path:
    if name in E2B:
        folder = gemma4_folder()
        return folder if E2B[name] is None else quantized_folder(folder, E2B[name])
    from models.zoo import zoo_folder

    return zoo_folder(name) or Path(name)


SWITCHES = ("GEMMA_ZOO_COMPILE_STEP", "GEMMA_ZOO_DECODE_KERNELS")


def decode(model, prompt: list[int], gen: int, switch: str, on: bool) -> tuple[float, list[int]]:
    """Tokens per second after the first token, and the ids."""
    with switches.override(**{switch: on}):
        _, rest, ids = run_ours({"model": model}, prompt, gen)
        return (len(ids) - 1) / rest, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,gemma-3-270m-8bit,gemma-3-270m-4bit")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--switch", choices=SWITCHES, default=SWITCHES[0])
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = parser.parse_args()
    record = smoke.Record("compiled_step")
    if args.smoke:
        tiny = smoke.tiny_checkpoint("gemma3")
        args.models, args.prompt, args.gen, args.rounds = f"{tiny},{quantized_folder(tiny, 8)}", 32, 4, 1
    prompt = prompt_ids(args.prompt)
    print(f"Prompt {args.prompt}, {args.gen} greedy tokens, {args.rounds} rounds per model, {args.switch} off and on in "
          f"turn; load average {os.getloadavg()[0]:.1f} at the start on {os.cpu_count()} CPUs.")  # fmt: skip
    print("| model | off: decode tok/s | on: decode tok/s | on vs off | tokens that differ |")
    print("|---|---|---|---|---|")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = models.load(str(folder_of(name)), tokenizer=False)
        for on in (False, True):
            decode(model, prompt[:64], args.gen, args.switch, on)  # warm-up (and the compiled step's traces)
        speeds = {False: [], True: []}
        ratios, differ = [], 0
        for r in range(args.rounds):
            ids = {}
            for on in ((False, True) if r % 2 == 0 else (True, False)):
                tps, ids[on] = decode(model, prompt, args.gen, args.switch, on)
                speeds[on].append(tps)
            differ = max(differ, sum(a != b for a, b in zip(ids[True], ids[False])))
            if args.switch == "GEMMA_ZOO_COMPILE_STEP" and differ:
                raise SystemExit(f"{name}: the compiled step's greedy tokens differ from the plain step's")
            ratios.append(speeds[True][-1] / speeds[False][-1])
        print(f"| {name} | {cell(speeds[False])} | {cell(speeds[True])} | {cell(ratios, 2)}x | {differ} of {args.gen} |",
              flush=True)  # fmt: skip
        for on in (False, True):
            record.row(f"{name} {args.switch}={int(on)}", ids[on], decode=min(speeds[on]))
        if args.switch == "GEMMA_ZOO_COMPILE_STEP":  # the same arithmetic, compiled or not
            record.agree(*(f"{name} {args.switch}={int(on)}" for on in (False, True)))
    print(f"Load average {os.getloadavg()[0]:.1f} at the end.")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
