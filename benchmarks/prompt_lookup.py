"""Prompt-lookup drafts on a summarize-this-text task: the real Gemma 3 270M, greedy, plain decoding
against ``draft="prompt-lookup"`` in one process, alternating.

    python -m benchmarks.prompt_lookup [--rounds 3 --tokens 64 --drafts 4]
    python -m benchmarks.prompt_lookup --engine    # both through the server's engine (models.serving.engine)
    python -m benchmarks.prompt_lookup --smoke     # a tiny random Gemma 3, a repeating prompt, one round

The prompt is a paragraph followed by an instruction to repeat its key sentences; both runs must
give the same tokens (checked). Prints per-round decode tok/s of each, the acceptance rate and
tokens per target step of the drafts, then medians, their ratio and the load average. With
``--engine`` each answer is one request to the server's engine, a plain one in the batch against
one with ``speculative`` (a ``LookupRequest`` beside it), and tok/s is over the whole request,
prefill included (no acceptance figures: the engine keeps no stats per request).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import time

import models
from benchmarks import smoke
from models.generation.generate import GenerationStats, SamplingOptions

TEXT = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried on the island. Its lamp was first "
    "fired by whale oil, then by kerosene, and since 1952 by electricity. The keeper's cottage beside it now houses a "
    "small museum about the ships that were wrecked on the reef before the light was lit. Visitors can climb the 112 "
    "steps to the gallery on weekends from May to September."
)
PROMPT = f"Text: {TEXT}\n\nRepeat the text above, word for word:\n"


def run(model, ids, tokens: int, **options) -> tuple[list[int], GenerationStats]:
    stats = GenerationStats()
    out = [c.token for c in model.stream(ids, max_tokens=tokens, sampling=SamplingOptions(), stats=stats, **options) if c.token is not None]
    return out, stats


def through_engine(engine, ids, tokens: int, drafts: int | None) -> tuple[list[int], float]:
    """The greedy answer as one engine request (with prompt-lookup drafts when ``drafts``) and its tok/s."""
    from models.generation.batch import BatchRequest
    from models.serving.lookup import LookupRequest

    request = BatchRequest(ids, max_tokens=tokens, sampling=SamplingOptions())
    events: queue.SimpleQueue = queue.SimpleQueue()
    start = time.perf_counter()
    engine.submit(request if drafts is None else LookupRequest(request, drafts), events.put)
    out = []
    while True:
        event = events.get()
        out += event.tokens
        if event.finish_reason is not None:
            return out, len(out) / (time.perf_counter() - start)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--drafts", type=int, default=4)
    p.add_argument("--engine", action="store_true", help="through the server's engine, prefill included")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = p.parse_args(argv)
    if args.smoke:  # no tokenizer: a prompt that repeats itself, so the lookup finds drafts
        args.rounds, args.tokens = 1, 16
        model = models.load(str(smoke.tiny_checkpoint("gemma3")), tokenizer=False)
        ids = [5, 9, 13, 17, 21, 25, 29, 33] * 4
    else:
        model = models.load(args.model)
        ids = model.encode(PROMPT)
    run(model, ids, 4)  # warm-up
    print(json.dumps({"load_average": os.getloadavg(), "prompt_tokens": len(ids)}), flush=True)
    if args.engine:
        return engine_rounds(model, ids, args)
    plain_tps, lookup_tps, rates, per_step = [], [], [], []
    for r in range(args.rounds):
        results = {}
        for kind in (("plain", "lookup") if r % 2 == 0 else ("lookup", "plain")):
            options = {"draft": "prompt-lookup", "num_draft_tokens": args.drafts} if kind == "lookup" else {}
            results[kind] = run(model, ids, args.tokens, **options)
        (a, sa), (b, sb) = results["plain"], results["lookup"]
        if args.smoke:  # the record says what differs
            record = smoke.Record("prompt_lookup")
            record.row("ours plain", a, tok_s=sa.generation_tps)
            record.row("ours prompt-lookup", b, tok_s=sb.generation_tps)
            record.agree("ours plain", "ours prompt-lookup")
            record.finish()
            return
        assert a == b, "prompt lookup changed the greedy answer"
        plain_tps.append(sa.generation_tps)
        lookup_tps.append(sb.generation_tps)
        rates.append(sb.speculation.acceptance_rate)
        per_step.append(sb.speculation.tokens_per_step)
        print(json.dumps({"round": r, "plain_tok_s": sa.generation_tps, "lookup_tok_s": sb.generation_tps, "tokens": len(a),
                          "acceptance": rates[-1], "tokens_per_target_step": per_step[-1]}), flush=True)  # fmt: skip
    print(json.dumps({"load_average": os.getloadavg()}))
    a, b = statistics.median(plain_tps), statistics.median(lookup_tps)
    print(f"decode tok/s median: plain {a:.2f} [{min(plain_tps):.2f}-{max(plain_tps):.2f}], prompt lookup {b:.2f} "
          f"[{min(lookup_tps):.2f}-{max(lookup_tps):.2f}], speed-up {b / a:.2f}x; acceptance {statistics.median(rates):.2f}, "
          f"{statistics.median(per_step):.2f} tokens per target step")


def engine_rounds(model, ids, args) -> None:
    from models.serving.engine import Engine

    engine = Engine(model).start()
    try:
        rounds = {"plain": [], "lookup": []}
        for r in range(args.rounds):
            answers = {}
            for kind in (("plain", "lookup") if r % 2 == 0 else ("lookup", "plain")):
                answers[kind], tps = through_engine(engine, ids, args.tokens, args.drafts if kind == "lookup" else None)
                rounds[kind].append(tps)
            assert answers["plain"] == answers["lookup"], "prompt lookup changed the greedy answer"
            print(json.dumps({"round": r, **{f"{k}_tok_s": v[-1] for k, v in rounds.items()}, "tokens": len(answers["plain"])}), flush=True)
    finally:
        engine.stop()
    print(json.dumps({"load_average": os.getloadavg()}))
    a, b = (statistics.median(rounds[k]) for k in ("plain", "lookup"))
    print(f"engine tok/s (prefill included) median: plain {a:.2f} [{min(rounds['plain']):.2f}-{max(rounds['plain']):.2f}], "
          f"prompt lookup {b:.2f} [{min(rounds['lookup']):.2f}-{max(rounds['lookup']):.2f}], speed-up {b / a:.2f}x")


if __name__ == "__main__":
    main()
