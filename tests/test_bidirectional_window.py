"""Which keys a bidirectional encoder's sliding layer attends, position by position, against transformers.

Gemma 3 (``use_bidirectional_attention: true``, EmbeddingGemma) and Gemma 4
(``use_bidirectional_attention="all"``) both halve the configured window to ``W // 2 + 1``, but bound
it differently: transformers' ``modeling_gemma3._bidirectional_window_overlay`` keeps
``|q - k| < window``, while Gemma 4's sliding mask, built by ``masking_utils``'
``create_bidirectional_sliding_window_mask`` for a non-causal config, keeps
``|q - k| <= window`` (``sliding_window_bidirectional_overlay``). So the two differ by one position
each way. Here transformers' eager attention probabilities (zero exactly where it masks) are set
against the masks our caches build during the same forward.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cache.masks  # noqa: E402
from graphs.gemma3_text import Gemma3TextModel  # noqa: E402
from graphs.gemma3_text_config import FULL, SLIDING, Gemma3TextConfig  # noqa: E402
from models.registry import load_gemma3_text_weights  # noqa: E402
from tests import hf_tiny  # noqa: E402

L = 16  # past the halved window (5) both ways


def reference_visible(hf_model, ids: np.ndarray) -> list[np.ndarray]:
    """Per layer, ``[L, L]`` booleans: the keys transformers' eager attention gives weight."""
    hf_model.set_attn_implementation("eager")
    with torch.no_grad():
        out = hf_model(torch.tensor(ids), output_attentions=True)
    return [(a[0, 0] > 0).numpy() for a in out.attentions]


def recorded_masks(monkeypatch) -> list:
    """The masks ``cache.masks.bidirectional`` returns from now on, in call order (one per layer)."""
    seen = []
    real = cache.masks.bidirectional

    def record(*args):
        mask = real(*args)
        seen.append(mask)
        return mask

    monkeypatch.setattr(cache.masks, "bidirectional", record)
    return seen


def as_visible(mask) -> np.ndarray:
    return np.ones((L, L), dtype=bool) if mask is None else np.array(mx.broadcast_to(mask, (L, L)))


def expected_band(window: int, inclusive: bool) -> np.ndarray:
    d = np.abs(np.arange(L)[:, None] - np.arange(L)[None, :])
    return d <= window if inclusive else d < window


def test_gemma4_all_sliding_window_is_inclusive(tmp_path, monkeypatch):
    text = dict(hf_tiny.TEXT_CONFIGS["T4"], sliding_window=8)
    hf_model = hf_tiny.save_causal_lm(text, tmp_path)
    assert hf_model.config.sliding_window == 5
    model = hf_tiny.load_graph(tmp_path)
    ids = np.random.default_rng(0).integers(3, 256, (1, L))
    theirs = reference_visible(hf_model, ids)
    seen = recorded_masks(monkeypatch)
    mx.eval(model(mx.array(ids)))
    assert len(seen) == len(theirs) == 2
    assert np.array_equal(theirs[0], expected_band(5, inclusive=True))  # sliding: |q - k| <= 5
    assert theirs[1].all()
    for ours, reference in zip(seen, theirs):
        assert np.array_equal(as_visible(ours), reference)


def test_gemma3_encoder_sliding_window_is_exclusive(monkeypatch):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, layer_types=[SLIDING, FULL],
        max_position_embeddings=64, use_bidirectional_attention=True, pad_token_id=0, bos_token_id=2, eos_token_id=1,
    )  # fmt: skip
    hf_model = transformers.Gemma3TextModel(config).eval()
    assert config.sliding_window == 5
    model = Gemma3TextModel(Gemma3TextConfig.from_dict(config.to_dict()))
    load_gemma3_text_weights(model, {k: mx.array(v.numpy()) for k, v in hf_model.state_dict().items()})
    ids = np.random.default_rng(0).integers(3, 64, (1, L))
    theirs = reference_visible(hf_model, ids)
    seen = recorded_masks(monkeypatch)
    mx.eval(model.encode(mx.array(ids), [L]))
    assert len(seen) == len(theirs) == 2
    assert np.array_equal(theirs[0], expected_band(5, inclusive=False))  # sliding: |q - k| < 5
    assert theirs[1].all()
    for ours, reference in zip(seen, theirs):
        assert np.array_equal(as_visible(ours), reference)
