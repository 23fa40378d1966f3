"""A decode step's small work as one graph node each: the zoo extension's decode primitives.

A decode step is a thousand or more small MLX graph nodes (docs/speed.md counts the 270M's), and on
the CPU each node costs its stream a task handed to a worker thread, which on a small model
outweighs the arithmetic. The extension
(``zoo_cpu/src/decode*``) adds two primitives, and ``zoo_cpu.prefill.rms_norm`` takes a shift and
a residual, so that the pieces a layer repeats are one node each:

- ``heads``: a layer's projected queries, keys and values ``[B, 1, N]`` as heads: queries and keys
  RMS-normed (``shift`` 1 for Gemma 2/3's ``1 + weight``) and rotated by RoPE tables, values
  normed without a weight where the layer does (Gemma 4);
- ``attention``: one query per row against a run of rows of a cache's key and value planes from
  a row given as an array, read in place (no slice of the planes is made), masked by the mask the
  cache built; parts of the run on the extension's threads, merged by their maxima;
- ``attention_quantized``: the same over ``mx.quantize``'s planes (8 or 4 bits), the codes read in
  place (MLX's ``quantized_matmul`` pair it replaces runs far below the bandwidth: docs/long_context.md);
- ``attention_rows``: a ragged batch's decode read as one node: one query per batch row, each over
  a run of that row's own planes (float or quantized), every row's parts on the threads together
  (the row-by-row reads it replaces cost a node and a thread hand-off each: docs/cache.md).

Float32 only, the same arithmetic as ``zoo_cpu.fast_math``'s chains up to summation order
(``tests/test_decode_kernels.py``). ``fast_math`` and ``cache`` call them where ``zoo_cpu.backend``
says they run (``GEMMA_ZOO_DECODE_KERNELS=0`` or ``GEMMA_ZOO_FAST_MATH=0``: MLX's ops).
"""

from __future__ import annotations

import mlx.core as mx

from .extension import module as _module

QUANTIZED_BITS = (4, 8)  # the widths whose codes pack whole into bytes


def heads(projected: mx.array, heads: int, kv_heads: int, has_v: bool, head_dim: int, q_weight, k_weight,
          shift: float, eps: float, v_norm: bool, cos: mx.array, sin: mx.array, isa: str | None = None) -> list:
    """``[q]`` or ``[q, k, v]`` (``[B, H, 1, D]``) from ``projected [B, 1, N]``: the queries, then
    ``kv_heads`` keys and (``has_v``) values side by side; without ``has_v`` the values are the raw
    keys. ``cos``/``sin`` ``[1, D/2]`` are the position's RoPE tables."""
    return _module().decode_heads(
        projected, heads, kv_heads, has_v, head_dim, q_weight, k_weight, float(shift), float(eps), v_norm, cos, sin,
        isa or "",
    )  # fmt: skip


def attention(q: mx.array, keys: mx.array, values: mx.array, start: mx.array, size: int, scale: float, mask,
              isa: str | None = None) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` for ``q [B, Hq, 1, D]`` over rows ``[start, start + size)``
    of ``keys``/``values [B, Hkv, T, D]``; ``start`` an int32 array, ``mask`` None or bool ``[1 or B, size]``."""
    start = start.reshape(1).astype(mx.int32)
    return _module().decode_attention(q, keys, values, start, size, float(scale), mask, isa or "")


def attention_quantized(q: mx.array, keys: tuple, values: tuple, start: mx.array, size: int, scale: float, mask,
                        bits: int, group_size: int, isa: str | None = None) -> mx.array:
    """``attention`` over keys and values stored as ``mx.quantize``'s (packed uint32, scales, biases)
    planes ``[B, Hkv, T, ...]`` with float32 scales and biases, ``bits`` in ``QUANTIZED_BITS``."""
    start = start.reshape(1).astype(mx.int32)
    return _module().decode_attention_quantized(q, *keys, *values, start, size, float(scale), mask, bits, group_size,
                                                isa or "")


def attention_rows(q: mx.array, keys: list, values: list, starts: list, sizes: list, scale: float, bits: int | None = None,
                   group_size: int = 64, isa: str | None = None) -> mx.array:
    """``attention`` for each row ``r`` of ``q [B, Hq, 1, D]`` over rows ``[starts[r], starts[r] +
    sizes[r])`` of that row's own planes ``keys[r]``/``values[r]`` (tuples of planes ``[1, Hkv, T_r,
    ...]``: one float32 plane, or ``mx.quantize``'s three with ``bits`` in ``QUANTIZED_BITS``), unmasked."""
    planes = [p for k, v in zip(keys, values) for p in (*k, *v)]
    return _module().decode_attention_rows(q, planes, [int(s) for s in starts], [int(s) for s in sizes], float(scale),
                                           bits or 0, group_size, isa or "")
