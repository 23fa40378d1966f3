"""Packed sequences: one forward over independent texts laid end to end in a single row, no padding.

An encoder (EmbeddingGemma) embeds many texts of different lengths at once. Padding them to the
longest would spend the projections and MLPs, which are most of the work, on pad positions; instead
the texts are concatenated into one row ``[1, sum(lengths)]`` and every layer's ``PackedCache``
splits the new queries, keys and values back into the texts (along the sequence axis) and makes
the ``bidirectional`` read on each text's own cache. So each text attends only to itself, with the
mask and window it would have alone, while everything that reads the weights runs once for all.

The graph rotates the packed row at positions ``0 .. N-1``, so a text starting at ``s`` is rotated
from ``s`` instead of 0: attention scores depend only on ``q - k`` under RoPE, and both lie in the
same text, so the scores are the text's own (up to float rounding of the rotation tables).
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from .base import AttentionCache
from .reads import only_read


@only_read("bidirectional", "packed texts take only the bidirectional read (they are encoded whole, never appended to)")
class PackedCache:
    """One layer's cache for texts packed in one row: ``segments[i]`` is text ``i``'s own cache."""

    def __init__(self, lengths: Sequence[int], make: Callable[[], AttentionCache]):
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError(f"PackedCache: needs at least one text, each of length >= 1, got lengths {lengths}")
        self.lengths = lengths
        self.segments = [make() for _ in lengths]

    @property
    def offset(self) -> int:
        """Positions of the packed row consumed (the RoPE offset of the row's next position)."""
        return sum(c.offset for c in self.segments)

    @property
    def sliding_window(self) -> int | None:
        return self.segments[0].sliding_window

    def bidirectional(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """Each text's ``bidirectional`` read on its own cache, outputs packed back in order."""
        N = sum(self.lengths)
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.shape[0] != 1 or x.shape[2] != N:
                raise ValueError(
                    f"PackedCache.bidirectional: {name} {tuple(x.shape)} is not one packed row of {N} positions (lengths {self.lengths})"
                )
        outs, start = [], 0
        for cache, n in zip(self.segments, self.lengths):
            part = slice(start, start + n)
            outs.append(cache.bidirectional(q[:, :, part], k[:, :, part], v[:, :, part], scale=scale))
            start += n
        if len(outs) == 1:
            return outs[0]
        # Joined positions first and handed back as the [1, heads, N, D] view, so that the layer's
        # move of the heads back beside each position is no second copy (the prefill kernel's
        # outputs are such views already: their pieces join as plain row copies).
        return mx.concatenate([o.transpose(0, 2, 1, 3) for o in outs], axis=1).transpose(0, 2, 1, 3)
