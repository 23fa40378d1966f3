"""exp (softmax), tanh (GELU, softcap) and RoPE as compiled float32 chains, for MLX's CPU backend;
RMSNorm for the graphs.

On Linux, MLX's CPU ``exp``, ``tanh``, ``cos`` and ``sin`` are scalar loops (its SIMD layer has
no x86 vector type), while a chain of element-wise multiplies and adds compiled by ``mx.compile``
becomes one vectorised C++ kernel. The functions here compute the same values as polynomials that
compile to vector code, and RoPE rotates by tables made once per forward (``docs/speed.md`` has
what each buys in a prefill).

Accuracy (float32, checked in ``tests/test_cpu_math.py`` against float64): ``exp`` within 1e-7
relative (Cephes' ``expf``: round to a power of two, degree-7 polynomial; MLX's own CPU ``exp`` is
within 4e-6), ``tanh`` within 4e-7 absolute (Eigen's rational ``[13/6]`` approximation, the one
XLA uses). They run where ``zoo_cpu.backend`` says ``fast_math`` (the CPU, unless
``GEMMA_ZOO_FAST_MATH=0``); elsewhere, as on a GPU, MLX's fused kernels do the work
(``mx.fast.scaled_dot_product_attention``, ``nn.gelu_approx``). Without a C++ compiler MLX runs
the same chains unfused.

Where the backend runs the extension's kernels, a prefill's attention, GeGLU gate, RoPE and RMSNorm
run instead as kernels on both cores with the same arithmetic (``zoo_cpu.prefill``;
``GEMMA_ZOO_PREFILL_KERNELS=0`` keeps the chains and ``mx.fast.rms_norm``), and a decode step's
norms, attention heads and attention as one graph node each (``zoo_cpu.decode``;
``GEMMA_ZOO_DECODE_KERNELS=0`` keeps MLX's ops).
"""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from . import backend, prefill, sampling


def active() -> bool:
    """Whether the polynomial kernels replace MLX's ops (the backend's ``fast_math``)."""
    return backend.active().fast_math


def _kernels_for(x: mx.array):
    """``zoo_cpu.prefill`` where its kernels take ``x``'s rows now: a prefill's (``[B, L, ...]`` or
    ``[B, heads, L, D]`` with L > 1) where the backend runs the prefill kernels, a decode step's
    where it runs the decode kernels (they share the prefill kernels' norms and gate); else None."""
    chosen = backend.active()
    positions = x.ndim > 1 and x.shape[-2] > 1
    return prefill if (chosen.prefill if positions else chosen.decode) else None


# ---------------------------------------------------------------------------------------- exp
# Cephes expf: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2 (ln2 split in two for an exact
# reduction); e^r by a degree-7 polynomial; 2^n built in the exponent bits. Rounding by adding and
# subtracting 1.5 * 2^23 stays in vector code (MLX's kernels compile without SSE4.1, so ``floor``
# would be a call per element).
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_ROUND = 12582912.0
_EXP_LOW, _EXP_HIGH = -87.3, 88.3  # float32 e^x underflows below (returned as 0) and overflows above


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array, shift: mx.array) -> tuple[mx.array, mx.array]:
    """``e^(x - shift)`` as a float32 mantissa part and the int32 bits of its power of two."""
    x = x - shift
    clipped = mx.clip(x, _EXP_LOW, _EXP_HIGH)
    n = (clipped * _LOG2E + _ROUND) - _ROUND
    r = clipped - n * _LN2_HI - n * _LN2_LO
    p = _EXP_POLY[0]
    for c in _EXP_POLY[1:]:
        p = p * r + c
    p = (p * (r * r) + r + 1.0) * (x >= _EXP_LOW)
    return p, mx.left_shift((n + 127).astype(mx.int32), 23)


def exp_shifted(x: mx.array, shift: mx.array) -> mx.array:
    """``e^(x - shift)`` in float32 (``shift`` broadcasts): exactly 0 below e^-87.3, saturated at
    e^88.3 above (a softmax only passes ``x - max <= 0``).

    The power of two is reinterpreted from its bits outside the compiled kernel: ``view`` cannot
    be compiled shapeless, and a kernel traced per shape would retrace at every decode step."""
    p, bits = _exp_parts(x.astype(mx.float32), shift.astype(mx.float32))
    return p * bits.view(mx.float32)


def softmax(scores: mx.array, axis: int = -1) -> mx.array:
    """``softmax(scores)`` along ``axis``, computed and returned in float32 (MLX's ``precise``
    softmax off the CPU); keys masked with ``-inf`` get exactly 0."""
    scores = scores.astype(mx.float32)
    if not active():
        return mx.softmax(scores, axis=axis)
    e = exp_shifted(scores, mx.max(scores, axis=axis, keepdims=True))
    return e / mx.sum(e, axis=axis, keepdims=True)


def log_softmax(logits: mx.array, axis: int = -1) -> mx.array:
    """``logits - logsumexp(logits)`` along ``axis`` in float32, with the vectorised ``exp``: a
    sampler's log-probabilities over a 262,144-word vocabulary, every token. Along the last axis
    where the backend runs the decode kernels, the extension's three passes on both cores
    (``zoo_cpu.sampling.log_softmax``: ~0.1 ms there against ~1.3 for this chain)."""
    logits = logits.astype(mx.float32)
    if not active():
        return logits - mx.logsumexp(logits, axis=axis, keepdims=True)
    if backend.active().decode and axis in (-1, logits.ndim - 1):
        return sampling.log_softmax(logits)
    top = mx.max(logits, axis=axis, keepdims=True)
    return logits - (top + mx.log(mx.sum(exp_shifted(logits, top), axis=axis, keepdims=True)))


# ---------------------------------------------------------------------------------------- tanh, GELU
# Eigen's generic_fast_tanh_float: tanh(x) = x P(x^2) / Q(x^2) on [-7.905, 7.905] (clamped outside,
# where float32 tanh is +-1).
_TANH_CLAMP = 7.90531110763549805
_TANH_P = (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
           1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)
_TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_GELU_C = math.sqrt(2.0 / math.pi)


def _tanh(x: mx.array) -> mx.array:
    x = mx.clip(x, -_TANH_CLAMP, _TANH_CLAMP)
    x2 = x * x
    p = _TANH_P[0]
    for c in _TANH_P[1:]:
        p = p * x2 + c
    q = _TANH_Q[0]
    for c in _TANH_Q[1:]:
        q = q * x2 + c
    return x * p / q


@partial(mx.compile, shapeless=True)
def _tanh_f32(x: mx.array) -> mx.array:
    return _tanh(x.astype(mx.float32)).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def _gelu_gated(up: mx.array, gate: mx.array) -> mx.array:
    g = gate.astype(mx.float32)
    return (0.5 * g * (1.0 + _tanh(_GELU_C * (g + 0.044715 * g * g * g)))).astype(gate.dtype) * up


def tanh(x: mx.array) -> mx.array:
    """``tanh(x)`` in ``x``'s dtype (computed in float32 on the CPU)."""
    return _tanh_f32(x) if active() else mx.tanh(x)


def gelu_gated(up: mx.array, gate: mx.array) -> mx.array:
    """GeGLU's gating ``gelu(gate) * up`` with the tanh GELU (transformers' ``gelu_pytorch_tanh``);
    on the CPU the GELU is computed in float32 and rounded once to ``gate``'s dtype, as torch does.
    Float32 rows of a prefill take the prefill kernel (both cores), and of a decode step too with
    the decode kernels on (one graph node); else the compiled chain."""
    if not active():
        return nn.gelu_approx(gate) * up
    runs = _kernels_for(up)
    if runs is not None and up.dtype == gate.dtype == mx.float32 and up.shape == gate.shape:
        return runs.gelu_gated(up, gate)
    return _gelu_gated(up, gate)


def gelu_gated_joined(joined: mx.array) -> mx.array:
    """``gelu_gated(up, gate)`` of one product's joined output ``[..., up | gate]`` (an MLP's up and
    gate as one packed product): float32 rows through the kernel without splitting it first."""
    runs = _kernels_for(joined)
    if runs is not None and joined.dtype == mx.float32:
        return runs.gelu_gated(joined, None)
    return gelu_gated(*mx.split(joined, 2, axis=-1))


# ---------------------------------------------------------------------------------------- RoPE
def rotate_half(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """RoPE by tables: ``x cos + rotate_half(x) sin`` (dim i paired with i + D/2) for float32 ``cos``
    and ``sin`` ``[L, D/2]`` cast to ``x``'s dtype, as the reference computes it. ``mx.fast.rope``'s
    CPU fallback takes the cos and sin of every (position, frequency) in each call, with the scalar
    loops above; tables are made once per forward (``graphs.layers.RoPE.tables``)."""
    half = x.shape[-1] // 2
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


_rotate_chain = mx.compile(rotate_half)


def rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``rotate_half`` compiled; float32 rows of a prefill (``[L, D/2]`` or ``[B, 1, L, D/2]`` tables)
    take the prefill kernel (both cores)."""
    if backend.active().prefill and x.shape[-2] > 1 and x.dtype == cos.dtype == sin.dtype == mx.float32:
        return prefill.rotate(x, cos, sin)
    return _rotate_chain(x, cos, sin)


# ---------------------------------------------------------------------------------------- RMSNorm
def rms_norm(x: mx.array, weight: mx.array | None, eps: float, shift: float = 0.0, residual: mx.array | None = None) -> mx.array:
    """``residual + x * (mean(x²) + eps)^-1/2 * (weight + shift)`` over the last axis (``shift`` 1 for
    Gemma 2/3's ``1 + weight``; ``residual`` None or an array of x's shape), the norm computed in
    float32 (``weight`` in float32, or None) and rounded once to ``x``'s dtype, as Gemma's norms
    are: ``mx.fast.rms_norm``; float32 rows of a prefill, and of a decode step with the decode
    kernels on, through the prefill kernel (one graph node with its shift and residual)."""
    runs = _kernels_for(x)
    float32 = all(a is None or a.dtype == mx.float32 for a in (x, weight, residual))
    if runs is not None and float32:
        return runs.rms_norm(x, weight, eps, shift, residual)
    if weight is not None and shift:
        weight = weight + shift
    y = mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)
    return y if residual is None else residual + y
