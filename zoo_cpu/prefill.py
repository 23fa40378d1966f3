"""A prefill's work on both CPU cores: float32 kernels of the zoo's extension (``zoo_cpu/src/prefill*``).

MLX's CPU element-wise kernels run on one core, its CPU attention is separate products around a
softmax, and MKL, which runs MLX's GEMMs, treats this AMD CPU as a generic one (its float32 GEMM
runs at about the AVX2 rate). The extension adds MLX primitives split over its thread pool, with
AVX-512, AVX2 and portable vector code:

- ``attention(q, keys, values, scale, mask)``: ``softmax(q k^T * scale + mask) v`` for a chunk of
  queries, per block of 32 query rows of one head: the scores against keys packed once per kv
  head (GQA's query heads share them), the masked softmax in float32 (Cephes' ``exp``, as
  ``zoo_cpu.fast_math``), the product with the values; a causal block computes only the keys up to
  its last query;
- ``linear(x, w)``: ``x @ w.T`` (the projections), ``x`` packed in panels of 32 rows, tiles of 12
  weight rows; ``Linear`` is an ``nn.Linear`` taking it for many rows, which
  ``models.precision`` puts in a loaded graph;
- ``gelu_gated(up, gate)`` (Eigen's rational ``tanh``, as ``zoo_cpu.fast_math``), ``rms_norm(x, weight,
  eps)`` and ``rotate(x, cos, sin)`` (RoPE by tables), split by rows.

Each computes what MLX's ops or ``zoo_cpu.fast_math``'s compiled chains compute, in float32, up to
summation order (``tests/test_prefill_kernels.py`` bounds them against float64). ``fast_math``
calls them where ``zoo_cpu.backend`` says they run (``GEMMA_ZOO_PREFILL_KERNELS=0`` or
``GEMMA_ZOO_FAST_MATH=0``: MLX's ops). ``docs/speed.md`` has the measurements.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import backend
from .extension import module as _module

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


def rms_norm(x: mx.array, weight: mx.array | None, eps: float, shift: float = 0.0, residual: mx.array | None = None,
             isa: str | None = None) -> mx.array:
    """``residual + x * (mean(x²) + eps)^-1/2 * (weight + shift)`` over the last axis, float32
    (``weight [D]`` or None; ``shift`` 1 for Gemma 2/3's ``1 + weight``; ``residual`` None or x's shape)."""
    return _module().rms_norm(x, weight, float(eps), float(shift), residual, isa or "")


def rotate(x: mx.array, cos: mx.array, sin: mx.array, isa: str | None = None) -> mx.array:
    """RoPE by tables, ``x cos + rotate_half(x) sin``: float32 ``x [B, H, L, D]`` (any strides),
    ``cos`` and ``sin`` ``[L, D/2]`` or ``[B, 1, L, D/2]``."""
    return _module().rope_rotate(x, cos, sin, isa or "")


def gelu_gated(up: mx.array, gate: mx.array | None, isa: str | None = None) -> mx.array:
    """``gelu_tanh(gate) * up`` for float32 ``up`` and ``gate`` of one shape; ``gate`` None: ``up``
    holds rows of ``[up | gate]`` (one product's joined output) and the result has half its width."""
    return _module().gelu_gate(up, gate, isa or "")


def linear(x: mx.array, w: mx.array, isa: str | None = None, transposed: bool = False) -> mx.array:
    """``x @ w.T`` for float32 ``x [..., K]`` and ``w [N, K]``, the weight's rows split over the
    threads: up to 8 rows of ``x`` (a batch's decode step, a verify block), each weight row's dot
    products with every row, unpacked; more, ``x`` packed in panels of rows (AVX-512 tiles of 12
    weight rows by 32 activation rows, by 16 where a panel holds 16 rows or fewer).

    ``transposed``: ``x @ w`` for a weight stored transposed, ``w [K, N]`` (the output head's layout,
    ``graphs.speedups``), through the few-row kernel: for a few rows of ``x`` (a speculative verify
    block), each weight row streamed once with every row of ``x`` against it, where the BLAS's GEMM
    takes several times one row's gemv (docs/speculative.md)."""
    return _module().prefill_linear(x, w, isa or "", transposed)


def takes_linear(x: mx.array, w: mx.array) -> bool:
    """Whether ``linear`` takes ``x @ w.T`` now: float32 operands with at least one row and one input,
    and a backend that runs the prefill kernels. From one row (a decode step) it beats the BLAS's gemv
    (docs/speed.md, "A batch's few rows")."""
    return x.size > 0 and x.dtype == mx.float32 and w.dtype == mx.float32 and backend.active().prefill


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same saved form) whose float32 products take ``linear`` while
    the backend runs the prefill kernels (``takes_linear``); other products stay MLX's."""

    @classmethod
    def of(cls, module: nn.Linear) -> "Linear":
        new = cls.__new__(cls)  # no __init__: it would draw a random weight
        nn.Module.__init__(new)
        new.weight = module.weight
        if "bias" in module:
            new.bias = module.bias
        if module._no_grad:
            new.freeze()
        return new

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if not takes_linear(x, w):
            return super().__call__(x)
        y = linear(x, w)
        return y + self["bias"] if "bias" in self else y
