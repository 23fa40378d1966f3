"""Cached generation equals the no-cache forward, under teacher forcing.

The graph appends ids through the layer caches (``window`` for chunks, ``decode`` for single
tokens); every position's logits must equal those of one no-cache forward over the whole
sequence: prefill chunks of 1, 7, = W and > W, prompts shorter and longer than the window, and
300+ decode steps (the sliding caches compact many times; KV-shared layers read their donors).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from cache import KVCache, RotatingKVCache, SharedView  # noqa: E402
from tests import hf_tiny  # noqa: E402

# fp32 noise between two different kernels, not a cache tolerance: on the CPU a decode step (one
# query) runs MLX's fused attention, whose exp is within 4e-6, and a chunk runs zoo_cpu.fast_math's
# softmax (within 1e-7), so 320 cached decodes drift from the uncached forward by up to ~1.2e-4 on
# logits of magnitude ~6. A cache bug (a wrong position, window or mask) shows at 1e-2 and above.
TOL = 2e-4
CONFIGS = {
    "T1": hf_tiny.TEXT_CONFIGS["T1"],
    "T2": hf_tiny.TEXT_CONFIGS["T2"],
    "T3": hf_tiny.TEXT_CONFIGS["T3"],
    "T2_window16": dict(hf_tiny.TEXT_CONFIGS["T2"], sliding_window=16),
    "E2B_like": hf_tiny.TEXT_CONFIGS["E2B_like"],
}


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Our graph for each config, loaded from a checkpoint transformers saved (realistic weights)."""
    loaded = {}
    for name, config in CONFIGS.items():
        directory = tmp_path_factory.mktemp(name)
        hf_tiny.save_causal_lm(config, directory)
        loaded[name] = hf_tiny.load_graph(directory)
    return loaded


def cached_logits(model, ids: mx.array, prompt_len: int, chunk: int) -> mx.array:
    """Prefill ``ids[:, :prompt_len]`` in chunks of ``chunk``, then decode the rest one token at a time."""
    cache = model.make_cache()
    pieces = []
    for start in range(0, prompt_len, chunk):
        pieces.append(model(ids[:, start : min(start + chunk, prompt_len)], cache=cache))
    for position in range(prompt_len, ids.shape[1]):
        pieces.append(model(ids[:, position : position + 1], cache=cache))
        mx.eval(pieces[-1])
    assert cache[0].offset == ids.shape[1]
    return mx.concatenate(pieces, axis=1)


def worst_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max())


def random_ids(length: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 256, (2, length)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_chunks_and_decode(graphs, name):
    model = graphs[name]
    W = model.config.sliding_window
    for prompt_len in (W - 1, 3 * W + 2):
        ids = random_ids(prompt_len + 24, seed=prompt_len)
        reference = model(ids)
        for chunk in (1, 7, W, W + 3):
            got = cached_logits(model, ids, prompt_len, chunk)
            assert worst_diff(got, reference) <= TOL, (prompt_len, chunk)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_long_decode(graphs, name):
    model = graphs[name]
    ids = random_ids(13 + 320, seed=7)
    assert worst_diff(cached_logits(model, ids, 13, 7), model(ids)) <= TOL


def test_one_prefill_longer_than_everything_then_decode(graphs):
    """A single prefill far past the window (the sliding cache keeps only its tail), then decode."""
    model = graphs["T2"]
    ids = random_ids(100 + 40, seed=3)
    assert worst_diff(cached_logits(model, ids, 100, 100), model(ids)) <= TOL


def test_make_cache_layout(graphs):
    """T2: sliding and full layers own their storage; the KV-shared layers 2 and 3 view layers 0 and 1."""
    model = graphs["T2"]
    caches = model.make_cache()
    assert isinstance(caches[0], RotatingKVCache) and caches[0].sliding_window == model.config.sliding_window
    assert isinstance(caches[1], KVCache)
    assert isinstance(caches[2], SharedView) and caches[2].donor is caches[0]
    assert isinstance(caches[3], SharedView) and caches[3].donor is caches[1]


def test_cache_of_wrong_length_is_refused(graphs):
    model = graphs["T1"]
    with pytest.raises(ValueError, match="cache has 3 entries for 4 layers"):
        model(random_ids(3, seed=0), cache=model.make_cache()[:3])
