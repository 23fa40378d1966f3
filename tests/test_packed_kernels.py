"""The packed 4/8-bit kernels (``zoo_cpu._packed``) against float64 products of the same weights.

Both the kernel and the dequantized float32 path are held to one bound: the error of a float32
sum, ``|y - y64| <= TOL * sum_k |x_k| (|s q_k| + |b|)`` (the magnitudes the sum adds up, so a
result that cancels to ~0 is not held to a relative bound it cannot meet). Hypothesis draws
shapes (odd row counts, 1 to 40 activation rows across ``KERNEL_ROWS``, 1 to 40 groups: the
kernels convert scales 8 or 16 groups at a time and read weights in 32- or 64-byte blocks, so
rows end inside both), group sizes, bits and every instruction set this CPU runs; the thread
split must not change a bit.
"""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zoo_cpu  # noqa: F401  (before mlx)

import mlx.core as mx
import mlx.nn as nn

from zoo_cpu import extension, packed as zoo_packed

STATUS = extension.status()
needs_kernels = pytest.mark.skipif(not STATUS.available, reason=f"packed kernels unavailable: {STATUS.note}")
ISAS = STATUS.module.available_isas() if STATUS.available else []
TOL = 1e-5


SCALE_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def quantized(N: int, K: int, group: int, bits: int, seed: int, scale: float = 0.05, scale_dtype=mx.float32):
    """Random packed weights (affine; scales and biases stored in ``scale_dtype``, which the kernels
    read as they are) and the float64 ``w = s * q + b`` they stand for."""
    mx.random.seed(seed)
    w, s, b = mx.quantize(mx.random.normal((N, K)) * scale, group_size=group, bits=bits)
    s, b = s.astype(scale_dtype), b.astype(scale_dtype)
    mx.eval(w, s, b)
    ones, zeros = mx.ones(s.shape), mx.zeros(b.shape)
    q = np.array(mx.dequantize(w, ones, zeros, group_size=group, bits=bits)).astype(np.float64)
    s64 = np.repeat(np.array(s.astype(mx.float32), dtype=np.float64), group, axis=1)
    b64 = np.repeat(np.array(b.astype(mx.float32), dtype=np.float64), group, axis=1)
    return (w, s, b), s64 * q + b64, np.abs(s64 * q) + np.abs(b64)


def check(y: mx.array, x: mx.array, w64: np.ndarray, mag: np.ndarray) -> float:
    """Assert ``y`` is within the float32-sum bound of ``x @ w64.T``; return the worst error / bound."""
    x64 = np.array(x, dtype=np.float64).reshape(-1, w64.shape[1])
    ref = x64 @ w64.T
    bound = TOL * (np.abs(x64) @ mag.T) + 1e-30
    err = np.abs(np.array(y, dtype=np.float64).reshape(ref.shape) - ref)
    worst = float((err / bound).max()) if err.size else 0.0
    assert worst <= 1.0, f"error {err.max():.3g} exceeds the bound (worst ratio {worst:.2f})"
    return worst


@needs_kernels
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bits=st.sampled_from(zoo_packed.BITS),
    group=st.sampled_from(zoo_packed.GROUP_SIZES),
    groups=st.integers(1, 40),
    N=st.integers(1, 70),
    M=st.integers(1, 40),
    isa=st.sampled_from(ISAS or ["portable"]),
    scale_dtype=st.sampled_from(list(SCALE_DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_packed_matmul_is_the_dequantized_product(bits, group, groups, N, M, isa, scale_dtype, seed):
    K = group * groups
    (w, s, b), w64, mag = quantized(N, K, group, bits, seed, scale_dtype=SCALE_DTYPES[scale_dtype])
    x = mx.random.normal((M, K))
    check(zoo_packed.packed_matmul(x, w, s, b, group, bits, isa=isa), x, w64, mag)
    # the float32 path the kernel replaces meets the same bound
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    check(x @ mx.dequantize(w, s32, b32, group_size=group, bits=bits).T, x, w64, mag)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(
    bits=st.sampled_from(zoo_packed.BITS),
    group=st.sampled_from(zoo_packed.GROUP_SIZES),
    groups=st.integers(1, 4),
    N=st.integers(1, 50),
    isa=st.sampled_from(ISAS or ["portable"]),
    scale_dtype=st.sampled_from(list(SCALE_DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_packed_dequantize_equals_mlx(bits, group, groups, N, isa, scale_dtype, seed):
    """The float32 weight: ``q * s + b`` rounded once (fused, AVX2 / AVX-512) or twice (portable, as MLX)."""
    (w, s, b), w64, mag = quantized(N, group * groups, group, bits, seed, scale_dtype=SCALE_DTYPES[scale_dtype])
    ours = np.array(zoo_packed.packed_dequantize(w, s, b, group, bits, isa=isa), dtype=np.float64)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    mlx_own = np.array(mx.dequantize(w, s32, b32, group_size=group, bits=bits), dtype=np.float64)
    assert (np.abs(ours - w64) <= 2**-24 * (mag + np.abs(w64))).all()
    assert np.abs(ours - w64).max() <= np.abs(mlx_own - w64).max()


@needs_kernels
@pytest.mark.parametrize("bits", zoo_packed.BITS)
@pytest.mark.parametrize("M", [1, 3, 9])
def test_thread_split_changes_no_bit(bits, M):
    """Rows split over threads (a product this size is split) give the same bits as one thread."""
    module = STATUS.module
    (w, s, b), w64, mag = quantized(1001, 512, 64, bits, 7)
    x = mx.random.normal((M, 512))
    before = module.threads()
    try:
        module.set_threads(1)
        one = zoo_packed.packed_matmul(x, w, s, b, 64, bits)
        d_one = zoo_packed.packed_dequantize(w, s, b, 64, bits)
        mx.eval(one, d_one)
        module.set_threads(max(2, before))
        many = zoo_packed.packed_matmul(x, w, s, b, 64, bits)
        d_many = zoo_packed.packed_dequantize(w, s, b, 64, bits)
        mx.eval(many, d_many)
    finally:
        module.set_threads(before)
    assert mx.array_equal(one, many) and mx.array_equal(d_one, d_many)
    check(many, x, w64, mag)


@needs_kernels
def test_batch_axes_strides_and_dtypes():
    """Leading axes and a transposed (non-contiguous) input are taken as they are; bf16 scales with
    float32 biases (mixed: both read as float32) give the product of those values."""
    (w, s, b), w64, mag = quantized(33, 128, 32, 4, 3)
    x = mx.random.normal((2, 3, 128))
    y = zoo_packed.packed_matmul(x, w, s, b, 32, 4)
    assert y.shape == (2, 3, 33) and y.dtype == mx.float32
    check(y, x, w64, mag)
    xt = mx.random.normal((128, 5)).T
    check(zoo_packed.packed_matmul(xt, w, s, b, 32, 4), xt, w64, mag)
    s16 = s.astype(mx.bfloat16)
    y16 = zoo_packed.packed_matmul(x, w, s16, b, 32, 4)
    ref16 = x @ mx.dequantize(w, s16.astype(mx.float32), b, group_size=32, bits=4).T
    assert mx.allclose(y16, ref16, atol=1e-4)


@needs_kernels
def test_inside_mx_compile():
    (w, s, b), w64, mag = quantized(40, 256, 64, 8, 5)
    f = mx.compile(lambda x: zoo_packed.packed_matmul(x, w, s, b, 64, 8) * 2.0)
    for M in (1, 1, 2):
        x = mx.random.normal((M, 256))
        assert mx.allclose(f(x), 2.0 * zoo_packed.packed_matmul(x, w, s, b, 64, 8), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize(
    "call,message",
    [
        (lambda w, s, b, x: zoo_packed.packed_matmul(x, w, s, b, 64, 3), "bits=3 is not supported (4 or 8)"),
        (lambda w, s, b, x: zoo_packed.packed_matmul(x, w, s, b, 16, 4), "group_size=16 is not supported"),
        (lambda w, s, b, x: zoo_packed.packed_matmul(x[:, :64], w, s, b, 64, 4), "x's last axis must be the weight's input size 128"),
        (lambda w, s, b, x: zoo_packed.packed_matmul(x, w, s[:, :1], b, 64, 4), "needs scales and biases of shape [8, 2]"),
        (lambda w, s, b, x: zoo_packed.packed_dequantize(w.astype(mx.int32), s, b, 64, 4), "must be a 2-D uint32 array"),
        (lambda w, s, b, x: zoo_packed.packed_matmul(x, w, s, b, 64, 4, isa="neon"), "isa='neon' is not available here"),
    ],
)
def test_bad_input_is_named(call, message):
    (w, s, b), _, _ = quantized(8, 128, 64, 4, 1)
    with pytest.raises(ValueError, match=None) as err:
        call(w, s, b, mx.ones((2, 128)))
    assert message in str(err.value)


@needs_kernels
@pytest.mark.parametrize("bits", zoo_packed.BITS)
def test_packed_modules_equal_the_quantized_ones(bits, monkeypatch):
    """PackedLinear / PackedEmbedding: the kernel for few rows, dequantized row blocks through the
    BLAS for many (blocks made small here so the head is cut in several), lookups unchanged."""
    monkeypatch.setattr(zoo_packed, "DENSE_BLOCK_BYTES", 4 * 256 * 7)
    linear = nn.QuantizedLinear.from_linear(nn.Linear(256, 45, bias=True), 64, bits)
    embed = nn.QuantizedEmbedding.from_embedding(nn.Embedding(50, 256), 64, bits)
    mx.eval(linear.parameters(), embed.parameters())
    packed_linear, packed_embed = zoo_packed.PackedLinear.of(linear), zoo_packed.PackedEmbedding.of(embed)
    assert isinstance(packed_linear, nn.QuantizedLinear) and isinstance(packed_embed, nn.QuantizedEmbedding)
    assert set(packed_linear.parameters()) == set(linear.parameters())
    for rows in (1, zoo_packed.KERNEL_ROWS, zoo_packed.KERNEL_ROWS + 1, 50):
        x = mx.random.normal((1, rows, 256))
        assert mx.allclose(packed_linear(x), linear(x), atol=2e-5), rows
        assert mx.allclose(packed_embed.as_linear(x), embed.as_linear(x), atol=2e-5), rows
    ids = mx.array([[0, 49, 7]])
    assert mx.array_equal(packed_embed(ids), embed(ids))


def test_built_here_when_a_compiler_is_present():
    """On Linux x86-64 with a C++ compiler the install must have built the kernels (else CI would skip this file)."""
    if sys.platform != "linux" or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no compiler here: the kernels are not expected")
    assert extension.describe().startswith("C++ kernels: ")


@needs_kernels
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_scales_are_read_exactly(dtype):
    """Every half-precision scale kind the kernels convert themselves: normal, subnormal, zero, negative."""
    (w, _, _), _, _ = quantized(6, 64, 32, 8, 2)
    values = [3.0e-5, 1.0e-6, 6.0e-8, 0.0, -0.0123, 65504.0 if dtype == mx.float16 else 3.0e38, -2.5e-7, 1.0, 0.5, -7.0, 1e-3, 2.0]
    s = mx.array(values, dtype=dtype).reshape(6, 2)
    b = -s
    want = mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=8)
    got = zoo_packed.packed_dequantize(w, s, b, 32, 8)
    assert mx.allclose(got, want, rtol=2**-23, atol=0).item()
