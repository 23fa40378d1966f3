"""The vocabulary-wide work of a denoising step (``vocabulary_step``) and the sampler, against
torch's softmax, ``Categorical`` entropy and argmax, on both of its paths (numpy on the CPU plan,
compiled MLX elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

from models.generation import diffusion
from models.generation.diffusion import MLXNoise, vocabulary_step

import mlx.core as mx  # noqa: E402  (after the project, which loads the BLAS first)

torch = pytest.importorskip("torch")


def reference(raw: np.ndarray, temperature: float, cap: float):
    logits = torch.as_tensor(raw)
    processed = cap * torch.tanh(logits / cap) / torch.tensor(temperature, dtype=torch.float32)
    dist = torch.distributions.Categorical(logits=processed)
    return processed.numpy(), torch.softmax(processed, -1).numpy(), dist.entropy().numpy(), processed.argmax(-1).numpy()


def mlx_path(raw, temperature, cap):
    cap_array = mx.array(cap, dtype=mx.float32)
    return diffusion._mlx_vocabulary_step(mx.array(raw), mx.array(np.float32(temperature)), cap_array, True)


@pytest.mark.parametrize("path", ["numpy", "mlx"])
@pytest.mark.parametrize("scale", [0.5, 40.0])  # flat and peaked (entropies near 0) distributions
def test_vocabulary_step_is_torch_softmax_entropy_argmax(path, scale):
    raw = (np.random.default_rng(0).standard_normal((2, 16, 3000)) * scale).astype(np.float32)
    got = vocabulary_step(mx.array(raw), 0.7, 30.0) if path == "numpy" else mlx_path(raw, 0.7, 30.0)
    want = reference(raw, 0.7, 30.0)
    processed, probs, entropies, argmax = (np.array(a) for a in got)
    np.testing.assert_allclose(processed, want[0], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(probs, want[1], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(entropies, want[2], rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(argmax, want[3])
    assert argmax.dtype == np.int32


def test_uncapped_logits_pass_through():
    raw = np.random.default_rng(1).standard_normal((1, 4, 50)).astype(np.float32)
    processed = np.array(vocabulary_step(mx.array(raw), 0.5)[0])
    np.testing.assert_array_equal(processed, raw / np.float32(0.5))


def test_without_the_processed_logits_the_rest_is_the_same():
    """The loop asks for the processed logits only where a bf16 table self-conditions on them."""
    raw = np.random.default_rng(2).standard_normal((1, 8, 300)).astype(np.float32)
    full = vocabulary_step(mx.array(raw), 0.7, 30.0)
    lean = vocabulary_step(mx.array(raw), 0.7, 30.0, keep_processed=False)
    assert lean[0] is None
    for a, b in zip(full[1:], lean[1:]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_sampler_follows_the_probabilities_and_never_draws_an_impossible_token():
    probs = np.zeros((1, 4000, 8), dtype=np.float32)
    probs[..., [1, 4, 7]] = [0.5, 0.3, 0.2]  # token 0 and the last-but-one are impossible
    noise = MLXNoise(3)
    drawn = np.concatenate([np.array(noise.sample(mx.array(probs)))[0] for _ in range(5)])
    counts = np.bincount(drawn, minlength=8) / drawn.size
    assert set(np.unique(drawn)) == {1, 4, 7}
    np.testing.assert_allclose(counts[[1, 4, 7]], [0.5, 0.3, 0.2], atol=0.02)
    again = np.array(MLXNoise(3).sample(mx.array(probs)))
    np.testing.assert_array_equal(again[0], drawn[:4000])  # a seed reproduces the draws


def test_sampler_over_several_blocks_follows_the_probabilities():
    # 1000 entries = 125 blocks of 8 (gcd with SAMPLE_BLOCK): the draw finds its block, then its token.
    probs = np.zeros((2, 3000, 1000), dtype=np.float32)
    probs[..., [0, 7, 8, 517, 999]] = [0.1, 0.2, 0.3, 0.15, 0.25]
    drawn = np.array(MLXNoise(5).sample(mx.array(probs))).ravel()
    counts = np.bincount(drawn, minlength=1000) / drawn.size
    assert set(np.unique(drawn)) == {0, 7, 8, 517, 999}
    np.testing.assert_allclose(counts[[0, 7, 8, 517, 999]], [0.1, 0.2, 0.3, 0.15, 0.25], atol=0.015)
