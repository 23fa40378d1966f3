"""The decode step compiled whole (``graphs.decode_step`` over ``cache.positioned``): every step's
logits equal the plain step's, token after token, through everything that changes a trace or a
cache's layout: a full layer's buffer growing past ``step`` positions, a sliding layer's buffer
compacting, masked and unmasked runs, KV sharing, MoE, quantized KV switching mid-generation,
trims (speculative rollback), batch rows, a replaced weight. Where it does not apply (ragged
batches, an empty cache, bidirectional encoders) the plain step runs, with the plain step's errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from zoo_cpu import switches  # noqa: E402
from cache import KVCache, QuantizedKVCache, RotatingKVCache, batch_caches, trim_cache  # noqa: E402
from cache.base import AttentionCache  # noqa: E402
from models.generation.generate import KVQuantization, generate_tokens  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_batch_generate import gemma3  # noqa: E402, F401  (the same tiny Gemma 3 fixture)

TOLERANCE = 1e-5  # float32; the compiled step sums the same products, masked rows add exact zeros


@pytest.fixture(scope="module", params=["T1", "T2", "T3", "E2B_like"])
def gemma4(request, tmp_path_factory):
    return hf_tiny.load_causal_lm(request.param, tmp_path_factory.mktemp(request.param))


class Commits:
    """Counts compiled steps (each commits every owning cache once)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = AttentionCache.commit_decode

        def counted(cache, keys, values):
            self.count += 1
            return original(cache, keys, values)

        monkeypatch.setattr(AttentionCache, "commit_decode", counted)


def prompt(model, length: int, seed: int = 0, rows: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(3, model.vocab_size, (rows, length)))


def step_logits(model, ids: mx.array, steps: int, compiled: bool, edit=None) -> list[np.ndarray]:
    """Prefill ``ids``, then ``steps`` greedy decode steps; every step's logits. ``edit(cache, i)``
    may change the cache between steps (trims)."""
    with switches.override(GEMMA_ZOO_COMPILE_STEP=compiled):
        cache = model.make_cache()
        logits = model.logits(ids, cache)[:, -1]
        out = []
        for i in range(steps):
            token = mx.argmax(logits, axis=-1)[:, None]
            logits = model._forward(token, cache, last_only=True)[:, -1]
            out.append(np.array(logits))
            if edit is not None:
                edit(cache, i)
        return out


def assert_steps_equal(plain, compiled):
    assert len(plain) == len(compiled)
    for i, (a, b) in enumerate(zip(plain, compiled)):
        np.testing.assert_allclose(b, a, rtol=0, atol=TOLERANCE, err_msg=f"step {i}")
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"step {i}: greedy tokens differ"


def test_gemma4_steps_equal_past_growth_and_compaction(gemma4, monkeypatch):
    # 300 steps: the full layers' buffers grow past 256 rows, the sliding layers' buffers (window
    # 4 or 8, slack 16, step 256) compact, runs are masked while a window fills and unmasked after.
    commits = Commits(monkeypatch)
    ids = prompt(gemma4, 5)
    plain = step_logits(gemma4, ids, 300, compiled=False)
    assert commits.count == 0
    compiled = step_logits(gemma4, ids, 300, compiled=True)
    owning = sum(1 for c in gemma4.make_cache() if isinstance(c, AttentionCache))
    assert commits.count == 300 * owning  # every step went through the compiled path
    assert_steps_equal(plain, compiled)


def test_gemma3_steps_equal(gemma3):
    ids = prompt(gemma3, 7)
    assert_steps_equal(step_logits(gemma3, ids, 280, False), step_logits(gemma3, ids, 280, True))


def test_batch_rows_at_one_offset(gemma3):
    ids = prompt(gemma3, 6, rows=3)
    assert_steps_equal(step_logits(gemma3, ids, 20, False), step_logits(gemma3, ids, 20, True))


def test_trims_between_steps(gemma4):
    def rollback(cache, i):
        if i % 5 == 4:  # speculative rejection: drop the newest positions and go on
            assert trim_cache(cache, 2)

    ids = prompt(gemma4, 9)
    assert_steps_equal(step_logits(gemma4, ids, 40, False, rollback), step_logits(gemma4, ids, 40, True, rollback))


def test_quantized_kv_switching_mid_generation(gemma4, monkeypatch):
    commits = Commits(monkeypatch)
    prompt_ids = [2] + np.random.default_rng(1).integers(3, gemma4.vocab_size, 8).tolist()
    kv = KVQuantization(8, 32, start=20)
    runs = {}
    for compiled in (False, True):
        with switches.override(GEMMA_ZOO_COMPILE_STEP=compiled):
            cache = gemma4.make_cache()
            runs[compiled] = list(generate_tokens(gemma4._forward, prompt_ids, cache, max_tokens=40, kv_quantization=kv))
            assert any(isinstance(c, QuantizedKVCache) for c in cache)
    assert commits.count > 0
    assert runs[True] == runs[False]


def test_replaced_weight_is_traced_anew(gemma3):
    ids = prompt(gemma3, 5)
    with switches.override(GEMMA_ZOO_COMPILE_STEP=True):
        cache = gemma3.make_cache()
        gemma3.logits(ids, cache)
        token = mx.array([[7]])
        snapshot = [c.state for c in cache]
        before = np.array(gemma3._forward(token, cache))
        norm = gemma3.graph.norm
        original = norm.weight
        try:
            norm.weight = original + 0.5
            restored = [type(c).from_state(s) for c, s in zip(cache, snapshot)]
            after = np.array(gemma3._forward(token, restored))
            with switches.override(GEMMA_ZOO_COMPILE_STEP=False):
                restored = [type(c).from_state(s) for c, s in zip(cache, snapshot)]
                want = np.array(gemma3._forward(token, restored))
        finally:
            norm.weight = original
    assert np.abs(after - before).max() > 1e-3
    np.testing.assert_allclose(after, want, rtol=0, atol=TOLERANCE)


def test_not_applied_where_it_cannot_stand_in(gemma3, monkeypatch):
    commits = Commits(monkeypatch)
    token = mx.array([[5]])
    assert gemma3.decode_step(token, gemma3.make_cache()) is None  # nothing stored yet
    rows = []
    for length in (3, 6):
        cache = gemma3.make_cache()
        gemma3.logits(prompt(gemma3, length), cache)
        rows.append(cache)
    batch = batch_caches(rows)
    assert gemma3.decode_step(mx.array([[5], [6]]), batch) is None  # ragged rows: the plain step
    cache = gemma3.make_cache()
    gemma3.logits(prompt(gemma3, 4), cache)
    assert gemma3.decode_step(mx.array([[5, 6]]), cache) is None  # more than one position
    assert commits.count == 0


def test_bidirectional_encoder_keeps_its_error(tmp_path):
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T4"], tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    cache = model.make_cache()
    model.logits(prompt(model, 6), cache)
    for compiled in (False, True):
        with switches.override(GEMMA_ZOO_COMPILE_STEP=compiled):
            with pytest.raises(ValueError, match="no incremental"):
                model._forward(mx.array([[5]]), cache)


def test_cache_counters_after_compiled_steps(gemma4):
    ids = prompt(gemma4, 5)
    with switches.override(GEMMA_ZOO_COMPILE_STEP=True):
        cache = gemma4.make_cache()
        gemma4.logits(ids, cache)
        for i in range(12):
            gemma4._forward(mx.array([[3 + i]]), cache)
    with switches.override(GEMMA_ZOO_COMPILE_STEP=False):
        plain = gemma4.make_cache()
        gemma4.logits(ids, plain)
        for i in range(12):
            gemma4._forward(mx.array([[3 + i]]), plain)
    for a, b in zip(cache, plain):
        assert a.offset == b.offset == 17
        if isinstance(a, (KVCache, RotatingKVCache)):
            assert a.stored == b.stored
            ka, va = a.temporal()
            kb, vb = b.temporal()
            np.testing.assert_allclose(np.array(ka), np.array(kb), rtol=0, atol=1e-6)
            np.testing.assert_allclose(np.array(va), np.array(vb), rtol=0, atol=1e-6)


def test_stand_in_makes_only_decode_reads():
    from cache import CacheSpec
    from cache.codecs import Dense
    from cache.positioned import PositionedCache

    planes = (mx.zeros((1, 1, 4, 8)),)
    stand_in = PositionedCache(CacheSpec("full"), Dense(), planes, planes, mx.array(2), mx.array(2), mx.array(0), 4, True)
    x = mx.zeros((1, 1, 1, 8))
    for read in ("window", "vision_prefill", "encoder", "bidirectional", "canvas", "draft"):
        with pytest.raises(ValueError, match=f"^{read}: a compiled decode step makes only decode reads"):
            getattr(stand_in, read)(x, x, x, scale=1.0)
    with pytest.raises(ValueError, match="exactly L=1"):
        stand_in.decode(mx.zeros((1, 1, 2, 8)), mx.zeros((1, 1, 2, 8)), mx.zeros((1, 1, 2, 8)), scale=1.0)
    out = stand_in.decode(x + 1, x + 1, x + 2, scale=1.0)  # rows 0-2 (zeros, then the new row) attended
    assert out.shape == (1, 1, 1, 8) and float(stand_in.keys[0][0, 0, 2, 0]) == 1.0
