"""``Gemma4TextConfig`` parsing against transformers' own derivations (``configuration_gemma4.py``).

The property test draws random config dicts, builds transformers' ``Gemma4TextConfig`` from them and
checks that our parse resolves the same per-layer geometry, window and KV-sharing modes, from the
kwargs form and from the ``per_layer_config`` form transformers writes to config.json.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
from transformers import Gemma4TextConfig as ReferenceConfig  # noqa: E402

from graphs.gemma4_text_config import FULL, SLIDING, Gemma4TextConfig  # noqa: E402
from tests import hf_tiny  # noqa: E402


@st.composite
def config_dicts(draw) -> dict:
    layers = draw(st.integers(1, 8))
    d = dict(
        model_type="gemma4_text",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=draw(st.sampled_from([1, 2, 4])),
        head_dim=8,
        sliding_window=draw(st.integers(1, 40)),
        attention_k_eq_v=draw(st.booleans()),
        num_kv_shared_layers=draw(st.integers(0, layers - 1)),
        use_bidirectional_attention=draw(st.sampled_from([None, "vision", "all"])),
        hidden_size_per_layer_input=draw(st.sampled_from([0, 8])),
    )
    if draw(st.booleans()):
        d["layer_types"] = draw(st.lists(st.sampled_from([SLIDING, FULL]), min_size=layers, max_size=layers))
    if draw(st.booleans()):
        d["global_head_dim"] = draw(st.sampled_from([8, 16]))
    if draw(st.booleans()):
        d["num_global_key_value_heads"] = draw(st.sampled_from([1, 2]))
    return d


def reference_geometry(reference: ReferenceConfig) -> dict:
    layers = range(reference.num_hidden_layers)
    return dict(
        layer_types=tuple(reference.layer_types),
        head_dims=tuple(reference.per_layer_config[i].head_dim for i in layers),
        kv_heads=tuple(reference.per_layer_config[i].num_key_value_heads for i in layers),
        sliding_window=reference.sliding_window,
        kv_sharing_modes=tuple(reference.kv_sharing_modes),
    )


def our_geometry(config: Gemma4TextConfig) -> dict:
    return dict(
        layer_types=config.layer_types,
        head_dims=config.layer_head_dims,
        kv_heads=config.layer_kv_heads,
        sliding_window=config.sliding_window,
        kv_sharing_modes=config.kv_sharing_modes,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config_dicts())
def test_geometry_matches_transformers(d):
    kwargs = {k: v for k, v in d.items() if k != "model_type"}
    reference = ReferenceConfig(**kwargs)
    try:
        expected = reference_geometry(reference)
    except ValueError:  # a reused layer type without a producer: both must refuse
        with pytest.raises(ValueError, match="no earlier layer of that type"):
            Gemma4TextConfig.from_dict(d)
        return
    ours = Gemma4TextConfig.from_dict(d)
    assert our_geometry(ours) == expected

    written = json.loads(reference.to_json_string())  # the per_layer_config form of config.json
    assert Gemma4TextConfig.from_dict(written) == ours
    assert Gemma4TextConfig.from_dict(ours.to_dict()) == ours
    assert reference_geometry(ReferenceConfig.from_dict(ours.to_dict())) == expected


def test_tiny_checkpoints_config_json(tmp_path):
    """The config.json transformers saves for T3 carries per_layer_config, not global_head_dim."""
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T3"], tmp_path)
    written = hf_tiny.read_config(tmp_path)
    assert "global_head_dim" not in written and "per_layer_config" in written
    config = Gemma4TextConfig.from_dict(written)
    assert config.layer_head_dims == (32, 32, 32, 64)
    assert config.layer_kv_heads == (2, 2, 2, 1)
    assert [g.has_v_proj for g in config.layers] == [True, True, True, False]


def test_global_kv_heads_count_only_with_k_eq_v():
    base = dict(hf_tiny.TEXT_CONFIGS["T3"], model_type="gemma4_text")
    assert Gemma4TextConfig.from_dict(base).layer_kv_heads[3] == 1
    assert Gemma4TextConfig.from_dict(dict(base, attention_k_eq_v=False)).layer_kv_heads[3] == 2


def test_last_layer_forced_full_and_default_pattern():
    config = Gemma4TextConfig.from_dict(dict(model_type="gemma4_text", num_hidden_layers=8))
    assert config.layer_types == (SLIDING,) * 5 + (FULL, SLIDING, FULL)
    forced = Gemma4TextConfig.from_dict(dict(model_type="gemma4_text", num_hidden_layers=2, layer_types=[SLIDING] * 2))
    assert forced.layer_types == (SLIDING, FULL)


def test_defaults_follow_transformers():
    """A bare config gets transformers' defaults: PLE on (256), full layers at head_dim 512."""
    config = Gemma4TextConfig.from_dict({"model_type": "gemma4_text"})
    assert config.hidden_size_per_layer_input == 256
    assert config.layer_head_dims[5] == 512 and config.layer_head_dims[0] == 256
    assert config.final_logit_softcapping is None and config.tie_word_embeddings


def test_bidirectional_all_window_round_trip():
    """"all" halves the window (W//2 + 1); to_dict writes (w - 1) * 2, which is what config.json holds."""
    d = dict(hf_tiny.TEXT_CONFIGS["T4"], model_type="gemma4_text")
    config = Gemma4TextConfig.from_dict(d)
    assert config.sliding_window == 3
    assert config.to_dict()["sliding_window"] == 4
    assert Gemma4TextConfig.from_dict(config.to_dict()) == config


def test_multimodal_config_reads_text_config():
    d = {"model_type": "gemma4", "text_config": dict(hf_tiny.T5_TEXT), "vision_config": dict(hf_tiny.T5_VISION)}
    config = Gemma4TextConfig.from_dict(d)
    assert config.vocab_size == 512 and config.hidden_size_per_layer_input == 16


@pytest.mark.parametrize(
    "d, message",
    [
        ({"model_type": "gemma3_text"}, "unsupported model_type 'gemma3_text'"),
        ({}, "unsupported model_type None"),
        ({"model_type": "gemma4", "text_config": {"model_type": "llama"}}, "'llama'"),
        ({"model_type": "gemma4_text", "hidden_activation": "silu"}, "hidden_activation 'silu'"),
        (
            {"model_type": "gemma4_text", "num_hidden_layers": 1, "rope_parameters": {FULL: {"rope_type": "yarn", "rope_theta": 1.0}}},
            "rope_type 'yarn'",
        ),
        (
            {"model_type": "gemma4_text", "num_hidden_layers": 2, "per_layer_config": {"1": {"intermediate_size": 8}}},
            "intermediate_size",
        ),
        ({"model_type": "gemma4_text", "num_hidden_layers": 2, "num_kv_shared_layers": 2}, "leaves no layer"),
        ({"model_type": "gemma4_text", "enable_moe_block": True}, "num_experts"),
    ],
)
def test_refusals_name_the_problem(d, message):
    with pytest.raises(ValueError, match=message):
        Gemma4TextConfig.from_dict(d)
