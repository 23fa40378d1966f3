"""Prompt-lookup drafts: speculation without a drafter model, copying from the conversation itself.

An answer that quotes, summarises or edits its prompt repeats runs of the prompt's tokens. Before
each target step, ``PromptLookupDrafter`` finds the latest earlier place where the newest
``n``-gram of the prompt and answer so far occurred (the longest ``n`` from ``MAX_NGRAM`` down to
1 that matches) and proposes the tokens that followed it there (Saxena's prompt lookup decoding,
as transformers' ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` speculator do). The
speculative loop (``models.generation.speculative``) verifies every draft with the target, so the
answer is the target's own: greedy, token for token; sampled, with the target's distribution (a
proposal is certain, so its draft distribution is one-hot). Without a match it proposes the last
token repeated, which costs a wider verify step and nothing else.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

MAX_NGRAM = 3  # longest suffix looked up


class PromptLookupDrafter:
    """The drafter interface of ``models.generation.speculative`` over the token history."""

    needs_hidden = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.history: list[int] = []
        self.base = 0  # the target position of history[0]

    def start(self, offset: int, prompt_ids: Sequence[int]) -> None:
        """Before the target's prefill of ``prompt_ids`` at ``offset``: keep the history that the
        target still holds, then the prompt."""
        if not self.base <= offset <= self.base + len(self.history):
            self.history, self.base = [], offset
        del self.history[offset - self.base :]
        self.history.extend(int(t) for t in prompt_ids)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``context``'s newest n-gram."""
        tokens = np.asarray(context)
        for n in range(min(MAX_NGRAM, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []

    def propose(self, y: mx.array, k: int, cache: list, hidden, choose) -> tuple[list, list]:
        last = int(y.item())
        found = self.lookup(self.history + [last], k)
        drafts = found + [found[-1] if found else last] * (k - len(found))
        tokens = [mx.array(t) for t in drafts]
        dists = [mx.zeros((self.vocab_size,)).at[t].add(1.0) for t in drafts]  # a certain proposal
        return tokens, dists

    def settle(self, kept: Sequence[int], offset: int) -> None:
        """The target now holds ``offset`` positions, the newest being ``kept``."""
        self.history.extend(int(t) for t in kept)
        del self.history[offset - self.base :]

    def rollback(self, offset: int) -> None:
        del self.history[offset - self.base :]
