"""Full-attention storage: every position is kept, in a buffer that grows in fixed steps."""

from __future__ import annotations

import mlx.core as mx

from .base import AttentionCache, concat, rows, write_rows
from .codecs import Quantized


class KVCache(AttentionCache):
    """KV cache of a full-attention layer; grows without bound.

    The buffer grows ``step`` positions at a time (one copy per step, not per token) and new
    positions are written in place, as in mlx-lm's ``KVCache``.
    """

    kind = "full"

    def __init__(self, step: int = 256, codec=None):
        if int(step) < 1:
            raise ValueError(f"{type(self).__name__}: step must be >= 1, got {step}")
        super().__init__(codec)
        self.step = int(step)

    @classmethod
    def _config_names(cls):
        return ("step",)

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        return sum(p.nbytes // p.shape[2] for p in self.keys + self.values)

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= self._rows

    def _count_problem(self, stored: int, offset: int) -> str | None:
        problem = super()._count_problem(stored, offset)
        if problem is None and stored != offset:
            problem = f"a full-attention cache stores every position, but holds {stored} for the offset {offset}"
        return problem

    def to_quantized(self, bits: int = 8, group_size: int = 64) -> "QuantizedKVCache":
        """A quantized twin holding the same positions (quantized once, here)."""
        twin = QuantizedKVCache(bits=bits, group_size=group_size, step=self.step)
        _copy_quantized(self, twin)
        return twin

    def _reserve(self, needed: int, raw_k: mx.array, raw_v: mx.array) -> None:
        """Make room for ``needed`` positions, keeping the stored ones."""
        capacity = 0 if self.keys is None else self.keys[0].shape[2]
        if needed <= capacity:
            return
        grown = -(-needed // self.step) * self.step
        fresh_k, fresh_v = self._new_planes(raw_k, raw_v, grown - self._rows)
        if self.keys is None or self._rows == 0:
            self.keys, self.values = fresh_k, fresh_v
        else:
            self.keys = concat(rows(self.keys, 0, self._rows), fresh_k)
            self.values = concat(rows(self.values, 0, self._rows), fresh_v)

    def _decode_room(self, like_k, like_v):
        # Every stored row is read: the whole buffer, the rows past the new position masked.
        self._reserve(self._rows + 1, like_k, like_v)
        return self._rows, self.keys[0].shape[2]

    def _append(self, k, v, raw_k, raw_v):
        n, L = self._rows, raw_k.shape[2]
        self._reserve(n + L, raw_k, raw_v)
        write_rows(self.keys, n, k)
        write_rows(self.values, n, v)
        self._rows = n + L
        return rows(self.keys, 0, n + L), rows(self.values, 0, n + L), 0, (0, n + L)

    def _canvas_keys(self, k, v, raw_k, raw_v):
        # The block goes into the free rows past the stored ones without being counted as stored,
        # so the read costs no copy of the history.
        n, L = self._rows, raw_k.shape[2]
        self._reserve(n + L, raw_k, raw_v)
        write_rows(self.keys, n, k)
        write_rows(self.values, n, v)
        return rows(self.keys, 0, n + L), rows(self.values, 0, n + L)


class QuantizedStorage:
    """What the quantized caches add to their full-precision twins: the codec's settings."""

    codec: Quantized

    @property
    def bits(self) -> int:
        return self.codec.bits

    @property
    def group_size(self) -> int:
        return self.codec.group_size

    def to_quantized(self, bits: int = 8, group_size: int = 64):
        raise ValueError(f"to_quantized: this cache is already quantized ({self.bits} bits, group {self.group_size})")


class QuantizedKVCache(QuantizedStorage, KVCache):
    """``KVCache`` on MLX affine-quantized storage (``bits`` 2-8, ``group_size`` 32/64/128 along
    the head dim); the reads attend as ``cache.codecs.Quantized`` does (a decode read: the quantized
    decode kernel, a block of rows dequantized at a time; a prefill chunk on the CPU plan: the run
    dequantized for the float prefill kernel; otherwise quantized matmuls)."""

    kind = "full-quantized"

    def __init__(self, bits: int = 8, group_size: int = 64, step: int = 256):
        super().__init__(step, codec=Quantized(bits, group_size))

    @classmethod
    def _config_names(cls):
        return ("bits", "group_size", "step")


def _copy_quantized(source: AttentionCache, twin: AttentionCache) -> None:
    """Move ``source``'s stored positions and counters into the empty quantized ``twin``."""
    if source.keys is not None and source._rows:
        keys, values = source.temporal()
        twin.codec.check("to_quantized", keys, values)
        twin.keys, twin.values = twin.codec.pack(keys), twin.codec.pack(values)
        twin._rows = source._rows
        twin._geometry = source._geometry
    twin.offset = source.offset
    twin._ends_in_image = source._ends_in_image
