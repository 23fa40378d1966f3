"""Gemma 3 text graph against transformers' ``Gemma3ForCausalLM`` on tiny random checkpoints.

Each checkpoint is written by transformers (``save_pretrained``), read back with ``mx.load`` into
our graph and compared in fp32 with the model that wrote it. Then cached generation is checked
against the no-cache forward under teacher forcing, with chunk sizes straddling the window.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from graphs.gemma3_text import Gemma3TextModel
from models.registry import load_gemma3_text_weights
from weights.gemma3_keys import map_gemma3_text_weights
from weights.modules import parameter_shapes  # noqa: E402
from graphs.gemma3_text_config import FULL, SLIDING, Gemma3TextConfig  # noqa: E402

S, F = SLIDING, FULL
WINDOW = 8
BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,  # differs from head_dim, so a head_dim ** -0.5 scale would show
    sliding_window=WINDOW,
    layer_types=[S, S, F, S, S, F],
    max_position_embeddings=512,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
CONFIGS = {
    "base": BASE,
    # linear RoPE on full layers (the 4B+ sizes), MQA, final softcap, old-style rope keys
    "linear_softcap": dict(
        BASE,
        num_key_value_heads=1,
        final_logit_softcapping=30.0,
        rope_theta=50_000.0,
        rope_local_base_freq=5_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "untied": dict(BASE, tie_word_embeddings=False),
    # layer_types derived from sliding_window_pattern
    "pattern": {k: v for k, v in dict(BASE, num_hidden_layers=5, sliding_window_pattern=3).items() if k != "layer_types"},
}
SEQ = 40  # well past the window of 8


def _write_checkpoint(name: str, tmp_path):
    """Seeded random ``Gemma3ForCausalLM`` (norm weights randomised too), saved; returns (model, folder)."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**CONFIGS[name])
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # initialised to 0, which would hide a missing "1 +"
                p.normal_(0.0, 0.3)
    folder = tmp_path / name
    model.save_pretrained(folder)
    return model, folder


def _our_model(folder) -> Gemma3TextModel:
    config = Gemma3TextConfig.from_dict(json.loads((folder / "config.json").read_text()))
    model = Gemma3TextModel(config)
    load_gemma3_text_weights(model, mx.load(str(folder / "model.safetensors")))
    model.eval()
    return model


def _ids(seed=0, batch=2, length=SEQ, vocab=BASE["vocab_size"]):
    return np.random.default_rng(seed).integers(3, vocab, size=(batch, length))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    reference, folder = _write_checkpoint(name, tmp_path)
    ours = _our_model(folder)
    assert ours.config.layer_types == tuple(reference.config.layer_types)
    ids = _ids()
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.float().numpy()
    got = np.array(ours(mx.array(ids)))
    worst = float(np.abs(got - expected).max())
    assert worst <= 1e-4, f"{name}: worst |logit diff| {worst:.3g}"


@pytest.mark.parametrize("chunk", [1, 7, WINDOW - 1, WINDOW, WINDOW + 3, SEQ])
def test_cached_equals_no_cache(chunk, tmp_path):
    _, folder = _write_checkpoint("linear_softcap", tmp_path)
    model = _our_model(folder)
    ids = mx.array(_ids(seed=1))
    full = np.array(model(ids))
    cache = model.make_cache()
    parts = [np.array(model(ids[:, s : s + chunk], cache=cache)) for s in range(0, SEQ, chunk)]
    worst = float(np.abs(np.concatenate(parts, axis=1) - full).max())
    assert worst <= 1e-4, f"chunk {chunk}: worst |cached - no-cache| {worst:.3g}"
    assert all(c.offset == SEQ for c in cache)


def test_last_only_is_the_last_position(tmp_path):
    _, folder = _write_checkpoint("base", tmp_path)
    model = _our_model(folder)
    ids = mx.array(_ids(length=12))
    assert np.allclose(np.array(model(ids, last_only=True)), np.array(model(ids))[:, -1:], atol=1e-6)


def test_bf16_weights_track_the_reference(tmp_path):
    """bf16 weights and compute stay close to the reference's bf16 run (same argmax nearly everywhere)."""
    reference, folder = _write_checkpoint("base", tmp_path)
    reference = reference.to(torch.bfloat16)
    config = Gemma3TextConfig.from_dict(json.loads((folder / "config.json").read_text()))
    ours = Gemma3TextModel(config)
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    load_gemma3_text_weights(ours, weights)
    ids = _ids(length=16)
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.float().numpy()
    got = np.array(ours(mx.array(ids)).astype(mx.float32))
    assert np.abs(got - expected).max() < 0.1 and np.abs(got - expected).mean() < 0.02
    # Same argmax wherever the reference's own bf16 logits decide it: a top-2 margin of a bf16 ulp
    # or two (ties included, which random tiny weights produce) flips with any rounding order.
    top2 = np.sort(expected, axis=-1)[..., -2:]
    decided = top2[..., 1] - top2[..., 0] > 1 / 32
    assert decided.mean() > 0.75
    np.testing.assert_array_equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])


def test_key_layouts_and_errors(tmp_path):
    _, folder = _write_checkpoint("base", tmp_path)
    weights = mx.load(str(folder / "model.safetensors"))
    model = Gemma3TextModel(Gemma3TextConfig.from_dict(json.loads((folder / "config.json").read_text())))
    # the text part of a multimodal checkpoint, with its vision tower
    multimodal = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    multimodal["model.vision_tower.encoder.w"] = mx.zeros((2,))
    shapes, tied = parameter_shapes(model), model.config.tie_word_embeddings
    assert set(map_gemma3_text_weights(multimodal, shapes, tied=tied)) == set(map_gemma3_text_weights(weights, shapes, tied=tied))
    with pytest.raises(ValueError, match="unexpected key 'model.layers.0.self_attn.extra.weight'"):
        map_gemma3_text_weights({**weights, "model.layers.0.self_attn.extra.weight": mx.zeros((2,))}, shapes, tied=tied)
    with pytest.raises(ValueError, match="lacks 1 parameters: 'norm.weight'"):
        map_gemma3_text_weights({k: v for k, v in weights.items() if k != "model.norm.weight"}, shapes, tied=tied)
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        map_gemma3_text_weights({**weights, "model.norm.weight": mx.zeros((3,))}, shapes, tied=tied)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
        ({"layer_types": [S, F]}, "2 entries for 6 layers"),
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
    ],
)
def test_config_refuses_what_the_graph_does_not_build(change, message):
    with pytest.raises(ValueError, match=message):
        Gemma3TextConfig.from_dict({**BASE, "model_type": "gemma3_text", **change})


def test_config_reads_the_multimodal_text_config_and_both_rope_spellings():
    old = dict(BASE, model_type="gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4)
    new = dict(
        BASE,
        model_type="gemma3_text",
        rope_parameters={F: {"rope_type": "default", "rope_theta": 1e6}, S: {"rope_type": "default", "rope_theta": 1e4}},
    )
    wrapped = {"model_type": "gemma3", "text_config": dict(old, model_type="gemma3_text")}
    configs = [Gemma3TextConfig.from_dict(c) for c in (old, new, wrapped)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_parameters[F]["rope_theta"] == 1e6 and configs[0].rope_parameters[S]["rope_theta"] == 1e4
