"""The sampler's filters and random state: equal to mlx-lm's filters, no shared state between requests.

mlx-lm's ``apply_top_k`` raised while being traced for ``top_k >= V`` and left MLX's global random
state a placeholder, so every later seedless request failed (issue 27, finding 2). Our filters are
checked equal to mlx-lm's where those accept the options, ``top_k >= V`` keeps every token, and a
sampler never reads or writes the global state.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")

import models  # noqa: E402,F401  (the project before mlx_lm's own imports)
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p  # noqa: E402

from models.generation.generate import SamplingOptions, TokenSampler, filter_logprobs  # noqa: E402
from tests import hf_tiny  # noqa: E402


@pytest.mark.parametrize("options", [
    dict(top_p=0.9), dict(top_p=0.3), dict(min_p=0.05), dict(min_p=1.0), dict(top_k=1), dict(top_k=37),
    dict(top_p=0.8, min_p=0.02, top_k=20),
])  # fmt: skip
def test_filters_equal_mlx_lm(options):
    logits = mx.array(np.random.default_rng(0).standard_normal((1, 300)).astype(np.float32) * 3)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    o = SamplingOptions(temp=1.0, **options)
    want = logprobs
    if 0 < o.top_p < 1:
        want = apply_top_p(want, o.top_p)
    if o.min_p:
        want = apply_min_p(want, o.min_p)
    if o.top_k:
        want = apply_top_k(want, o.top_k)
    assert np.array_equal(np.array(filter_logprobs(logprobs, o)), np.array(want))


def test_top_k_at_or_past_the_vocabulary_keeps_every_token_and_breaks_nothing():
    logits = mx.array(np.random.default_rng(1).standard_normal((1, 50)).astype(np.float32))
    for k in (50, 51, 300_000):
        assert np.array_equal(np.array(filter_logprobs(logits, SamplingOptions(temp=1.0, top_k=k))), np.array(logits))
        token = TokenSampler(SamplingOptions(temp=1.0, top_k=k, seed=3))(logits)
        assert 0 <= token.item() < 50
    assert mx.random.randint(0, 10, ()).item() in range(10)  # MLX's global random state still draws


def test_a_seedless_sampler_leaves_the_global_random_state_alone():
    mx.random.seed(11)
    before = np.array(mx.random.state[0])
    logits = mx.array(np.random.default_rng(2).standard_normal((1, 64)).astype(np.float32))
    draws = {TokenSampler(SamplingOptions(temp=1.0, top_p=0.9, top_k=10))(logits).item() for _ in range(20)}
    assert np.array_equal(np.array(mx.random.state[0]), before)
    assert len(draws) > 1  # each seedless sampler gets its own key


def test_a_top_k_past_the_vocabulary_in_process(tmp_path):
    """``Model.stream`` with ``top_k`` past the vocabulary samples as with no top-k, and the next
    seedless call is served."""
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T2"], tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    prompt = [2, 17, 99, 4, 56]

    def tokens(**options) -> list[int]:
        return [c.token for c in model.stream(prompt, max_tokens=6, sampling=SamplingOptions(temp=1.0, **options)) if c.token is not None]

    assert tokens(top_k=300_000, seed=5) == tokens(seed=5)
    assert len(tokens()) == 6


@pytest.mark.parametrize("options", [
    dict(top_k=1), dict(top_k=64), dict(top_k=64, top_p=0.95), dict(top_k=40, top_p=0.3), dict(top_k=20, min_p=0.05),
    dict(top_k=64, top_p=0.8, min_p=0.02), dict(top_k=299, top_p=0.999),
])  # fmt: skip
@pytest.mark.parametrize("V, scale", [(300, 3.0), (300, 0.2), (262_144, 4.0)])
@pytest.mark.parametrize("plan", ["cpu", "accelerator"])
def test_top_k_candidates_keep_what_the_filters_keep(options, V, scale, plan):
    """A draw among the top k sees the same tokens, with the same log-probabilities, as the filters
    over the whole vocabulary (peaked and flat distributions, a nucleus inside and past the top k),
    through the extension's top_k (the CPU plan's) and through MLX's argpartition (the accelerator's)."""
    from models.generation.generate import top_k_candidates
    from zoo_cpu import backend

    with backend.using(backend.for_cpu() if plan == "cpu" else backend.MLX):
        check_candidates(top_k_candidates, options, V, scale)


def check_candidates(top_k_candidates, options, V, scale):
    logits = mx.array(np.random.default_rng(V).standard_normal((1, V)).astype(np.float32) * scale)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    o = SamplingOptions(temp=1.0, **options)
    values, ids = top_k_candidates(logprobs, o)
    values, ids = np.array(values)[0], np.array(ids)[0]
    assert len(ids) == o.top_k and np.all(np.diff(values[np.isfinite(values)]) <= 0)
    full = np.array(filter_logprobs(logprobs, o))[0]
    kept = np.flatnonzero(np.isfinite(full))
    assert sorted(ids[np.isfinite(values)].tolist()) == kept.tolist()
    np.testing.assert_array_equal(np.sort(values[np.isfinite(values)]), np.sort(full[kept]))


@pytest.mark.parametrize("options", [
    dict(temp=0.8, top_k=6, top_p=0.9), dict(temp=0.8), dict(temp=1.0, top_p=0.6), dict(temp=1.3, min_p=0.1),
    dict(temp=0.7, top_p=0.9, min_p=0.02),
])  # fmt: skip
@pytest.mark.parametrize("plan", ["cpu", "accelerator"])
def test_draws_follow_the_filtered_distribution(options, plan):
    """Draws land on what the filters keep in proportion to the probabilities at the temperature
    (3,000 seeded draws, within 4 standard deviations): among the top k with top_k set; without it
    by the extension's floor and inverse CDF on the CPU plan, MLX's filters and Gumbel draw on the
    accelerator's."""
    from zoo_cpu import backend

    logits = mx.array(np.random.default_rng(8).standard_normal((1, 60)).astype(np.float32) * 2)
    o = SamplingOptions(seed=5, **options)
    with backend.using(backend.for_cpu() if plan == "cpu" else backend.MLX):
        sampler = TokenSampler(o)
        draws = np.array([sampler(logits).item() for _ in range(3000)])
    filtered = np.array(filter_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), o))[0] / o.temp
    p = np.exp(filtered - filtered.max())
    p /= p.sum()
    counts = np.bincount(draws, minlength=60) / len(draws)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p))
    np.testing.assert_array_less(np.abs(counts - p), 4 * np.sqrt(p * (1 - p) / len(draws)) + 1e-9)


@pytest.mark.parametrize("options, V, scale", [
    (options, V, scale)
    for options in (dict(top_p=0.9), dict(top_p=0.999), dict(min_p=0.05), dict(top_p=0.5, min_p=0.01))
    for V, scale in ((300, 4.0), (300, 0.3), (262_144, 4.0))
    if not (V > 1000 and options.get("top_p") == 0.999)
])  # fmt: skip
def test_the_extension_floor_keeps_what_the_filters_keep(options, V, scale):
    """Without top_k, the CPU plan's filtered log-probabilities (the extension's floor) keep the
    same words as the full filters, on peaked and flat rows. (Not over a flat 262,144-word row at
    top-p 0.999: there mlx-lm's float32 running sum of the sorted vocabulary is off by parts in ten
    thousand and keeps ~480 words fewer than float64 does; the floor's own check against float64
    is tests/test_sampling_kernels.py's.)"""
    from models.generation.generate import filtered_logprobs
    from zoo_cpu import backend

    logits = mx.array(np.random.default_rng(V).standard_normal((1, V)).astype(np.float32) * scale)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    o = SamplingOptions(temp=1.0, **options)
    with backend.using(backend.for_cpu()):
        got = np.array(filtered_logprobs(logprobs, o))
    np.testing.assert_array_equal(got, np.array(filter_logprobs(logprobs, o)))


@pytest.mark.parametrize("plan", ["cpu", "accelerator"])
def test_greedy_tokens_are_mlx_argmax(plan):
    """The greedy pick is MLX's argmax, the first of tied maxima included, over rows of any shape,
    under both plans."""
    from models.generation.generate import greedy_tokens
    from zoo_cpu import backend

    x = mx.array(np.round(np.random.default_rng(2).standard_normal((3, 5, 1000)).astype(np.float32)))
    logits = mx.array(np.random.default_rng(3).standard_normal((1, 262_144)).astype(np.float32))
    with backend.using(backend.for_cpu() if plan == "cpu" else backend.MLX):
        assert np.array_equal(np.array(greedy_tokens(x)), np.array(mx.argmax(x, axis=-1)))
        assert greedy_tokens(logits).item() == mx.argmax(logits, axis=-1).item()


@pytest.mark.parametrize("plan", ["cpu", "accelerator"])
def test_speculative_distributions_from_the_candidates_equal_the_full_filters(plan):
    """Speculative decoding's per-row distributions, read off the top k (or, without it, through the
    CPU plan's floor), are the full filters', under both plans."""
    from models.generation.speculative import distribution
    from zoo_cpu import backend

    logits = mx.array(np.random.default_rng(4).standard_normal((3, 1000)).astype(np.float32) * 2)
    with backend.using(backend.for_cpu() if plan == "cpu" else backend.MLX):
        for o in (SamplingOptions(temp=0.7, top_k=20, top_p=0.9), SamplingOptions(temp=1.3, top_k=64, min_p=0.05),
                  SamplingOptions(temp=0.9, top_p=0.8), SamplingOptions(temp=1.1, min_p=0.1)):
            want = mx.softmax(filter_logprobs(logits - mx.logsumexp(logits, axis=-1, keepdims=True), o) * (1.0 / o.temp), axis=-1)
            np.testing.assert_allclose(np.array(distribution(logits, o)), np.array(want), rtol=0, atol=1e-6)
