"""The CPU kernels of ``zoo_cpu.fast_math`` against float64, and the reads and RoPE that use them
against MLX's own ops (``mx.fast.scaled_dot_product_attention``, ``mx.fast.rope``)."""

import math

import numpy as np
import pytest

import mlx.core as mx

from cache import attention
from cache.attention import attend
from graphs.layers import RoPE, gelu_gated, softcap
from zoo_cpu import backend, fast_math

pytestmark = pytest.mark.skipif(not fast_math.active(), reason="the polynomial kernels run on the CPU only")


def test_exp_within_1e7_relative_and_exact_zero_below_range():
    xs = np.linspace(-87.3, 88.0, 2_000_001, dtype=np.float32)
    got = np.array(fast_math.exp_shifted(mx.array(xs), mx.array(0.0)))
    want = np.exp(xs.astype(np.float64))
    assert (np.abs(got - want) / want).max() < 1.5e-7
    edges = np.array(fast_math.exp_shifted(mx.array([-np.inf, -1000.0, -88.0, 0.0, 89.0]), mx.array(0.0)))
    np.testing.assert_array_equal(edges[:3], 0.0)
    assert edges[3] == 1.0 and abs(edges[4] / np.exp(np.float64(np.float32(88.3))) - 1) < 1.5e-7  # saturates (softmax passes x <= 0)


@pytest.mark.parametrize("shape", [(1, 7), (3, 1, 4, 513), (2, 2, 8, 640)])
def test_softmax_matches_float64_and_masks_exactly(shape):
    rng = np.random.default_rng(sum(shape))
    scores = (rng.standard_normal(shape) * 12).astype(np.float32)
    scores[..., ::5] = -np.inf  # masked keys
    scores[..., 1] = 30.0  # a visible key per row, far above the rest
    got = np.array(fast_math.softmax(mx.array(scores)))
    e = np.exp(scores.astype(np.float64) - scores.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    mlx_own = np.array(mx.softmax(mx.array(scores), axis=-1, precise=True))
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-6
    assert np.abs(got - want).max() <= np.abs(mlx_own - want).max()  # no worse than MLX's exp
    assert (got[..., ::5] == 0.0).all()
    assert np.abs(got.sum(-1) - 1).max() < 1e-6


def test_log_softmax_matches_float64():
    logits = (np.random.default_rng(5).standard_normal((2, 3, 70_000)) * 8).astype(np.float32)
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    want = x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))
    got = np.array(fast_math.log_softmax(mx.array(logits)))
    mlx_own = np.array(mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True))
    # float32 rounding of values near -50 (ulp 4e-6), no worse than MLX's logsumexp
    assert got.dtype == np.float32 and np.abs(got - want).max() <= np.abs(mlx_own - want).max() + 1e-6


def test_softmax_of_bf16_scores_is_float32():
    scores = mx.random.normal((2, 300), key=mx.random.key(1)).astype(mx.bfloat16)
    got = fast_math.softmax(scores)
    assert got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(mx.softmax(scores.astype(mx.float32), axis=-1)), atol=1e-6)


def test_tanh_and_softcap():
    xs = np.linspace(-20, 20, 400_001, dtype=np.float32)
    got = np.array(fast_math.tanh(mx.array(xs)))
    assert np.abs(got - np.tanh(xs.astype(np.float64))).max() < 5e-7
    logits = mx.array((np.random.default_rng(0).standard_normal((3, 1000)) * 60).astype(np.float32))
    want = 30.0 * np.tanh(np.array(logits).astype(np.float64) / 30.0)
    assert np.abs(np.array(softcap(logits, 30.0)) - want).max() < 3e-5
    assert fast_math.tanh(mx.ones((4,), dtype=mx.bfloat16)).dtype == mx.bfloat16


def test_gelu_gated_matches_the_reference_formula():
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal((64, 300)) * 4).astype(np.float32)
    up = rng.standard_normal((64, 300)).astype(np.float32)
    g = gate.astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * up
    got = np.array(gelu_gated(mx.array(up), mx.array(gate)))
    # tanh's 4e-7 absolute error, scaled by x/2 * up, plus float32 rounding
    assert (np.abs(got - want) <= 2e-7 * np.abs(g * up) + 3e-7 * (1 + np.abs(want))).all()
    # torch's bf16 GELU: computed in float32, rounded once, then the product in bf16
    bf = gelu_gated(mx.array(up).astype(mx.bfloat16), mx.array(gate).astype(mx.bfloat16))
    assert bf.dtype == mx.bfloat16
    # a float32 up with bf16 gate promotes as MLX's product does (Gemma 4's per-layer inputs)
    assert gelu_gated(mx.array(up), mx.array(gate).astype(mx.bfloat16)).dtype == mx.float32


@pytest.mark.parametrize("offset", [0, 1, 511, 4097])
@pytest.mark.parametrize("length", [1, 37])
def test_rope_tables_match_fast_rope(offset, length):
    D = 64
    x = mx.random.normal((2, 3, length, D), key=mx.random.key(offset + length))
    rope = RoPE(D, {"rope_type": "default", "rope_theta": 10000.0})
    want = mx.fast.rope(x, D, traditional=False, base=10000.0, scale=1.0, offset=offset)
    # both round float32 angles: equal up to ~ulp(position) per unit of |x|
    assert float(mx.abs(rope(x, offset) - want).max()) < 4e-7 * (offset + length) + 1e-6


def test_rope_tables_are_shared_per_positions_and_proportional_pairs_stay():
    rope = RoPE(32, {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
    x = mx.random.normal((1, 2, 5, 32), key=mx.random.key(0))
    first = rope.tables(10, 5)
    assert rope.tables(10, 5)[0] is first[0]  # the next layer of this kind reuses them
    assert rope.tables(11, 5)[0] is not first[0]
    out = rope(x, 10)
    # 4 of 16 pairs rotate; the others (dims 4..15 and 20..31) pass through unchanged
    np.testing.assert_array_equal(np.array(out[..., 4:16]), np.array(x[..., 4:16]))
    np.testing.assert_array_equal(np.array(out[..., 20:]), np.array(x[..., 20:]))
    want = mx.fast.rope(x, 32, traditional=False, base=None, scale=1.0, offset=10, freqs=rope._periods)
    assert float(mx.abs(out - want).max()) < 1e-5


@pytest.mark.parametrize("mask_kind", [None, "causal", "causal, cached", "window", "blocks"])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (2, 2)])
@pytest.mark.parametrize("rows_per_block", [None, 1, 4])
@pytest.mark.parametrize("prefill_kernels", [False, True], ids=["blocks", "kernels"])
def test_attend_on_the_cpu_equals_mlx_fused_attention(mask_kind, heads, rows_per_block, prefill_kernels, monkeypatch):
    """Both ways the CPU plan attends a prompt: the extension's prefill kernel where it takes the read,
    and the query blocks of ``fast_math`` (what runs without the extension, or for a mask it does not take)."""
    if prefill_kernels and not backend.for_cpu().prefill:
        pytest.skip("the prefill kernels are not built or switched off")
    Hq, Hkv = heads
    B, L, D = 2, 13, 16
    T = {"causal": L, "causal, cached": L + 6}.get(mask_kind, 20)
    if rows_per_block:  # queries in blocks of this many rows (the last one shorter)
        monkeypatch.setattr(attention, "BLOCK_SCORES", rows_per_block * B * Hq * T)
    keys = mx.random.key(Hq * 10 + Hkv)
    q, k, v = (mx.random.normal(s, key=kk) for s, kk in zip([(B, Hq, L, D), (B, Hkv, T, D), (B, Hkv, T, D)], mx.random.split(keys, 3)))
    qpos, kpos = mx.arange(T - L, T)[:, None], mx.arange(T)[None]
    mask = {
        None: None,
        "causal": "causal",
        "causal, cached": "causal",
        "window": (kpos <= qpos) & (kpos > qpos - 4),
        "blocks": mx.broadcast_to(((kpos <= qpos) | (kpos < 3))[None, None], (B, 1, L, T)),
    }[mask_kind]
    with backend.using(backend.Backend(True, prefill=prefill_kernels)):
        got = attend(q, k, v, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert got.shape == want.shape and float(mx.abs(got - want).max()) < 2e-6


def test_switched_off_uses_mlx_ops():
    with backend.using(backend.MLX):
        assert not fast_math.active()
        scores = mx.random.normal((3, 50), key=mx.random.key(2))
        assert mx.array_equal(fast_math.softmax(scores), mx.softmax(scores, axis=-1)).item()
        assert mx.array_equal(fast_math.tanh(scores), mx.tanh(scores)).item()
