"""Compiled decode-step pieces: the per-head RMSNorm and RoPE of queries and keys, fused by ``mx.compile``.

On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` have no kernel of their own: each call
expands into a dozen small MLX ops (squares, sums, rsqrt, broadcasts; and for RoPE the positions,
the cos/sin of every frequency, the rotation and the concatenation). A Gemma 3 270M decode step
has ~3,600 graph nodes, a third of them from these two calls on q and k, and on a 2-core CPU each
node costs a few microseconds of scheduling. ``norm_rope`` runs the same ops through one compiled
function per (shape, dtype, RoPE kind): MLX fuses the element-wise chains into generated C++
kernels (compiled once by the system C++ compiler and cached in ``$TMPDIR/mlx``; without a
compiler MLX runs the traced ops unfused, so results never depend on it).

Measured on the 2-core box with the real 270M (``docs/speed.md``): -11% CPU time per decoded
token; compiling the rest of the layer (o_proj, norms, MLP, residuals) bought nothing more, and
compiling prefill chunks bought nothing (their time is in the matmuls), so only single-position
calls (decode) take this path. The weights are arguments, not captured constants, so a model whose
weights change after a first call stays correct. ``GEMMA_ZOO_COMPILE=0`` turns the path off.
"""

from __future__ import annotations

import os

import zoo_blas  # noqa: F401  (before mlx)

import mlx.core as mx

ENV = "GEMMA_ZOO_COMPILE"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _norm(x: mx.array, weight: mx.array | None, eps: float, plus_one: bool) -> mx.array:
    """Gemma's RMSNorm exactly as the graphs compute it: in float32, rounded once to ``x``'s dtype."""
    if weight is not None:
        weight = weight.astype(mx.float32)
        if plus_one:
            weight = 1.0 + weight
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


def _norm_rope(x, weight, offset, freqs, eps, plus_one, dims, base):
    y = _norm(x, weight, eps, plus_one)
    return mx.fast.rope(y, dims, traditional=False, base=base, scale=1.0, offset=offset, freqs=freqs)


_compiled = mx.compile(_norm_rope)


def norm_rope(x: mx.array, norm, rope, offset: int, plus_one: bool) -> mx.array:
    """``rope(norm(x), offset)`` for ``x [B, heads, L, D]``; compiled for single positions.

    ``norm`` is a Gemma RMSNorm module (``weight`` and ``eps``; Gemma 2/3 scale by ``1 + weight``:
    ``plus_one``), ``rope`` a ``graphs.layers.RoPE``. Other shapes, or ``GEMMA_ZOO_COMPILE=0``, call
    the modules as they are.
    """
    if x.shape[-2] != 1 or not enabled():
        return rope(norm(x), offset)
    weight = norm.get("weight") if hasattr(norm, "get") else None
    return _compiled(x, weight, mx.array(offset, dtype=mx.int32), rope._periods, norm.eps, plus_one, rope.head_dim, rope._base)
