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
