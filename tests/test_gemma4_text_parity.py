"""Gemma 4 text graph against transformers 5.24 on tiny random checkpoints that transformers saved.

Each case writes a checkpoint with ``save_pretrained``, loads its config.json and safetensors into
our graph through the key mapping, and compares logits with the transformers model that wrote it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests import hf_tiny  # noqa: E402

TOL = 1e-4
LONG_TOL = 2e-4
SEQ = 20


def random_ids(batch: int, length: int, high: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, (batch, length))


def reference_logits(hf_model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor(ids)).logits.float().numpy()


def our_logits(model, ids: np.ndarray) -> np.ndarray:
    return np.array(model(mx.array(ids)).astype(mx.float32))


def worst_diff(hf_model, model, ids) -> float:
    return float(np.abs(reference_logits(hf_model, ids) - our_logits(model, ids)).max())


CASES = ["T1", "T2", "T3", "T2_wide_window", "T3_no_k_eq_v", "T1_bias_untied", "E2B_like"]


@pytest.mark.parametrize("name", CASES)
def test_logits_match_transformers(tmp_path, name):
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    assert worst_diff(hf_model, model, random_ids(2, SEQ, 256)) <= TOL


@pytest.mark.parametrize("name", CASES)
def test_long_sequence_against_float64(tmp_path, name):
    """Over 160 positions, against the reference computed in float64.

    Attention with scale 1.0 on unit-RMS q/k is sharply peaked, so fp32 rounding grows with the
    attended span and the depth: here the reference's own fp32 logits drift up to 1.2e-4 from
    float64, and ours up to 1.1e-4 (bit-identical to mlx-lm's gemma4_text on the dense checkpoints).
    """
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    ids = random_ids(2, 160, 256, seed=1)
    assert np.abs(our_logits(model, ids) - hf_tiny.float64_logits(hf_model, ids)).max() <= LONG_TOL


def test_global_kv_heads_ignored_without_k_eq_v(tmp_path):
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T3_no_k_eq_v"], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    full = model.layers[3].self_attn
    assert (full.num_kv_heads, full.head_dim) == (2, 64)
    assert "v_proj" in full


def test_sharded_checkpoint(tmp_path):
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T2"], tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = hf_tiny.load_graph(tmp_path)
    assert worst_diff(hf_model, model, random_ids(2, SEQ, 256)) <= TOL


@pytest.mark.parametrize("name", ["T1", "T2"])
def test_bf16_checkpoint(tmp_path, name):
    """A bf16 checkpoint loads and computes in bf16, as close to float64 as transformers' own bf16
    run (x2); upcast to fp32 it matches transformers' fp32 load at the fp32 tolerance. (No MoE
    case: MLX's CPU gather_mm is float32-only.)"""
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], tmp_path, dtype=torch.bfloat16)
    hf_bf16 = hf_tiny.reload_causal_lm(tmp_path, torch.bfloat16)
    hf_fp32 = hf_tiny.reload_causal_lm(tmp_path, torch.float32)
    model = hf_tiny.load_graph(tmp_path)
    assert model.embed_tokens.weight.dtype == mx.bfloat16
    ids = random_ids(2, SEQ, 256)
    logits = model(mx.array(ids))
    assert logits.dtype == mx.bfloat16
    exact = hf_tiny.float64_logits(hf_fp32, ids)
    reference_error = np.abs(reference_logits(hf_bf16, ids) - exact).max()
    assert np.abs(np.array(logits.astype(mx.float32)) - exact).max() <= 2 * reference_error

    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    assert worst_diff(hf_fp32, model, ids) <= TOL


def test_conditional_generation_checkpoint_loads_as_text_model(tmp_path):
    """T5: a ``Gemma4ForConditionalGeneration`` checkpoint (vision tower included) loads as a text model."""
    hf_model = hf_tiny.save_conditional_generation(tmp_path)
    assert hf_tiny.read_config(tmp_path)["model_type"] == "gemma4"
    model = hf_tiny.load_graph(tmp_path)
    ids = random_ids(2, SEQ, hf_tiny.T5_TOKENS["boi_token_id"])  # text tokens only
    assert worst_diff(hf_model, model, ids) <= TOL


def test_bidirectional_all_short_sequence(tmp_path):
    """T4 (``use_bidirectional_attention="all"``) over a sequence the halved window does not bind."""
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T4"], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    assert model.config.sliding_window == 3
    assert worst_diff(hf_model, model, random_ids(2, 4, 256)) <= TOL


def test_bidirectional_all_long_sequence(tmp_path):
    """T4 over 20 positions: the symmetric window |q - k| <= 3 binds on the sliding layer."""
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T4"], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    assert worst_diff(hf_model, model, random_ids(2, 20, 256)) <= TOL


def test_bidirectional_all_has_no_incremental_generation(tmp_path):
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T4"], tmp_path)
    model = hf_tiny.load_graph(tmp_path)
    cache = model.make_cache()
    model(mx.array(random_ids(1, 5, 256)), cache=cache)
    with pytest.raises(ValueError, match="no incremental"):
        model(mx.array(random_ids(1, 1, 256)), cache=cache)


def test_embedding_scales_round_in_weight_dtype(tmp_path):
    """bf16 rounds sqrt(H) and sqrt(P) before the multiply (sqrt(48) -> 6.9375, sqrt(12) -> 3.46875)."""
    config = dict(hf_tiny.TEXT_CONFIGS["T2"], hidden_size=48, hidden_size_per_layer_input=12)
    hf_model = hf_tiny.save_causal_lm(config, tmp_path, dtype=torch.bfloat16)
    model = hf_tiny.load_graph(tmp_path)
    ids = random_ids(2, SEQ, 256)
    with torch.no_grad():
        embedded = hf_model.model.embed_tokens(torch.tensor(ids))
        token_part = hf_model.model.get_per_layer_inputs(torch.tensor(ids))
        per_layer = hf_model.model.project_per_layer_inputs(embedded, token_part)
    ours = model.embed(mx.array(ids))
    np.testing.assert_array_equal(np.array(ours.astype(mx.float32)), embedded.float().numpy())
    ours_per_layer = np.array(model.per_layer_inputs(mx.array(ids), ours).astype(mx.float32))
    np.testing.assert_array_equal(ours_per_layer, per_layer.float().numpy())
