"""A cache-free attention oracle for the cache tests.

It logs every position ever written (keys, values, absolute position, image id) and answers each
read by explicit float64 attention over the logged positions, with the visibility rule written
directly over absolute positions. It shares no code with ``cache/``.
"""

from __future__ import annotations

import numpy as np


def _np(x) -> np.ndarray:
    return np.array(x, dtype=np.float64)


class DenseReference:
    def __init__(self, window: int | None):
        self.window = window
        self.keys = None  # [B, Hkv, N, D]
        self.values = None
        self.images = None  # [B, N] globally unique image id per position, -1 for text
        self._next_image = 0

    @property
    def offset(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _visible(self, read: str, qpos: np.ndarray, kpos: np.ndarray, same: np.ndarray) -> np.ndarray:
        W = self.window
        causal = kpos <= qpos
        in_window = np.ones_like(causal) if W is None else kpos > qpos - W
        if read in ("decode", "window"):
            return causal & in_window
        if read == "vision_prefill":
            return causal if W is None else (causal | same) & in_window
        if read == "encoder":
            return (causal & in_window) | same
        if read == "bidirectional":
            return np.ones_like(causal) if W is None else np.abs(kpos - qpos) <= W
        raise AssertionError(read)

    def _unique_images(self, blocks: np.ndarray) -> np.ndarray:
        ids = np.where(blocks >= 0, blocks + self._next_image, -1)
        if (blocks >= 0).any():
            self._next_image += int(blocks.max()) + 1
        return ids

    def write(self, k, v, blocks=None) -> None:
        """Log the new positions (``blocks``: per-read image index, -1 for text)."""
        k, v = _np(k), _np(v)
        B, _, L, _ = k.shape
        blocks = np.full((B, L), -1) if blocks is None else np.array(blocks)
        images = self._unique_images(blocks)
        if self.keys is None:
            self.keys, self.values, self.images = k, v, images
        else:
            self.keys = np.concatenate([self.keys, k], axis=2)
            self.values = np.concatenate([self.values, v], axis=2)
            self.images = np.concatenate([self.images, images], axis=1)

    def attend_new(self, read: str, q, scale: float) -> np.ndarray:
        """Attention of queries at the newest ``L`` logged positions under ``read``'s rule."""
        q = _np(q)
        N = self.offset
        start = N - q.shape[2]
        qpos = np.arange(start, N)[None, :, None]
        kpos = np.arange(N)[None, None, :]
        q_img = self.images[:, start:, None]
        same = (q_img >= 0) & (q_img == self.images[:, None, :])
        mask = self._visible(read, qpos, kpos, same)
        return self._attend(q, self.keys, self.values, scale, mask)

    def canvas(self, q, k, v, scale: float) -> np.ndarray:
        q, k, v = _np(q), _np(k), _np(v)
        history = self.offset if self.window is None else min(self.offset, self.window - 1)
        keys = np.concatenate([self.keys[:, :, self.offset - history :], k], axis=2) if history else k
        values = np.concatenate([self.values[:, :, self.offset - history :], v], axis=2) if history else v
        mask = np.ones((q.shape[0], q.shape[2], keys.shape[2]), dtype=bool)
        return self._attend(q, keys, values, scale, mask)

    def trim(self, n: int) -> None:
        keep = self.offset - n
        self.keys, self.values, self.images = self.keys[:, :, :keep], self.values[:, :, :keep], self.images[:, :keep]

    @staticmethod
    def _attend(q, keys, values, scale, mask) -> np.ndarray:
        groups = q.shape[1] // keys.shape[1]
        keys = np.repeat(keys, groups, axis=1)
        values = np.repeat(values, groups, axis=1)
        scores = np.einsum("bhld,bhtd->bhlt", q, keys) * scale
        scores = np.where(mask[:, None], scores, -np.inf)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        return np.einsum("bhlt,bhtd->bhld", probs, values)
