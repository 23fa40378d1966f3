"""Speculative decoding on this CPU: tokens/s against plain decode, and what one verify step costs.

    python -m benchmarks.speculative                 # about 10 minutes on a 2-core VM
    python -m benchmarks.speculative --gen 64 --ks 1 2 4 8
    python -m benchmarks.speculative --smoke        # a tiny random Gemma 3 target, k = 2, one run (benchmarks.smoke)

Workload: the real Gemma 3 270M (``models.load("gemma-3-270m")``), a ``--prompt``-token prompt
(BOS + random ids, ``numpy.random.default_rng(0)``), ``--gen`` greedy tokens, EOS ignored. Every
speculative run must give plain greedy's tokens (checked). Rows:

- ``plain``: ``generate_tokens``, ``--runs`` runs, median;
- ``self``: the 270M drafting for itself (acceptance 100%, the ceiling; the drafter costs a whole
  target decode per draft);
- ``oracle r``: a drafter that knows plain greedy's answer and is right with probability ``r`` per
  draft (wrong drafts are another token), at no cost: what acceptance alone buys;
- ``tiny random``: a random Gemma 3 (2 layers, hidden 64, the 270M's vocabulary) as a classic
  drafter: nearly always wrong, and cheap;
- ``assistant``: a random Gemma 4 target shaped like the 270M (18 layers, hidden 640) with a random
  ``gemma4_assistant`` (4 layers, hidden 256, centroid head) reading its caches (acceptance ~0).

Verify cost: after the prompt, one ``window`` read of k + 1 tokens against k + 1 ``decode`` steps
(each then trimmed off), median of ``--repeats``. Each row is one run unless stated; the machine is
shared, so ``docs/speculative.md`` quotes what one run gave with that caveat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import models  # first: loads the fast BLAS before MLX
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from benchmarks import smoke
from cache import trim_cache
from models.generation.generate import GenerationStats, generate_tokens
from models.generation.speculative import ModelDrafter, speculative_tokens
from models.model import Model


class OracleDrafter:
    """Proposes plain greedy's next tokens, each kept with probability ``right`` (else another token)."""

    needs_hidden = False

    def __init__(self, answer: list[int], prompt_len: int, right: float, vocab: int, seed: int = 0):
        self.answer, self.prompt_len, self.right, self.vocab = answer, prompt_len, right, vocab
        self.rng = np.random.default_rng(seed)

    def start(self, offset, prompt_ids):
        pass

    def propose(self, y, k, cache, hidden, choose):
        g = cache[0].offset - self.prompt_len  # y is the g-th generated token
        out = []
        for i in range(k):
            j = g + 1 + i
            t = self.answer[j] if j < len(self.answer) else 0
            if self.rng.random() >= self.right:
                t = (t + 1) % self.vocab
            out.append(mx.array(t))
        return out, [None] * k

    def settle(self, kept, offset):
        pass

    def rollback(self, offset):
        pass


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def plain_run(model, prompt, gen):
    stats = GenerationStats()
    tokens = list(generate_tokens(model._forward, prompt, model.make_cache(), max_tokens=gen, stats=stats, overlap=model.overlap))
    return tokens, stats


def spec_run(model, drafter, prompt, gen, k):
    stats = GenerationStats()
    tokens = list(speculative_tokens(model, drafter, prompt, model.make_cache(), num_draft_tokens=k, max_tokens=gen, stats=stats))
    return tokens, stats


def verify_cost(model, prompt, k, repeats):
    """Median seconds of one window read of k + 1 tokens and of k + 1 decode steps, after ``prompt``."""
    cache = model.make_cache()
    model._forward(mx.array([prompt]), cache, last_only=True)
    mx.eval([c.keys for c in cache if getattr(c, "keys", None) is not None])
    block = mx.array([[1000 + i for i in range(k + 1)]])
    window, steps = [], []
    for _ in range(repeats):
        _, t = timed(lambda: mx.eval(model._forward(block, cache)))
        window.append(t)
        assert trim_cache(cache, k + 1)
        start = time.perf_counter()
        for i in range(k + 1):
            mx.eval(model._forward(block[:, i : i + 1], cache, last_only=True))
        steps.append(time.perf_counter() - start)
        assert trim_cache(cache, k + 1)
    return statistics.median(window), statistics.median(steps)


def random_gemma4_pair(smoke_sizes: bool = False):
    """A random Gemma 4 target shaped like the 270M and a random assistant for it (MLX init); with
    ``smoke_sizes`` the same layout at hidden size 64 and 6 layers (a smoke run measures nothing)."""
    from graphs.gemma4_assistant import Gemma4AssistantModel
    from graphs.gemma4_assistant_config import Gemma4AssistantConfig
    from graphs.gemma4_text import Gemma4TextModel
    from graphs.gemma4_text_config import Gemma4TextConfig
    from models.precision import AUTO, choose, prepare

    S, F = "sliding_attention", "full_attention"
    target_raw = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                      num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      global_head_dim=256, sliding_window=512, hidden_size_per_layer_input=0,
                      layer_types=[S, S, S, S, S, F] * 3, final_logit_softcapping=30.0)  # fmt: skip
    assistant_text = dict(hidden_size=256, intermediate_size=1024)
    if smoke_sizes:
        target_raw.update(hidden_size=64, intermediate_size=128, num_hidden_layers=6, layer_types=[S, S, S, S, S, F])
        assistant_text.update(hidden_size=32, intermediate_size=64)
    assistant_raw = dict(model_type="gemma4_assistant", backbone_hidden_size=target_raw["hidden_size"],
                         use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32,
                         text_config=dict(target_raw, **assistant_text, num_hidden_layers=4, layer_types=[S, S, S, F],
                                          num_kv_shared_layers=4))  # fmt: skip
    mx.random.seed(0)
    target = Gemma4TextModel(Gemma4TextConfig.from_dict(target_raw))
    assistant = Gemma4AssistantModel(Gemma4AssistantConfig.from_dict(assistant_raw))
    assistant.masked_embedding.token_ordering = mx.array(np.random.default_rng(0).permutation(262144).astype(np.int32))
    for graph in (target, assistant):
        graph.eval()
        mx.eval(graph.parameters())
        prepare(graph, choose(AUTO, {}))
    wrap = lambda g, t: Model(g, g.config, None, {}, ".", t)  # noqa: E731
    return wrap(target, "gemma4_text"), wrap(assistant, "gemma4_assistant")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=96)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ks", type=int, nargs="+", default=list(range(1, 9)))
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--skip-assistant", action="store_true")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = p.parse_args(argv)
    record = smoke.Record("speculative")
    if args.smoke:
        args.prompt, args.gen, args.runs, args.repeats, args.ks, args.rates = 24, 8, 1, 1, [2], [0.7]

    model = models.load(str(smoke.tiny_checkpoint("gemma3")) if args.smoke else "gemma-3-270m", tokenizer=not args.smoke)
    model.generation_config = {}
    rng = np.random.default_rng(0)
    prompt = [2] + rng.integers(1000, 200000, args.prompt - 1).tolist()
    plain_run(model, prompt[:16], 8)  # warm-up
    runs = [plain_run(model, prompt, args.gen) for _ in range(args.runs)]
    answer = runs[0][0]
    plain_tps = statistics.median(s.generation_tps for _, s in runs)
    record.row("plain", answer, decode=plain_tps)
    print(f"plain decode: {plain_tps:.2f} tok/s (median of {args.runs}: "
          f"{', '.join(f'{s.generation_tps:.2f}' for _, s in runs)})", flush=True)  # fmt: skip

    print("\n| k | window read of k+1 (ms) | k+1 decode steps (ms) | ratio |")
    print("|---|---|---|---|")
    for k in args.ks:
        window, steps = verify_cost(model, prompt, k, args.repeats)
        print(f"| {k} | {1e3 * window:.1f} | {1e3 * steps:.1f} | {window / steps:.2f} |", flush=True)

    print("\n| drafter | k | acceptance | tokens / target step | tok/s | vs plain |")
    print("|---|---|---|---|---|---|")
    tiny = None
    try:
        tiny = tiny_gemma3_drafter(model)
    except Exception as err:  # noqa: BLE001  (reported, the rest still runs)
        print(f"(tiny random drafter skipped: {err})")
        record.missing("tiny random", f"{type(err).__name__}: {err}")
    drafters = [("self", lambda: ModelDrafter(model, model))]
    drafters += [(f"oracle {r:.0%}", (lambda r=r: OracleDrafter(answer, len(prompt), r, model.vocab_size))) for r in args.rates]
    if tiny is not None:
        drafters.append(("tiny random", lambda: ModelDrafter(tiny, model)))
    for name, make in drafters:
        for k in args.ks:
            tokens, stats = spec_run(model, make(), prompt, args.gen, k)
            record.row(f"{name} k={k}", tokens, decode=stats.generation_tps)
            record.agree("plain", f"{name} k={k}")
            if args.smoke:  # the record says what differs
                continue
            assert tokens == answer, f"{name} k={k}: output differs from plain greedy"
            c = stats.speculation
            print(f"| {name} | {k} | {c.acceptance_rate:.0%} | {c.tokens_per_step:.2f} | {stats.generation_tps:.2f} | "
                  f"{stats.generation_tps / plain_tps:.2f} |", flush=True)  # fmt: skip

    if not args.skip_assistant:
        target, assistant = random_gemma4_pair(smoke_sizes=args.smoke)
        plain_run(target, prompt[:16], 8)
        base = [plain_run(target, prompt, args.gen) for _ in range(args.runs)]
        want = base[0][0]
        base_tps = statistics.median(s.generation_tps for _, s in base)
        record.row("gemma4 plain", want, decode=base_tps)
        print(f"\nrandom Gemma 4 target ({'smoke sizes' if args.smoke else '270M-shaped'}): plain {base_tps:.2f} tok/s")
        print("| drafter | k | acceptance | tok/s | vs plain |")
        print("|---|---|---|---|---|")
        from models.generation.speculative import AssistantDrafter

        for k in args.ks:
            tokens, stats = spec_run(target, AssistantDrafter(assistant, target), prompt, args.gen, k)
            record.row(f"random assistant k={k}", tokens, decode=stats.generation_tps)
            record.agree("gemma4 plain", f"random assistant k={k}")
            assert args.smoke or tokens == want
            c = stats.speculation
            print(f"| random assistant | {k} | {c.acceptance_rate:.0%} | {stats.generation_tps:.2f} | "
                  f"{stats.generation_tps / base_tps:.2f} |", flush=True)  # fmt: skip
        # The cost of one assistant draft step against one target decode step.
        cache = target.make_cache()
        logits, hidden = target.graph(mx.array([prompt]), cache=cache, last_only=True, with_hidden=True)
        mx.eval(logits, hidden)
        drafter = AssistantDrafter(assistant, target)
        y = mx.array(5)
        draft_times, decode_times = [], []
        for _ in range(args.repeats):
            _, t = timed(lambda: mx.eval(drafter.propose(y, 1, cache, hidden[:, -1:], lambda lg: (mx.argmax(lg), None))[0]))
            draft_times.append(t)
            _, t = timed(lambda: mx.eval(target.graph(mx.array([[5]]), cache=cache, last_only=True)))
            decode_times.append(t)
            trim_cache(cache, 1)
        print(f"assistant draft step {1e3 * statistics.median(draft_times):.1f} ms, "
              f"target decode step {1e3 * statistics.median(decode_times):.1f} ms")  # fmt: skip
    if args.smoke:
        record.finish()
    return 0


def tiny_gemma3_drafter(target):
    """A random 2-layer Gemma 3 with the 270M's vocabulary (MLX init), as a loaded Model."""
    from graphs.gemma3_text import Gemma3TextModel
    from graphs.gemma3_text_config import Gemma3TextConfig
    from models.precision import AUTO, choose, prepare

    raw = dict(model_type="gemma3_text", vocab_size=target.vocab_size, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
               query_pre_attn_scalar=32, sliding_window=512, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    mx.random.seed(1)
    graph = Gemma3TextModel(Gemma3TextConfig.from_dict(raw))
    graph.eval()
    mx.eval(graph.parameters())
    prepare(graph, choose(AUTO, {}))
    return Model(graph, graph.config, None, {}, ".", "gemma3_text")


if __name__ == "__main__":
    nn  # noqa: B018  (imported for graph modules)
    raise SystemExit(main())
