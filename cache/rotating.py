"""Sliding-window storage: the newest positions only, bounded by the window plus fixed slack.

Layout: one buffer of at most ``capacity = window - 1 + slack + step`` positions kept in temporal
order (oldest first), never a wrapped ring. New positions are written in place after the stored
ones; when the buffer is full it is compacted once to its newest ``window - 1 + slack`` positions,
which costs one copy every ``step`` decode steps. This gives what a ring cannot:

- steady-state decode reads one contiguous run of exactly ``window`` keys, so it needs no mask;
- the newest ``slack`` positions can always be trimmed exactly, also long after the window has
  wrapped, which speculative rollback needs (peer ring buffers silently corrupt here);
- ``temporal()`` and the canvas read are plain slices.

A prefill chunk longer than the free room is attended over ``window - 1`` stored positions plus the
chunk, and only the newest ``window - 1 + slack`` positions of the result are kept.
"""

from __future__ import annotations

import mlx.core as mx

from .base import AttentionCache, concat, rows, write_rows
from .codecs import Quantized
from .full import QuantizedStorage, _copy_quantized


class RotatingKVCache(AttentionCache):
    """KV cache of a sliding-window layer: a query at absolute position p sees keys in (p - window, p]."""

    kind = "sliding"

    def __init__(self, window: int, slack: int = 16, step: int = 256, codec=None):
        window, slack, step = int(window), int(slack), int(step)
        if window < 1:
            raise ValueError(f"RotatingKVCache: window must be >= 1, got {window}")
        if slack < 0:
            raise ValueError(f"RotatingKVCache: slack must be >= 0, got {slack}")
        if step < 1:
            raise ValueError(f"RotatingKVCache: step must be >= 1, got {step}")
        super().__init__(codec)
        self.sliding_window = window
        self.slack = slack
        self.step = step

    @classmethod
    def _config_names(cls):
        return ("window", "slack", "step")

    def _config(self) -> dict:
        return {"window": self.sliding_window, "slack": self.slack, "step": self.step}

    @property
    def retained(self) -> int:
        """Positions kept between reads: the window's history plus the trim slack."""
        return self.sliding_window - 1 + self.slack

    @property
    def capacity(self) -> int:
        """The most positions the buffer ever holds."""
        return self.retained + self.step

    @property
    def bytes_per_token(self) -> int:
        return 0

    def can_trim(self, n: int) -> bool:
        """Exact while the positions left still cover the window's history (``window - 1``)."""
        if n < 0 or n > self._rows:
            return False
        return self._rows - n >= min(self.offset - n, self.sliding_window - 1)

    def _count_problem(self, stored: int, offset: int) -> str | None:
        # What reads and trims keep: never more than the capacity, and always the window's history.
        problem = super()._count_problem(stored, offset)
        if problem:
            return problem
        if stored > self.capacity:
            return f"{stored} stored positions exceed the capacity {self.capacity} (window - 1 + slack + step)"
        if stored < min(offset, self.sliding_window - 1):
            return (
                f"{stored} stored positions do not cover the window's history at offset {offset} "
                f"(at least {min(offset, self.sliding_window - 1)} for the window of {self.sliding_window})"
            )
        return None

    def _trim_refusal(self, n: int) -> str:
        return (
            f"trim: cannot drop {n} positions exactly; {self._rows} stored, and at least "
            f"{min(self.offset - n, self.sliding_window - 1)} must remain for the window of {self.sliding_window} "
            f"(the slack of {self.slack} positions bounds a rollback)"
        )

    def _history(self) -> int:
        return min(self._rows, self.sliding_window - 1)

    def to_quantized(self, bits: int = 8, group_size: int = 64) -> "RotatingQuantizedKVCache":
        """A quantized twin holding the same positions (quantized once, here), still trimmable."""
        twin = RotatingQuantizedKVCache(self.sliding_window, bits, group_size, self.slack, self.step)
        _copy_quantized(self, twin)
        return twin

    def _make_room(self, L: int, raw_k: mx.array, raw_v: mx.array) -> bool:
        """Ensure ``L`` free rows after the stored ones; False when the chunk cannot fit at all."""
        n = self._rows
        allocated = 0 if self.keys is None else self.keys[0].shape[2]
        if n + L <= allocated:
            return True
        keep = n if n + L <= self.capacity else min(n, self.retained)
        if keep + L > self.capacity:
            return False
        # Once positions start being dropped the buffer stays at full capacity: no regrowth copies.
        size = self.capacity if keep < n else min(self.capacity, -(-(keep + L) // self.step) * self.step)
        fresh_k, fresh_v = self._new_planes(raw_k, raw_v, size - keep)
        if keep:
            self.keys = concat(rows(self.keys, n - keep, n), fresh_k)
            self.values = concat(rows(self.values, n - keep, n), fresh_v)
        else:
            self.keys, self.values = fresh_k, fresh_v
        self._rows = keep
        return True

    def _append(self, k, v, raw_k, raw_v):
        L = raw_k.shape[2]
        if not self._make_room(L, raw_k, raw_v):
            return self._append_oversized(k, v, raw_k, raw_v)
        n = self._rows
        h = self._history()
        write_rows(self.keys, n, k)
        write_rows(self.values, n, v)
        self._rows = n + L
        return rows(self.keys, n - h, n + L), rows(self.values, n - h, n + L), self.offset - h, (n - h, h + L)

    def _decode_room(self, like_k, like_v):
        # One position always fits (the capacity exceeds the window); the read is the newest
        # ``window`` rows, fewer (masked) while the buffer is smaller than the window.
        self._make_room(1, like_k, like_v)
        return self._rows, min(self.sliding_window, self.keys[0].shape[2])

    def _append_oversized(self, k, v, raw_k, raw_v):
        n, L, h = self._rows, raw_k.shape[2], self._history()
        if h:
            keys = concat(rows(self.keys, n - h, n), k)
            values = concat(rows(self.values, n - h, n), v)
        else:
            keys, values = k, v
        keep_old = min(n, max(self.retained - L, 0))
        tail_k, tail_v = rows(k, L - min(L, self.retained), L), rows(v, L - min(L, self.retained), L)
        if keep_old:
            tail_k = concat(rows(self.keys, n - keep_old, n), tail_k)
            tail_v = concat(rows(self.values, n - keep_old, n), tail_v)
        kept = tail_k[0].shape[2]
        fresh_k, fresh_v = self._new_planes(raw_k, raw_v, self.capacity - kept)
        self.keys, self.values = concat(tail_k, fresh_k), concat(tail_v, fresh_v)
        self._rows = kept
        return keys, values, self.offset - h, None

    def _canvas_keys(self, k, v, raw_k, raw_v):
        n, h = self._rows, self._history()
        if not h:
            return k, v
        return concat(rows(self.keys, n - h, n), k), concat(rows(self.values, n - h, n), v)


class RotatingQuantizedKVCache(QuantizedStorage, RotatingKVCache):
    """``RotatingKVCache`` on MLX affine-quantized storage: the same window, slack, trims and
    reads, attended as ``cache.codecs.Quantized`` does."""

    kind = "sliding-quantized"

    def __init__(self, window: int, bits: int = 8, group_size: int = 64, slack: int = 16, step: int = 256):
        super().__init__(window, slack, step, codec=Quantized(bits, group_size))

    @classmethod
    def _config_names(cls):
        return ("window", "bits", "group_size", "slack", "step")

    def _config(self) -> dict:
        return {**super()._config(), "bits": self.bits, "group_size": self.group_size}
