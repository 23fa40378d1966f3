"""Tiny targets and drafters for the speculative decoding tests (checkpoints written by transformers).

``WrongOnPurpose`` wraps any drafter and changes every ``every``-th draft token, so rejections are
forced at known rates. ``WithoutFavourite`` wraps a sampling drafter and never proposes its
distribution's most likely token, so that drafts are accepted only in part and a rejection's
residual ``max(0, p - q)`` differs from ``p``. Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import mlx.core as mx

import models
from models.generation.generate import GenerationStats
from tests import hf_tiny
from tests.assistant_tiny import save_assistant

GEMMA4_TARGETS = {
    "E2B_like": hf_tiny.TEXT_CONFIGS["E2B_like"],  # PLE, KV sharing, window 8
    "T3": hf_tiny.TEXT_CONFIGS["T3"],  # MoE, K=V full layer, window 4
}
ASSISTANT_HEADS = {"T3": dict(num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1)}


def gemma4_pair(name: str, directory):
    """(target, assistant) ``Model``s for a ``GEMMA4_TARGETS`` entry; no stop ids (long runs)."""
    config = GEMMA4_TARGETS[name]
    hf_tiny.save_causal_lm(config, directory / "target")
    save_assistant(config, directory / "assistant", **ASSISTANT_HEADS.get(name, {}))
    target = models.load(str(directory / "target"), tokenizer=False)
    target.generation_config = {}
    return target, models.load(str(directory / "assistant"), tokenizer=False)


class Wrapped:
    """A drafter that passes ``start``, ``settle`` and ``rollback`` to ``inner``; subclasses change ``propose``."""

    def __init__(self, inner):
        self.inner, self.needs_hidden = inner, inner.needs_hidden

    def start(self, offset, prompt_ids):
        self.inner.start(offset, prompt_ids)

    def settle(self, kept, offset):
        self.inner.settle(kept, offset)

    def rollback(self, offset):
        self.inner.rollback(offset)


class WrongOnPurpose(Wrapped):
    """A drafter whose every ``every``-th draft (counted over the whole run) is replaced by another token."""

    def __init__(self, inner, vocab_size: int, every: int = 3):
        super().__init__(inner)
        self.vocab_size, self.every, self.count = vocab_size, every, 0

    def propose(self, y, k, cache, hidden, choose):
        tokens, dists = self.inner.propose(y, k, cache, hidden, choose)
        for i in range(len(tokens)):
            self.count += 1
            if self.count % self.every == 0:
                tokens[i] = (tokens[i] + 1) % self.vocab_size
        return tokens, dists


class WithoutFavourite(Wrapped):
    """A sampling drafter that draws each draft from the inner drafter's distribution ``p`` with its
    most likely token removed (``q`` is ``p`` elsewhere, renormalised; ``p`` itself when that token
    holds all the mass). Drafting for itself, the target accepts a draft with probability
    ``1 - max p``, and a rejection must resample exactly the target's favourite token: the residual
    ``max(0, p - q)`` is a point mass there, which tells the rejection rule from a resample from ``p``."""

    def propose(self, y, k, cache, hidden, choose):
        def without_favourite(logits):
            _, p = choose(logits)
            if p is None:
                raise ValueError("WithoutFavourite drafts from distributions: sample with temp > 0, not greedily")
            q = mx.where(mx.arange(p.shape[-1]) == mx.argmax(p), 0.0, p)
            total = q.sum()
            q = mx.where(total > 0, q / mx.maximum(total, 1e-30), p)
            return mx.random.categorical(mx.log(q)), q

        return self.inner.propose(y, k, cache, hidden, without_favourite)


def run(model, prompt, max_tokens: int, **options):
    """(generated ids, stats, the cache) of ``model.stream``."""
    stats = GenerationStats()
    cache = model.make_cache()
    out = [c.token for c in model.stream(prompt, max_tokens=max_tokens, stats=stats, cache=cache, **options) if c.token is not None]
    return out, stats, cache


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


__all__ = ["mx", "gemma4_pair", "Wrapped", "WrongOnPurpose", "WithoutFavourite", "run", "first_difference"]
