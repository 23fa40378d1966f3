"""A prefill's attention and GeGLU gate on both CPU cores: fused float32 kernels of ``kernels._packed``.

MLX's CPU element-wise kernels run on one core, and its CPU attention is separate products around a
softmax, so in a prefill chunk the softmax, mask and GELU wait on one core while the BLAS uses two.
``kernels/src/prefill.cpp`` adds two primitives, split over the extension's thread pool:

- ``attention(q, keys, values, scale, mask)``: ``softmax(q k^T * scale + mask) v`` for a chunk of
  queries, per block of 32 query rows of one head: the scores against keys packed once per kv
  head (GQA's query heads share them), the masked softmax in float32 (Cephes' ``exp``, as
  ``cache.cpu_math``), the product with the values; a causal block computes only the keys up to its
  last query;
- ``gelu_gated(up, gate)``: ``gelu_tanh(gate) * up`` (Eigen's rational ``tanh``, as ``cache.cpu_math``).

Both compute what ``cache.cpu_math``'s compiled chains compute, in float32, up to summation order
(``tests/test_prefill_kernels.py`` bounds them against float64). ``cache`` imports nothing of the
project, so ``models`` installs this module there (``cache.cpu_math.install``).
"""

from __future__ import annotations

import zoo_blas  # noqa: F401  (before mlx)

import mlx.core as mx

from . import status


def available() -> bool:
    """Whether the extension (and so these kernels) runs in this process (``kernels.status()``)."""
    return status().available


def _module():
    s = status()
    if not s.available:
        raise RuntimeError(f"the prefill kernels are unavailable: {s.note}")
    return s.module


def takes(q: mx.array, keys: mx.array, values: mx.array, mask) -> bool:
    """Whether ``attention`` computes this read: float32 ``q``, ``keys`` and ``values``, and a mask
    that is None, ``"causal"`` or boolean ``[L, T]`` / ``[B or 1, 1, L, T]`` (``cache.masks``'s
    forms; a mask per query head is not one of them)."""
    if not (q.dtype == keys.dtype == values.dtype == mx.float32):
        return False
    if mask is None or isinstance(mask, str):
        return mask in (None, "causal")
    if mask.dtype != mx.bool_:
        return False
    L, T = q.shape[2], keys.shape[2]
    if mask.ndim == 2:
        return tuple(mask.shape) == (L, T)
    return mask.ndim == 4 and mask.shape[0] in (1, q.shape[0]) and tuple(mask.shape[1:]) == (1, L, T)


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask, isa: str | None = None) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` in float32: ``q [B, Hq, L, D]``, ``keys [B, Hkv, T, D]``,
    ``values [B, Hkv, T, Dv]``, ``mask`` one of the forms ``takes`` accepts ("causal": the last query
    aligned with the last key, MLX's convention). ``isa`` picks an instruction set (tests)."""
    if mask is not None and not isinstance(mask, mx.array) and mask != "causal":
        raise ValueError(f"prefill attention: mask must be None, 'causal' or a boolean array, got {mask!r}")
    causal = isinstance(mask, str)
    return _module().prefill_attention(q, keys, values, float(scale), None if causal else mask, causal, isa or "")


def gelu_gated(up: mx.array, gate: mx.array, isa: str | None = None) -> mx.array:
    """``gelu_tanh(gate) * up`` for float32 ``up`` and ``gate`` of one shape."""
    return _module().gelu_gate(up, gate, isa or "")
