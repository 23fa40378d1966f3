"""Attention masks, built from absolute positions: the only place in the project that builds masks.

Every read attends a contiguous run of stored positions ``[k_start, k_start + T)`` with queries at
``[q_start, q_start + L)``; the rules below are the reference's (transformers 5.24 ``masking_utils``)
written over those absolute positions. A function returns ``None`` when every key is visible to
every query, the string ``"causal"`` when MLX's fused bottom-right causal mask is exact, and
otherwise a boolean array (True = attend) that broadcasts against ``[B, Hq, L, T]``.
"""

from __future__ import annotations

import mlx.core as mx


def _positions(q_start: int, L: int, k_start: int, T: int) -> tuple[mx.array, mx.array]:
    qpos = mx.arange(q_start, q_start + L)[:, None]
    kpos = mx.arange(k_start, k_start + T)[None, :]
    return qpos, kpos


def causal(q_start: int, L: int, k_start: int, T: int, window: int | None = None):
    """Causal, and on sliding layers limited to keys in ``(q - window, q]``.

    Decode (``L == 1``) over at most ``window`` keys needs no mask at all, which is the steady state.
    """
    last_q = q_start + L - 1
    window_binds = window is not None and k_start <= last_q - window
    if not window_binds:
        if L == 1:
            return None
        # MLX's "causal" aligns the last query with the last key: exact when they coincide.
        if k_start + T == q_start + L:
            return "causal"
    qpos, kpos = _positions(q_start, L, k_start, T)
    visible = kpos <= qpos
    if window is not None:
        visible = visible & (kpos > qpos - window)
    return visible


def _same_block(blocks: mx.array, T: int) -> mx.array:
    """``[B, 1, L, T]``: key j is a new position of the same image as query i.

    ``blocks`` holds the image index of each new position (-1 for text). The new positions are the
    last ``L`` keys; stored history never belongs to an image of this read (images are never split
    across reads), so its columns are False.
    """
    B, L = blocks.shape
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    if T > L:
        same = mx.concatenate([mx.zeros((B, L, T - L), dtype=mx.bool_), same], axis=2)
    return same[:, None]


def vision_prefill(q_start: int, L: int, k_start: int, T: int, blocks: mx.array, window: int | None):
    """Gemma 4 media prefill: sliding layers ``(causal OR same block >= 0) AND window``; full layers
    causal. Blocks below 0 (text -1, causal media spans <= -2) add no overlay: without any block
    >= 0 the mask is exactly ``causal`` (and takes its fast forms)."""
    if window is None or not bool(mx.any(blocks >= 0).item()):
        return causal(q_start, L, k_start, T, window)
    qpos, kpos = _positions(q_start, L, k_start, T)
    visible = ((kpos <= qpos) | _same_block(blocks, T)) & (kpos > qpos - window)
    return visible


def encoder(q_start: int, L: int, k_start: int, T: int, blocks: mx.array, window: int | None):
    """DiffusionGemma encoder: full ``causal OR same image``; sliding ``(causal AND window) OR same image``.

    The image overlay is not limited by the window on sliding layers.
    """
    qpos, kpos = _positions(q_start, L, k_start, T)
    visible = kpos <= qpos
    if window is not None:
        visible = visible & (kpos > qpos - window)
    return visible | _same_block(blocks, T)


def bidirectional(q_start: int, L: int, k_start: int, T: int, window: int | None):
    """A whole sequence encoded at once: every key on full layers, ``|q - k| <= window`` on sliding
    layers. That is Gemma 4 ``use_bidirectional_attention="all"`` with the config's halved window
    (transformers' ``sliding_window_bidirectional_overlay``, inclusive); Gemma 3's encoder bounds its
    overlay exclusively (``|q - k| < W``), so its caches are made with ``W - 1``
    (``tests/test_bidirectional_window.py`` checks both against transformers)."""
    if window is None:
        return None
    qpos, kpos = _positions(q_start, L, k_start, T)
    if max(q_start + L - 1 - k_start, k_start + T - 1 - q_start) <= window:
        return None
    return mx.abs(kpos - qpos) <= window


def draft(q_start: int, L: int, k_start: int, T: int, window: int | None):
    """A drafter's read (Gemma 4 assistants): ``L`` queries that all sit at position ``q_start``
    (the next position, not yet stored) over stored keys only. Full layers see every stored key;
    sliding layers the newest ``window + 1`` before ``q_start``, i.e. keys in
    ``[q_start - window - 1, q_start)``: transformers' assistant flips a bidirectional sliding mask
    whose window is inclusive (``|i - j| <= window``) over the stored keys, newest first.
    None when every key of the run is visible (the cache passes exactly that run)."""
    if window is None or k_start >= q_start - window - 1:
        return None
    kpos = mx.arange(k_start, k_start + T)[None, :]
    return mx.broadcast_to(kpos >= q_start - window - 1, (L, T))


def decode_run(start: mx.array, size: int, write_row: mx.array) -> mx.array:
    """A decode step compiled whole (``cache.positioned``): its query reads ``size`` stored rows from
    row ``start`` and was written at ``write_row`` (both arrays, so one compiled step serves every
    token). Rows hold positions in temporal order and the run never spans more than a window, so
    the visible keys are exactly the rows up to the new one: ``[1, size]`` booleans."""
    return (start + mx.arange(size))[None] <= write_row
