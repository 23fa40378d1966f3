"""Prompt-lookup drafts on a summarize-this-text task: the real Gemma 3 270M, greedy, plain decoding
against ``draft="prompt-lookup"`` in one process, alternating.

    python -m benchmarks.prompt_lookup [--rounds 3 --tokens 64 --drafts 4]
    python -m benchmarks.prompt_lookup --smoke     # a tiny random Gemma 3, a repeating prompt, one round

The prompt is a paragraph followed by an instruction to repeat its key sentences; both runs must
give the same tokens (checked). Prints per-round decode tok/s of each, the acceptance rate and
tokens per target step of the drafts, then medians, their ratio and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--drafts", type=int, default=4)
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


if __name__ == "__main__":
    main()
