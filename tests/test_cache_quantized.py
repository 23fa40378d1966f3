"""Quantized KV caches: switching at a start offset, KV-shared views on a quantized donor, memory,
and bad settings. (The random read programs against the dense reference are in test_cache_reads.)"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    cache_from_state,
    quantize_caches,
)
from tests.test_cache_reads import Driver


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 64)])
def test_switch_to_quantized_storage_mid_generation(window, bits, group_size):
    """Full precision before the start offset, quantized after; the positions held at the switch are
    quantized once, and every read before and after matches the reference."""
    dim = 64
    run = Driver(window, slack=3, step=4, B=3, Hkv=2, groups=2, Dv=dim, scale=dim**-0.5, seed=bits, D=dim)
    run.write_read("window", 11)
    for _ in range(5):
        run.write_read("decode", 1)
    caches = [run.cache, run.cache.shared_view()]
    quantize_caches(caches, bits=bits, group_size=group_size, start=100)
    assert caches[0] is run.cache, "below the start offset nothing changes"
    quantize_caches(caches, bits=bits, group_size=group_size, start=16)
    quantized, view = caches
    assert quantized.codec.quantized and quantized.kind.endswith("quantized")
    assert view.donor is quantized and quantized.offset == 16
    run.cache, run.bits, run.group_size = quantized, bits, group_size
    ref = run.ref
    ref.keys, ref.values = (np.array(run.stored(mx.array(x.astype(np.float32)))).astype(np.float64) for x in (ref.keys, ref.values))
    for _ in range(9):  # write_read also checks a shared view of the quantized donor
        run.write_read("decode", 1)
    run.write_read("window", 7)
    run.trim(2)
    run.write_read("decode", 1)


def test_shared_view_of_a_quantized_donor_in_a_model_cache_list():
    donor = RotatingQuantizedKVCache(4, bits=8, group_size=32)
    view = donor.shared_view()
    x = mx.random.normal((1, 2, 5, 32))
    kv = x[:, :1]
    out = donor.window(x, kv, kv, scale=0.2)
    assert mx.allclose(view.window(x, scale=0.2), out).item()
    assert view.kind == "shared:sliding-quantized"


def test_state_round_trip_keeps_quantized_planes_exactly():
    cache = QuantizedKVCache(bits=4, group_size=32, step=8)
    rng = np.random.default_rng(0)
    for L in (5, 1, 1, 12):
        k = mx.array(rng.standard_normal((1, 1, L, 32)).astype(np.float32))
        cache.window(k, k, k, scale=0.2) if L > 1 else cache.decode(k, k, k, scale=0.2)
    state = cache.state
    assert state["bits"] == 4 and state["group_size"] == 32 and len(state["keys"]) == 3
    restored = cache_from_state(state)
    q = mx.array(rng.standard_normal((1, 1, 1, 32)).astype(np.float32))
    assert mx.array_equal(cache.decode(q, q, q, scale=0.2), restored.decode(q, q, q, scale=0.2)).item()
    with pytest.raises(ValueError, match="kind 'full-quantized', expected 'full'"):
        KVCache.from_state(state)


def _peak_decode_memory(cache, T, dim=128, Hkv=2, Hq=8):
    mx.random.seed(0)
    k = mx.random.normal((1, Hkv, T, dim))
    cache.window(mx.random.normal((1, Hq, T, dim)), k, k, scale=dim**-0.5)
    mx.eval(cache.keys, cache.values)
    del k
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    for _ in range(8):
        x = mx.random.normal((1, Hkv, 1, dim))
        mx.eval(cache.decode(mx.random.normal((1, Hq, 1, dim)), x, x, scale=dim**-0.5))
    return mx.get_peak_memory(), cache.nbytes


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_decode_peaks_below_full_precision(bits):
    """Decoding over 4,096 stored positions: the quantized cache's peak memory (storage included)
    stays below the full-precision cache's: a decode read never dequantizes the history."""
    full_peak, full_bytes = _peak_decode_memory(KVCache(), 4096)
    quant_peak, quant_bytes = _peak_decode_memory(QuantizedKVCache(bits=bits, group_size=64), 4096)
    assert quant_bytes < full_bytes / 2
    assert quant_peak <= full_peak, (quant_peak, full_peak)


def test_bytes_per_token_reflects_quantization():
    full, quant = KVCache(), QuantizedKVCache(bits=4, group_size=64)
    x = mx.zeros((1, 2, 3, 128))
    full.window(x, x, x, scale=1.0)
    quant.window(x, x, x, scale=1.0)
    assert full.bytes_per_token == 2 * 2 * 128 * 4
    # 4 bits per value plus one fp32 scale and bias per 64 values, for keys and values
    assert quant.bytes_per_token == 2 * 2 * (128 // 2 + 2 * 2 * 4)


def test_bad_quantization_settings_are_named():
    with pytest.raises(ValueError, match="kv_bits must be one of"):
        QuantizedKVCache(bits=7)
    with pytest.raises(ValueError, match="kv_group_size must be one of"):
        RotatingQuantizedKVCache(8, group_size=48)
    cache = QuantizedKVCache(bits=8, group_size=64)
    x = mx.zeros((1, 1, 2, 32))
    with pytest.raises(ValueError, match="head dim 32 is not a multiple of kv_group_size 64"):
        cache.window(x, x, x, scale=1.0)
    assert cache.offset == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="already quantized"):
        cache.to_quantized(4, 64)
    with pytest.raises(ValueError, match="head dim 32 is not a multiple of kv_group_size 64"):
        rotating = RotatingKVCache(4)
        rotating.window(x, x, x, scale=1.0)
        rotating.to_quantized(8, 64)


@pytest.mark.parametrize("plan", ["cpu", "accelerator"])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_chunk_of_queries_over_quantized_planes_equals_float64_attention(plan, bits, monkeypatch):
    """A prefill chunk's read over quantized planes equals float64 attention over what the codes
    stand for: on the CPU plan the run dequantized and read by the float prefill kernel (MLX's CPU
    ``quantized_matmul`` is never called: it prefilled an 8k prompt at 32 tok/s), on the
    accelerator plan the two quantized products."""
    from cache.codecs import Quantized
    from zoo_cpu import backend

    rng = np.random.default_rng(bits)
    L, T, D = 16, 40, 64
    q = rng.standard_normal((1, 8, L, D)).astype(np.float32)
    codec = Quantized(bits, 32)
    keys, values = (codec.pack(mx.array(rng.standard_normal((1, 2, T, D)).astype(np.float32))) for _ in range(2))
    k, v = (np.array(codec.unpack(p)).astype(np.float64).repeat(4, axis=1) for p in (keys, values))
    scores = np.einsum("bhld,bhtd->bhlt", q.astype(np.float64), k) * 0.125
    scores[..., np.arange(T)[None, :] > np.arange(T - L, T)[:, None]] = -np.inf  # "causal": the last query sees every key
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhlt,bhtd->bhld", weights / weights.sum(-1, keepdims=True), v)
    if plan == "cpu":
        def refused(*args, **kwargs):
            raise AssertionError("the CPU plan's chunk read called mx.quantized_matmul")

        monkeypatch.setattr(mx, "quantized_matmul", refused)
    with backend.using(backend.for_cpu() if plan == "cpu" else backend.MLX):
        got = codec.attend(mx.array(q), keys, values, 0.125, "causal")
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-5)
