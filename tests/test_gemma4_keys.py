"""The Gemma 4 text key mapping: every accepted layout, the known drops, and loud failures otherwise."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphs import Gemma4TextModel  # noqa: E402
from graphs.gemma4_text_config import Gemma4TextConfig  # noqa: E402
from tests import hf_tiny  # noqa: E402
from models.registry import load_gemma4_text_weights  # noqa: E402
from weights.gemma4_keys import map_gemma4_text_weights  # noqa: E402
from weights.modules import parameter_shapes  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(config, transformers-written weights) for T2 (KV sharing, PLE) and T3 (MoE, K=V)."""
    out = {}
    for name in ("T2", "T3"):
        directory = tmp_path_factory.mktemp(name)
        hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], directory)
        out[name] = (Gemma4TextConfig.from_dict(hf_tiny.read_config(directory)), hf_tiny.read_safetensors(directory))
    return out


def mapped_and_expected(config, weights):
    expected = parameter_shapes(Gemma4TextModel(config))
    reused = {i for i, mode in enumerate(config.kv_sharing_modes) if mode == "reuse"}
    return map_gemma4_text_weights(weights, expected, tied=config.tie_word_embeddings, reused_layers=reused), expected


def to_mlx_lm_layout(weights: dict, prefix: str) -> dict:
    """What mlx-lm / mlx-vlm save: experts split into switch_glu, text under ``prefix``."""
    out = {}
    for key, value in weights.items():
        name = key.removeprefix("model.")
        if name.endswith("experts.gate_up_proj"):
            gate, up = mx.split(value, 2, axis=-2)
            out[prefix + name.replace("gate_up_proj", "switch_glu.gate_proj.weight")] = gate
            out[prefix + name.replace("gate_up_proj", "switch_glu.up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            out[prefix + name.replace("down_proj", "switch_glu.down_proj.weight")] = value
        else:
            out[prefix + name] = value
    return out


def assert_same_arrays(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.array(a[key]), np.array(b[key]), err_msg=key)


@pytest.mark.parametrize("name", ["T2", "T3"])
def test_transformers_layout_covers_every_parameter(checkpoints, name):
    config, weights = checkpoints[name]
    mapped, expected = mapped_and_expected(config, weights)
    assert mapped.keys() == expected.keys()


@pytest.mark.parametrize("prefix", ["model.", "language_model.model."])
def test_mlx_layouts_map_to_the_same_arrays(checkpoints, prefix):
    config, weights = checkpoints["T3"]
    reference, _ = mapped_and_expected(config, weights)
    mapped, _ = mapped_and_expected(config, to_mlx_lm_layout(weights, prefix))
    assert_same_arrays(mapped, reference)


def test_multimodal_layout_drops_towers(checkpoints, caplog):
    config, weights = checkpoints["T2"]
    reference, _ = mapped_and_expected(config, weights)
    multimodal = {key.replace("model.", "model.language_model.", 1): value for key, value in weights.items()}
    towers = {
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight": mx.zeros((4, 4)),
        "model.embed_vision.embedding_projection.weight": mx.zeros((4, 4)),
        "model.audio_tower.layers.0.weight": mx.zeros((4,)),
        "model.embed_audio.embedding_projection.weight": mx.zeros((4, 4)),
    }
    with caplog.at_level(logging.DEBUG, logger="weights.gemma4_keys"):
        mapped, _ = mapped_and_expected(config, {**multimodal, **towers})
    assert_same_arrays(mapped, reference)
    for key in towers:
        assert key in caplog.text


def test_known_droppable_keys_are_dropped_and_logged(checkpoints, caplog):
    """T2's layers 2 and 3 reuse K/V: their k/v projections and norms are dropped, as are rotary buffers
    and a tied lm_head."""
    config, weights = checkpoints["T2"]
    extra = {
        "model.layers.2.self_attn.k_proj.weight": mx.zeros((32, 64)),
        "model.layers.3.self_attn.v_proj.weight": mx.zeros((64, 64)),
        "model.layers.3.self_attn.k_norm.weight": mx.zeros((64,)),
        "model.rotary_emb.full_attention_inv_freq": mx.zeros((32,)),
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.zeros((16,)),
        "lm_head.weight": weights["model.embed_tokens.weight"],
    }
    with caplog.at_level(logging.DEBUG, logger="weights.gemma4_keys"):
        mapped, expected = mapped_and_expected(config, {**weights, **extra})
    assert mapped.keys() == expected.keys()
    for key in extra:
        assert key in caplog.text


def test_missing_key_is_named(checkpoints):
    config, weights = checkpoints["T3"]
    damaged = dict(weights)
    del damaged["model.layers.1.router.per_expert_scale"]
    with pytest.raises(ValueError, match=r"lacks 1 parameters: 'layers\.1\.router\.per_expert_scale'"):
        mapped_and_expected(config, damaged)


@pytest.mark.parametrize(
    "key, shape, message",
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 63), r"\[64, 63\] in the checkpoint, the graph expects \[64, 64\]"),
        ("model.layers.2.experts.gate_up_proj", (4, 32, 64), r"\[4, 32, 64\] in the checkpoint, the graph expects \[4, 64, 64\]"),
        ("model.layers.2.experts.down_proj", (4, 64, 16), r"\[4, 64, 16\] in the checkpoint, the graph expects \[4, 64, 32\]"),
    ],
)
def test_shape_mismatch_names_key_and_both_shapes(checkpoints, key, shape, message):
    config, weights = checkpoints["T3"]
    with pytest.raises(ValueError, match=f"{key!r} has shape " + message):
        mapped_and_expected(config, {**weights, key: mx.zeros(shape)})


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.3.self_attn.v_proj.weight",  # K=V full layer has no v_proj
        "model.layers.0.self_attn.k_proj.bias",  # attention_bias is off
        "model.layers.9.mlp.up_proj.weight",
        "model.multi_modal_projector.weight",
        "something_else.weight",
    ],
)
def test_unexpected_key_is_named(checkpoints, key):
    config, weights = checkpoints["T3"]
    with pytest.raises(ValueError, match="unexpected key " + repr(key).replace(".", r"\.")):
        mapped_and_expected(config, {**weights, key: mx.zeros((64, 64))})


def test_no_text_weights_at_all(checkpoints):
    config, _ = checkpoints["T3"]
    with pytest.raises(ValueError, match="no Gemma 4 text weights found"):
        mapped_and_expected(config, {"vision_tower.weight": mx.zeros((2,))})


def test_load_keeps_checkpoint_dtype(checkpoints):
    config, weights = checkpoints["T2"]
    model = Gemma4TextModel(config)
    load_gemma4_text_weights(model, {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert model.layers[0].layer_scalar.dtype == mx.bfloat16
