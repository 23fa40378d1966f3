"""A sampler's work over the vocabulary as one graph node each: the zoo extension's sampling
primitives (``zoo_cpu/src/sampling*``).

MLX's CPU ops do a token's sampling over every word of the vocabulary: at 262,144 words its sort
for top-p takes ~25 ms on two cores, its argpartition for top-k ~3 ms and its Gumbel draw ~4-6 ms,
where a small model's whole decode step takes ~14 ms (docs/speed.md, "Sampling over the
vocabulary"). These read the row once or twice instead:

- ``top_k``: the k largest values of each row (and their indices), a sampler's candidates
  (``models.generation.generate.top_k_candidates``);
- ``keep_floor``: the smallest value top-p and min-p keep of each row of normalised
  log-probabilities, read off its most likely words (a few hundred; more only for a wider nucleus);
- ``categorical``: one index a row drawn from ``softmax(x * scale)`` over the values at or above a
  floor, by the inverse CDF of one uniform number a row (the caller draws it from its own key).

Float32 only; ``models.generation.generate`` calls them where ``zoo_cpu.backend`` runs the decode
kernels (MLX's ops elsewhere).
"""

from __future__ import annotations

import mlx.core as mx

from .extension import module as _module


def top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest values of ``x [..., V]``'s last axis (float32) from the largest down, and
    their indices (uint32), each ``[..., k]``; ties go to the lower index, NaN counts as ``-inf``."""
    values, ids = _module().top_k(x, int(k))
    return values, ids


def log_softmax(x: mx.array, isa: str | None = None) -> mx.array:
    """``x - logsumexp(x)`` along the last axis of ``x [..., V]`` (float32): a sampler's
    log-probabilities in three passes on both cores (MLX's chain of one-thread passes: ~1.3 ms over
    262,144 words)."""
    return _module().log_softmax(x, isa or "")


def keep_floor(logprobs: mx.array, top_p: float, min_p: float, isa: str | None = None) -> mx.array:
    """The smallest value each row of normalised ``logprobs [..., V]`` keeps, ``[..., 1]``: top-p
    (``0 < top_p < 1``) keeps the words from the most likely down while the mass of those before
    (summed in double) stays below ``top_p``, with every word equal to the last one
    kept; min-p (``min_p > 0``) keeps those at or above the largest + ``log(min_p)``. A filter at 0
    (or top-p at 1) is off; with both off the floor is ``-inf``."""
    return _module().keep_floor(logprobs, float(top_p), float(min_p), isa or "")


def categorical(x: mx.array, u: mx.array, scale: float = 1.0, floor: mx.array | None = None,
                isa: str | None = None) -> mx.array:
    """One index (uint32) a row of ``x [..., V]`` drawn from ``softmax(x * scale)`` over the values
    at or above ``floor [..., 1]`` (None: every value), by the inverse CDF of ``u [...]`` (uniform in
    [0, 1)): the first index whose running sum of weights passes ``u`` times their total. NaN and
    values below the floor weigh 0; a row with no weight gives the first of its largest values."""
    return _module().categorical(x, u, float(scale), floor, isa or "")
