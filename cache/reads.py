"""``Read``: which read a forward makes on every layer's cache, as one small typed value.

A graph picks the read once per forward (``Read.window()`` for a prefill chunk, ``Read.decode()``
for one position, ``Read.vision_prefill(blocks)`` for a prompt with images, ...) and each attention
calls ``read(cache, q, k, v, scale=...)``; KV-shared layers pass only ``q``. The names are the
cache contract's reads (``AttentionCache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

NAMES = ("decode", "window", "vision_prefill", "encoder", "canvas", "bidirectional", "draft")
_WITH_BLOCKS = ("vision_prefill", "encoder")


def only_read(allowed: str, why: str):
    """Class decorator for a cache that takes one read: every other read of ``NAMES`` raises
    ``ValueError("<read>: <why>")``, so a read added to the contract is refused there too."""
    if allowed not in NAMES:
        raise ValueError(f"only_read: unknown read {allowed!r}; the reads are {', '.join(NAMES)}")

    def refusal(read: str):
        def refused(self, *args, **kwargs):
            raise ValueError(f"{read}: {why}")

        refused.__name__ = refused.__qualname__ = read
        return refused

    def decorate(cls):
        for read in NAMES:
            if read != allowed:
                setattr(cls, read, refusal(read))
        return cls

    return decorate


@dataclass(frozen=True, eq=False)
class Read:
    name: str
    blocks: mx.array | None = None  # [B, L] per new position: block >= 0 (bidirectional span), -1 text, <= -2 causal media span

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"Read: unknown read {self.name!r}; the reads are {', '.join(NAMES)}")
        if (self.blocks is not None) != (self.name in _WITH_BLOCKS):
            raise ValueError(f"Read {self.name!r}: blocks are {'required' if self.name in _WITH_BLOCKS else 'not taken'}")

    @classmethod
    def decode(cls) -> "Read":
        return cls("decode")

    @classmethod
    def window(cls) -> "Read":
        return cls("window")

    @classmethod
    def vision_prefill(cls, blocks: mx.array) -> "Read":
        return cls("vision_prefill", blocks)

    @classmethod
    def encoder(cls, blocks: mx.array) -> "Read":
        return cls("encoder", blocks)

    @classmethod
    def canvas(cls) -> "Read":
        return cls("canvas")

    @classmethod
    def bidirectional(cls) -> "Read":
        return cls("bidirectional")

    @classmethod
    def draft(cls) -> "Read":
        """A drafter's queries on a target's cache (Gemma 4 assistants): writes nothing."""
        return cls("draft")

    def __call__(self, cache, q: mx.array, k: mx.array | None = None, v: mx.array | None = None, *, scale: float) -> mx.array:
        """The attention output of ``q`` (and, on layers that write, the new ``k``/``v``) through this read."""
        method = getattr(cache, self.name)
        if self.blocks is None:
            return method(q, k, v, scale=scale)
        return method(q, k, v, self.blocks, scale=scale)
