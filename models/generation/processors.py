"""A request's logits processors (logit bias, penalties) and the log-probabilities it asks to see.

The processors are mlx-lm's (``make_logits_processors``: the logit bias, then the repetition,
presence and frequency penalties, each over the last ``REPETITION_CONTEXT`` tokens of the prompt and
the answer so far), so a request penalised here is penalised as mlx-lm's server penalises it. The
log-probabilities a request sees (``logprobs`` / ``top_logprobs``) are those of the distribution
after its processors and its grammar mask, before temperature and the top-p/top-k/min-p filters, as
mlx-lm's ``generate_step`` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

REPETITION_CONTEXT = 20  # tokens a penalty looks back over (mlx-lm's *_context_size default)


def logits_processors(options) -> list:
    """mlx-lm's processors for a ``SamplingOptions`` (none at the neutral values)."""
    return make_logits_processors(
        logit_bias=options.logit_bias or None,
        repetition_penalty=None if options.repetition_penalty == 1 else options.repetition_penalty,
        repetition_context_size=REPETITION_CONTEXT,
        presence_penalty=options.presence_penalty or None,
        presence_context_size=REPETITION_CONTEXT,
        frequency_penalty=options.frequency_penalty or None,
        frequency_context_size=REPETITION_CONTEXT,
    )


def check_logit_bias(options, vocab_size: int) -> None:
    """``ValueError`` naming a ``logit_bias`` id outside ``[0, vocab_size)`` (MLX would index out of bounds)."""
    bad = sorted(t for t in (options.logit_bias or {}) if t >= vocab_size)
    if bad:
        raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


@dataclass
class TokenLogprob:
    """One generated token's log-probability and the ``top`` most likely tokens of its step
    (``(id, logprob)``, most likely first, ties by lower id)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """``token``'s entry of the normalised ``logprobs [1, V]`` and the ``top`` best entries."""
    row = logprobs.reshape(-1)
    chosen = row[token].astype(mx.float32)
    best: list[tuple[int, float]] = []
    if top > 0:
        ids = mx.argpartition(-row, kth=top - 1)[:top]
        values = row[ids].astype(mx.float32)
        mx.eval(ids, values, chosen)
        ids_np, values_np = np.array(ids), np.array(values)
        order = np.lexsort((ids_np, -values_np))
        best = [(int(ids_np[i]), float(values_np[i])) for i in order]
    return TokenLogprob(token, float(chosen.item()), best)
