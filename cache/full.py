"""Full-attention storage: every position is kept, in a buffer that grows in fixed steps."""

from __future__ import annotations

import mlx.core as mx

from .base import AttentionCache


class KVCache(AttentionCache):
    """KV cache of a full-attention layer; grows without bound.

    The buffer grows ``step`` positions at a time (one copy per step, not per token) and new
    positions are written in place, as in mlx-lm's ``KVCache``.
    """

    kind = "full"

    def __init__(self, step: int = 256):
        if int(step) < 1:
            raise ValueError(f"KVCache: step must be >= 1, got {step}")
        super().__init__()
        self.step = int(step)

    @classmethod
    def _config_names(cls):
        return ("step",)

    @property
    def bytes_per_token(self) -> int:
        if self.keys is None:
            return 0
        B, H, _, D = self.keys.shape
        return B * H * (D + self.values.shape[3]) * self.keys.dtype.size

    def can_trim(self, n: int) -> bool:
        return 0 <= n <= self._rows

    def _reserve(self, rows: int, k: mx.array, v: mx.array) -> None:
        """Make room for ``rows`` positions, keeping the stored ones."""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if rows <= capacity:
            return
        grown = -(-rows // self.step) * self.step
        new_k, new_v = self._new_buffers(k, v, grown - self._rows)
        if self.keys is None or self._rows == 0:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[..., : self._rows, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., : self._rows, :], new_v], axis=2)

    def _append(self, k, v):
        n, L = self._rows, k.shape[2]
        self._reserve(n + L, k, v)
        self.keys[..., n : n + L, :] = k
        self.values[..., n : n + L, :] = v
        self._rows = n + L
        return self.keys[..., : n + L, :], self.values[..., : n + L, :], 0

    def _canvas_keys(self, k, v):
        # The block goes into the free rows past the stored ones without being counted as stored,
        # so the read costs no copy of the history.
        n, L = self._rows, k.shape[2]
        self._reserve(n + L, k, v)
        self.keys[..., n : n + L, :] = k
        self.values[..., n : n + L, :] = v
        return self.keys[..., : n + L, :], self.values[..., : n + L, :]
