"""DiffusionGemma checkpoints: the transformers and mlx-vlm layouts, strict errors, config parsing, ``models.load``."""

from __future__ import annotations

import json
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphs.diffusion_gemma import DiffusionGemmaModel  # noqa: E402
from graphs.diffusion_gemma_config import DiffusionGemmaConfig  # noqa: E402
from models import load  # noqa: E402
from tests import diffusion_tiny as tiny  # noqa: E402
from tests.hf_tiny import read_safetensors  # noqa: E402
from models.registry import load_diffusion_gemma_weights
from weights.diffusion_gemma_keys import map_diffusion_gemma_weights
from weights.modules import parameter_shapes  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("t7")
    with tiny.one_torch_thread():
        tiny.save_diffusion("T7", directory)
    return directory


def fresh(directory) -> DiffusionGemmaModel:
    return DiffusionGemmaModel(DiffusionGemmaConfig.from_dict(tiny.read_config(directory)))


def mlx_vlm_layout(weights: dict) -> dict:
    """What mlx-vlm's ``diffusion_gemma`` sanitize saves: experts as SwitchLinear ``.weight``s, no ``lm_head``."""
    out = {}
    for key, value in weights.items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            key += ".weight"
        out[key] = value
    return out


def parameters(model) -> dict:
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


def test_mlx_vlm_layout_loads_the_same_weights(checkpoint):
    weights = read_safetensors(checkpoint)
    ours, theirs = fresh(checkpoint), fresh(checkpoint)
    load_diffusion_gemma_weights(ours, weights)
    load_diffusion_gemma_weights(theirs, mlx_vlm_layout(weights))
    a, b = parameters(ours), parameters(theirs)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # the experts' packed [gate; up] rows were split in that order
    packed = np.array(weights["model.decoder.layers.0.experts.gate_up_proj"])
    np.testing.assert_array_equal(a["layers.0.experts.switch_glu.up_proj.weight"], packed[:, 32:])


def test_tied_copies_are_dropped(checkpoint):
    weights = dict(read_safetensors(checkpoint))
    weights["lm_head.weight"] = weights["model.decoder.embed_tokens.weight"]
    weights["model.encoder.language_model.norm.weight"] = weights["model.decoder.norm.weight"]
    weights["model.encoder.language_model.layers.0.mlp.up_proj.weight"] = weights["model.decoder.layers.0.mlp.up_proj.weight"]
    load_diffusion_gemma_weights(fresh(checkpoint), weights)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda w: w.update({"model.decoder.layers.0.extra.weight": mx.zeros((2,))}), "unexpected key 'model.decoder.layers.0.extra.weight'"),
        (lambda w: w.update({"something.else": mx.zeros((2,))}), "unexpected key 'something.else'"),
        (lambda w: w.pop("model.decoder.self_conditioning.up_proj.weight"), "lacks 1 parameters: 'self_conditioning.up_proj.weight'"),
        (lambda w: w.pop("model.encoder.language_model.layers.2.layer_scalar"), "layers.2.encoder_layer_scalar"),
        (lambda w: w.update({"model.decoder.norm.weight": mx.zeros((65,))}), r"'model.decoder.norm.weight' has shape \[65\] in the checkpoint"),
        (lambda w: w.update({"model.decoder.layers.1.experts.gate_up_proj": mx.zeros((4, 63, 64))}), "gate_up_proj"),
        (lambda w: w.update({"model.decoder.layers.0.mlp.up_proj.scales": mx.zeros((2,))}), "unexpected key 'model.decoder.layers.0.mlp.up_proj.scales'"),
        (lambda w: w.pop("model.encoder.vision_tower.patch_embedder.input_proj.weight"), "no vision tower weights"),
    ],
)
def test_damaged_checkpoints_raise_naming_the_key(checkpoint, change, message):
    weights = dict(read_safetensors(checkpoint))
    change(weights)
    with pytest.raises(ValueError, match=message):
        graph = fresh(checkpoint)
        vision = graph.config.vision
        map_diffusion_gemma_weights(weights, parameter_shapes(graph), vision_clipped=None if vision is None else vision.use_clipped_linears)


def test_config_is_the_gemma4_text_config_with_the_switches_set(checkpoint):
    config = DiffusionGemmaConfig.from_dict(tiny.read_config(checkpoint))
    text = config.text
    assert text.enable_moe_block and text.attention_k_eq_v and not text.hidden_size_per_layer_input
    assert text.final_logit_softcapping == 30.0 and text.layer_head_dims == (32, 32, 32, 64)
    assert [g.has_v_proj for g in text.layers] == [True, True, True, False]  # K=V on the full layer
    assert (config.canvas_length, config.image_token_id, config.vision_overlay) == (8, 251, True)
    assert config.vision.hidden_size == 32


def test_global_kv_heads_count_without_attention_k_eq_v_in_the_file():
    raw = {"model_type": "diffusion_gemma", "text_config": dict(tiny.CONFIGS["T7_gqa"], model_type="diffusion_gemma_text")}
    from transformers import DiffusionGemmaConfig as HFConfig

    theirs = HFConfig(text_config=tiny.CONFIGS["T7_gqa"]).text_config
    ours = DiffusionGemmaConfig.from_dict(raw).text
    assert list(ours.layer_kv_heads) == [theirs.per_layer_config[i].num_key_value_heads for i in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(tie_word_embeddings=False), "tie_word_embeddings"),
        (lambda c: c["text_config"].update(use_bidirectional_attention="all"), "'all'"),
        (lambda c: c.update(canvas_length=0), "canvas_length"),
        (lambda c: c.update(model_type="gemma4"), "model_type"),
    ],
)
def test_config_refusals(checkpoint, edit, message):
    raw = tiny.read_config(checkpoint)
    edit(raw)
    with pytest.raises(ValueError, match=message):
        DiffusionGemmaConfig.from_dict(raw)


def test_gemma4_switches_in_the_file_are_ignored_like_transformers(checkpoint, caplog):
    raw = tiny.read_config(checkpoint)
    raw["text_config"].update(enable_moe_block=False, hidden_size_per_layer_input=256, attention_k_eq_v=True)
    with caplog.at_level(logging.WARNING):
        config = DiffusionGemmaConfig.from_dict(raw)
    assert config.text.enable_moe_block and not config.text.hidden_size_per_layer_input
    assert "enable_moe_block" in caplog.text and "hidden_size_per_layer_input" in caplog.text


def test_load_diffusion_honours_generation_config_json(checkpoint, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(checkpoint, folder)
    (folder / "generation_config.json").write_text(
        json.dumps({"max_denoising_steps": 3, "t_min": None, "eos_token_id": [1, 7], "pad_token_id": 0,
                    "sampler_config": {"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"}})  # fmt: skip
    )
    model = load(folder)
    assert model.tokenizer is None
    options = model.options()
    assert (options.max_denoising_steps, options.t_min, options.entropy_bound, options.eos_token_id) == (3, 0.4, 0.5, (1, 7))
    result = model.generate([5, 6, 7], seed=0, max_new_tokens=16)
    assert result.steps_per_block[0] <= 3 and len(result.steps_per_block) <= 2
    assert model.options(max_denoising_steps=5).max_denoising_steps == 5
    with pytest.raises(ValueError, match="top_p"):
        model.generate([5, 6, 7], top_p=0.9)
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("hello")


def test_load_diffusion_image_prompt(checkpoint):
    from PIL import Image

    model = load(checkpoint)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 144, 3), dtype=np.uint8))
    prompt = model.prompt([2, 251, 17], [picture], max_soft_tokens=70)  # one placeholder per image
    assert prompt.ids[:2] == [2, 250] and prompt.ids[-2:] == [252, 17]
    assert prompt.ids.count(251) == prompt.images[0].features.shape[0] > 4  # longer than the window
    result = model.generate(prompt, seed=0, max_new_tokens=8, max_denoising_steps=2)
    assert result.sequences.shape == (1, len(prompt.ids) + 8)
    with pytest.raises(ValueError, match="placeholder"):
        model.prompt([2, 17], [picture])


def test_models_load_dispatches_diffusion_checkpoints(tmp_path):
    """``models.load`` hands a DiffusionGemma folder to its own loader and model object."""
    import models
    from models.diffusion_model import DiffusionModel
    from tests.diffusion_tiny import save_diffusion

    save_diffusion("T7", tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    assert isinstance(model, DiffusionModel)
