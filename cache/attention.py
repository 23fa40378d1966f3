"""Argument checks shared by every read, and the one call into MLX's fused attention kernel."""

from __future__ import annotations

import mlx.core as mx


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` with GQA, through ``mx.fast.scaled_dot_product_attention``."""
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


def check_qkv(read: str, q: mx.array, k: mx.array, v: mx.array) -> None:
    """Raise ``ValueError`` naming the argument, the expected and the actual value."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, mx.array):
            raise ValueError(f"{read}: {name} must be an mx.array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{read}: {name} must have rank 4 [B, H, L, D], got rank {x.ndim} shape {tuple(x.shape)}")
    B, Hq, L, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"{read}: batch size of k {k.shape[0]} / v {v.shape[0]} must equal q's {B}")
    if k.shape[2] != L or v.shape[2] != L:
        raise ValueError(f"{read}: k has L={k.shape[2]} and v has L={v.shape[2]}; both must equal q's L={L}")
    if L < 1:
        raise ValueError(f"{read}: q must hold at least 1 new position, got L={L}")
    Hkv = k.shape[1]
    if v.shape[1] != Hkv:
        raise ValueError(f"{read}: v has {v.shape[1]} kv heads, expected k's {Hkv}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{read}: q heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if k.shape[3] != D:
        raise ValueError(f"{read}: k head dim {k.shape[3]} must equal q head dim {D}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{read}: q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_scale(read: str, scale) -> float:
    if scale is None:
        raise ValueError(f"{read}: scale is required (Gemma 4 uses 1.0)")
    return float(scale)


def check_blocks(read: str, blocks, B: int, L: int) -> mx.array:
    """``blocks`` is ``[B, L]`` of image indices per new position, -1 for text."""
    if not isinstance(blocks, mx.array):
        blocks = mx.array(blocks)
    if tuple(blocks.shape) != (B, L):
        raise ValueError(f"{read}: blocks must have shape [B, L] = {[B, L]}, got {list(blocks.shape)}")
    if not mx.issubdtype(blocks.dtype, mx.integer):
        raise ValueError(f"{read}: blocks must be an integer array, got dtype {blocks.dtype}")
    return blocks
