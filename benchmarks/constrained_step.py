"""What a grammar adds to a decode step: the real Gemma 3 270M, ``Model.stream`` with and without a
JSON schema, in one process, alternating.

    python -m benchmarks.constrained_step [--rounds 3 --tokens 48]
    python -m benchmarks.constrained_step --smoke    # one schema, 8 tokens, one round

Each round runs, for each schema of ``benchmarks.json_schemas``, one constrained answer (seeded
sampling, temperature 1) and one unconstrained answer of the same length (``--tokens``, stop ids
ignored by a budget equal to the constrained answer's length), and records seconds per generated
token of each (``GenerationStats.generation_seconds / generation_tokens``, prefill excluded). Prints
one JSON line per answer, then the median per-token time of each and their ratio, with the load
average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import models
from benchmarks import smoke
from models.generation.generate import GenerationStats, SamplingOptions


def per_token(model, prompt, max_tokens: int, seed: int, schema=None) -> tuple[float, int]:
    stats = GenerationStats()
    for _ in model.stream(prompt, max_tokens=max_tokens, sampling=SamplingOptions(temp=1.0, seed=seed), stats=stats, schema=schema):
        pass
    return stats.generation_seconds / max(stats.generation_tokens, 1), stats.generation_tokens


def main(argv=None) -> None:
    from benchmarks.json_schemas import SCHEMAS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.tokens = 1, 8
        SCHEMAS = dict(list(SCHEMAS.items())[:1])
    model = models.load(args.model)
    prompt = model.encode("Describe one item as JSON.\n")
    per_token(model, prompt, 4, 0, SCHEMAS["person"][0])  # builds llguidance's view of the vocabulary once
    print(json.dumps({"load_average": os.getloadavg()}), flush=True)
    free, constrained = [], []
    for r in range(args.rounds):
        for i, (name, (schema, _)) in enumerate(SCHEMAS.items()):
            pair = {}
            order = ("schema", "free") if (r + i) % 2 == 0 else ("free", "schema")
            for kind in order:
                budget = args.tokens if kind == "schema" else pair.get("schema", (0, args.tokens))[1]
                pair[kind] = per_token(model, prompt, budget, r * 100 + i, schema if kind == "schema" else None)
            constrained.append(pair["schema"][0])
            free.append(pair["free"][0])
            print(json.dumps({"round": r, "schema": name, "ms_per_token_schema": 1e3 * pair["schema"][0],
                              "ms_per_token_free": 1e3 * pair["free"][0], "tokens": pair["schema"][1]}), flush=True)  # fmt: skip
    a, b = statistics.median(constrained), statistics.median(free)
    print(json.dumps({"load_average": os.getloadavg()}))
    if args.smoke:
        record = smoke.Record("constrained_step")
        record.row("ours constrained", ms_per_token=1e3 * a)
        record.row("ours unconstrained", ms_per_token=1e3 * b)
        record.finish()
    print(f"median ms/token: constrained {1e3 * a:.2f}, unconstrained {1e3 * b:.2f}, ratio {a / b:.3f}; "
          f"per-answer ratios {min(c / f for c, f in zip(constrained, free)):.3f}-{max(c / f for c, f in zip(constrained, free)):.3f}")


if __name__ == "__main__":
    main()
