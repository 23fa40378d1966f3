"""Quantized weights on tiny checkpoints written by transformers: quantization on load, pre-quantized
MLX checkpoints written by mlx-lm (mixed bits, per-layer overrides, MoE experts), DiffusionGemma and
the multimodal Gemma 4, the policy, and refusals that name the key.

The decisive check is against the quantize-dequantize reference (``tests/quant_tiny.py``): the
quantized graph must equal the full-precision graph whose packed weights are replaced by their
round trip, to float rounding. KL divergence and top-1 agreement to the full-precision run are
reported and bounded too, with the KL of an unrelated model (another seed) as the scale of a
broken result.
"""

from __future__ import annotations

import json
import logging
import shutil

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models.registry import architecture_for  # noqa: E402
from tests import diffusion_tiny, hf_tiny  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from weights.quantize import (  # noqa: E402
    QuantizationError,
    QuantizationPolicy,
    QuantParams,
    quantized_modules,
    read_quantization,
)

TEXT = ["T1", "T2", "T3", "E2B_like"]
SETTINGS = [(4, 32), (4, 64), (8, 32), (8, 64)]
# Mean KL (nats) and top-1 agreement to the full-precision run over 40 positions, per bit width.
# Measured worst cases over TEXT x group sizes: 4-bit 0.35 / 0.20, 8-bit 0.027 / 0.825. An unrelated
# model (T1 with another seed) scores KL 1.35 but still top-1 0.43: random tiny models mostly predict
# their input token back through the tied head, so top-1 only separates at 8 bits; KL does at both.
KL_BOUND = {4: 0.6, 8: 0.06}
TOP1_BOUND = {4: 0.15, 8: 0.7}


@pytest.fixture(scope="module")
def text_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_text")
    for name in TEXT:
        hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], root / name)
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T1"], root / "T1_seed1", seed=1)
    return root


def _logits(model, ids):
    return model.logits(ids)


@pytest.mark.parametrize("bits, group_size", SETTINGS)
@pytest.mark.parametrize("name", TEXT)
def test_quantize_on_load_equals_the_quantize_dequantize_reference(text_checkpoints, name, bits, group_size, capsys):
    folder = text_checkpoints / name
    ids = qt.token_ids(0, 40, 256)
    quantized = models.load(str(folder), tokenizer=False, q_bits=bits, q_group_size=group_size)
    got = _logits(quantized, ids)
    reference = qt.qdq_reference(models.load(str(folder), tokenizer=False).graph, quantized.graph)
    assert qt.max_relative_difference(got, reference(mx.array(ids))) < 2e-5

    full = _logits(models.load(str(folder), tokenizer=False), ids)
    kl, kl_max, top1 = qt.kl_and_top1(full, got)
    with capsys.disabled():
        print(f"\n[{name} {bits}-bit g{group_size}] KL mean {kl:.4f} max {kl_max:.4f}, top-1 {top1:.3f}")
    assert kl <= KL_BOUND[bits] and top1 >= TOP1_BOUND[bits]


def test_the_kl_bound_separates_a_wrong_model(text_checkpoints):
    """The bounds above are far below what an unrelated set of weights scores."""
    ids = qt.token_ids(0, 40, 256)
    full = _logits(models.load(str(text_checkpoints / "T1"), tokenizer=False), ids)
    other = _logits(models.load(str(text_checkpoints / "T1_seed1"), tokenizer=False), ids)
    kl, _, top1 = qt.kl_and_top1(full, other)
    assert kl > 2 * KL_BOUND[4] and kl > 10 * KL_BOUND[8] and top1 < TOP1_BOUND[8]


@pytest.mark.parametrize("name", TEXT)
def test_the_policy_decides_every_layer(text_checkpoints, name, caplog):
    with caplog.at_level(logging.DEBUG, logger="weights.quantize"):
        model = models.load(str(text_checkpoints / name), tokenizer=False, q_bits=4, q_group_size=32)
    quantized = quantized_modules(model.graph)
    layers = qt.leaves(model.graph)
    for path, module in layers.items():
        if not (hasattr(module, "to_quantized") or path in quantized):
            continue
        params = quantized.get(path)
        if path.endswith("router.proj"):
            assert params == QuantParams(8, 64)  # mlx-lm's choice for the router
        elif path.endswith("per_layer_projection"):  # input 16 < one group of 32
            assert params is None
            assert f"keeping {path} in full precision: input dim 16 is smaller than one group of 32" in caplog.text
        else:
            assert params == QuantParams(4, 32), path
    assert "embed_tokens" in quantized  # the tied head is the embedding
    if name == "E2B_like":
        assert "embed_tokens_per_layer" in quantized and "per_layer_model_projection" in quantized
    if name == "T3":
        assert all(f"layers.{i}.experts.switch_glu.{p}_proj" in quantized for i in range(4) for p in ("gate", "up", "down"))


def test_embed_bits_and_router_in_the_policy(text_checkpoints):
    policy = QuantizationPolicy(4, 32, embed_bits=8, router=None)
    model = models.load(str(text_checkpoints / "T3"), tokenizer=False, q_policy=policy)
    quantized = quantized_modules(model.graph)
    assert quantized["embed_tokens"] == QuantParams(8, 32)
    assert "layers.0.router.proj" not in quantized
    assert quantized["layers.0.mlp.down_proj"] == QuantParams(4, 32)


def test_untied_head_follows_the_embedding_policy(tmp_path):
    folder = tmp_path / "untied"
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T1_bias_untied"], folder)
    model = models.load(str(folder), tokenizer=False, q_policy=QuantizationPolicy(4, 64, embed_bits=8))
    quantized = quantized_modules(model.graph)
    assert quantized["lm_head"] == quantized["embed_tokens"] == QuantParams(8, 64)
    ids = qt.token_ids(1, 20, 256)
    reference = qt.qdq_reference(models.load(str(folder), tokenizer=False).graph, model.graph)
    assert qt.max_relative_difference(model.logits(ids), reference(mx.array(ids))) < 2e-5


def test_bf16_moe_runs_quantized_on_cpu(text_checkpoints):
    """MLX's CPU gather_mm is float32 only (dense bf16 experts fail once the router sorts, at >= 64
    routed rows); the quantized experts' gather_qmm runs in bf16. Group 32 quantizes every expert
    here (with group 64 the down projection, input 32, would stay dense and fail in bf16)."""
    folder = str(text_checkpoints / "T3")
    ids = qt.token_ids(2, 48, 256)  # 48 tokens x top-2 = 96 routed rows
    bf16 = models.load(folder, dtype="bfloat16", tokenizer=False, q_bits=8, q_group_size=32)
    assert bf16.graph.layers[0].experts.switch_glu.down_proj.scales.dtype == mx.bfloat16
    fp32 = models.load(folder, tokenizer=False, q_bits=8, q_group_size=32)
    kl, _, top1 = qt.kl_and_top1(_logits(fp32, ids), _logits(bf16, ids))
    assert kl < 0.05 and top1 > 0.7


# ---------------------------------------------------------------------------------------- pre-quantized (mlx-lm)
def _mlx_lm_quantized(source, out, bits, group_size, overrides=None):
    """Quantize ``source`` with mlx-lm itself (its model class, its Gemma 4 router rule, ``overrides`` by
    module path) and save it as mlx-lm does; returns mlx-lm's model."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    readable = out.parent / (out.name + "_src")
    shutil.copytree(source, readable)
    raw = json.loads((source / "config.json").read_text())
    config, _ = architecture_for(raw, str(source), ()).peer.rewrite(raw)
    (readable / "config.json").write_text(json.dumps(config))
    model, config = load_model(readable)
    overrides = overrides or {}

    def predicate(path, module):
        if path in overrides:
            return overrides[path]
        return model.quant_predicate(path, module) if hasattr(model, "quant_predicate") else True

    model, config = quantize_model(model, config, group_size, bits, quant_predicate=predicate)
    save_model(out, model)
    save_config(config, out / "config.json")
    return model


@pytest.mark.parametrize("name", ["T1", "T3", "E2B_like"])
def test_mlx_lm_checkpoint_with_mixed_bits_loads(text_checkpoints, tmp_path, name):
    overrides = {
        "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
        "model.layers.1.self_attn.q_proj": {"group_size": 32, "bits": 4},
        "model.embed_tokens": {"group_size": 64, "bits": 6},
    }
    out = tmp_path / "mlx_lm_q"
    theirs = _mlx_lm_quantized(text_checkpoints / name, out, 4, 64, overrides)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["model.layers.0.mlp.down_proj"] == {"group_size": 64, "bits": 8}

    ours = models.load(str(out), tokenizer=False)
    quantized = quantized_modules(ours.graph)
    assert quantized["layers.0.mlp.down_proj"] == QuantParams(8, 64)
    assert quantized["layers.1.self_attn.q_proj"] == QuantParams(4, 32)
    assert quantized["embed_tokens"] == QuantParams(6, 64)
    assert quantized["layers.0.self_attn.o_proj"] == QuantParams(4, 64)
    if name == "T3":
        assert quantized["layers.2.router.proj"] == QuantParams(8, 64)
        assert quantized["layers.2.experts.switch_glu.gate_proj"] == QuantParams(4, 64)
        assert "layers.2.experts.switch_glu.down_proj" not in quantized  # input 32: mlx-lm leaves it dense too
    ids = qt.token_ids(3, 24, 256)
    want = np.array(theirs(mx.array(ids)))
    assert np.abs(np.array(ours.logits(ids)) - want).max() < 1e-4


def test_mlx_lm_moe_experts_quantized(text_checkpoints, tmp_path):
    out = tmp_path / "moe"
    theirs = _mlx_lm_quantized(text_checkpoints / "T3", out, 4, 32)
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.experts.switch_glu.gate_proj.weight"].dtype == mx.uint32
    ours = models.load(str(out), tokenizer=False)
    quantized = quantized_modules(ours.graph)
    assert all(quantized[f"layers.{i}.experts.switch_glu.{p}_proj"] == QuantParams(4, 32) for i in range(4) for p in ("gate", "up", "down"))
    ids = qt.token_ids(4, 30, 256)
    assert np.abs(np.array(ours.logits(ids)) - np.array(theirs(mx.array(ids)))).max() < 1e-4


def test_dtype_casts_the_scales_of_a_quantized_checkpoint(text_checkpoints, tmp_path):
    """``dtype="float32"`` on a bf16-scaled checkpoint gives float32 scales (the fast CPU path) and the same model."""
    out = tmp_path / "bf16"
    source = tmp_path / "bf16_checkpoint"
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T1"], source, dtype=torch.bfloat16)
    _mlx_lm_quantized(source, out, 4, 64)
    as_is = models.load(str(out), tokenizer=False)
    assert as_is.graph.layers[0].mlp.up_proj.scales.dtype == mx.bfloat16
    cast = models.load(str(out), tokenizer=False, dtype="float32")
    assert cast.graph.layers[0].mlp.up_proj.scales.dtype == mx.float32
    assert cast.graph.layers[0].mlp.up_proj.weight.dtype == mx.uint32
    ids = qt.token_ids(5, 16, 256)
    kl, _, top1 = qt.kl_and_top1(as_is.logits(ids), cast.logits(ids))
    assert kl < 0.01 and top1 >= 0.9


# ---------------------------------------------------------------------------------------- DiffusionGemma, multimodal
@pytest.fixture(scope="module")
def diffusion_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant_diffusion") / "T7"
    diffusion_tiny.save_diffusion("T7", folder)
    return folder


def _decode_logits(model, ids, canvas):
    cache = model.graph.make_cache()
    model.graph.prefill(mx.array(ids), cache)
    first = model.graph.denoise(mx.array(canvas), cache, None)
    return first, model.graph.denoise(mx.array(canvas), cache, first)  # the second with self-conditioning


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 64)])
def test_diffusion_gemma_quantized_on_load(diffusion_checkpoint, bits, group_size):
    model = models.load(str(diffusion_checkpoint), tokenizer=False, q_bits=bits, q_group_size=group_size)
    quantized = quantized_modules(model.graph)
    assert quantized["layers.0.experts.switch_glu.gate_proj"] == QuantParams(bits, group_size)
    assert ("layers.0.experts.switch_glu.down_proj" in quantized) == (group_size == 32)  # moe_intermediate is 32
    assert quantized["embed_tokens"] == QuantParams(bits, group_size)
    assert quantized["self_conditioning.up_proj"] == QuantParams(bits, group_size)
    assert not any(p.startswith(("vision_tower", "embed_vision")) for p in quantized)
    ids, canvas = [[2, 17, 99, 4, 56, 200, 31, 8, 9, 10]], [[5, 6, 7, 8, 9, 10, 11, 12]]
    got = _decode_logits(model, ids, canvas)
    reference = models.load(str(diffusion_checkpoint), tokenizer=False)
    qt.qdq_reference(reference.graph, model.graph)
    want = _decode_logits(reference, ids, canvas)
    for g, w in zip(got, want):
        assert qt.max_relative_difference(g, w) < 2e-5
    result = model.generate([5, 6, 7], seed=0, max_new_tokens=8, max_denoising_steps=3)
    assert result.sequences.shape == (1, 11)


def test_diffusion_gemma_bf16_quantized_generates(diffusion_checkpoint):
    model = models.load(str(diffusion_checkpoint), tokenizer=False, dtype="bfloat16", q_bits=4, q_group_size=32)
    result = model.generate(list(range(3, 40)), seed=0, max_new_tokens=16, max_denoising_steps=2)
    assert result.sequences.shape == (1, 37 + 16)


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant_mm") / "T5"
    hf_tiny.save_conditional_generation(folder)
    return folder


def _image_features(model):
    from PIL import Image

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 144, 3), dtype=np.uint8))
    return model.encode_images([picture], max_soft_tokens=70)[0]


def test_multimodal_vision_tower_policy(multimodal_checkpoint):
    folder = str(multimodal_checkpoint)
    full = models.load(folder, tokenizer=False)
    default = models.load(folder, tokenizer=False, q_bits=8, q_group_size=32)
    quantized = quantized_modules(default.graph)
    assert "language_model.layers.0.mlp.up_proj" in quantized and "language_model.embed_tokens" in quantized
    assert not any(p.startswith(("vision_tower", "embed_vision")) for p in quantized)
    assert mx.array_equal(_image_features(default), _image_features(full))

    vision = models.load(folder, tokenizer=False, q_policy=QuantizationPolicy(8, 32, quantize_vision=True))
    quantized = quantized_modules(vision.graph)
    assert quantized["vision_tower.encoder.layers.0.mlp.up_proj.linear"] == QuantParams(8, 32)
    assert quantized["embed_vision.embedding_projection"] == QuantParams(8, 32)
    got, want = _image_features(vision), _image_features(full)
    assert not mx.array_equal(got, want)
    relative = float(mx.linalg.norm(got - want) / mx.linalg.norm(want))
    assert relative < 0.05
    reference = models.load(folder, tokenizer=False)
    qt.qdq_reference(reference.graph, vision.graph)
    assert qt.max_relative_difference(got, _image_features(reference)) < 2e-5


# ---------------------------------------------------------------------------------------- refusals
def _quantized_copy(text_checkpoints, tmp_path, name="T1"):
    out = tmp_path / "q"
    _mlx_lm_quantized(text_checkpoints / name, out, 4, 64)
    return out


def _edit_config(folder, edit):
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization"]) if "quantization" in config else None
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda q: q.update(bits=7), r"config.json: quantization: bits=7 is not supported"),
        (lambda q: q.update(group_size=48), r"group_size=48 is not supported"),
        (lambda q: q.update(mode="int4"), r"unknown quantization mode 'int4'"),
        (lambda q: q.pop("bits"), r"'quantization' has no 'bits'"),
        (lambda q: q.update({"model.layers.0.mlp.up_proj": 8}), r"quantization\['model.layers.0.mlp.up_proj'\] must be a module override"),
        (lambda q: q.update({"model.layers.0.mlp.up_proj": {"bits": 4, "groups": 64}}),
         r"quantization\['model.layers.0.mlp.up_proj'\] has unknown fields \['groups'\]"),
        (lambda q: q.update({"model.layers.0.mlp.up_proj": {"group_size": 64, "bits": 8}}),
         r"quantization\['model.layers.0.mlp.up_proj'\] says 8-bit, group 64, which does not fit the stored shapes "
         r"\(model.layers.0.mlp.up_proj.weight \[128, 8\].*they fit .*4-bit, group 64"),
        (lambda q: q.update(bits=8), r"config.json: quantization \(the default\) says 8-bit, group 64, which does not fit"),
        (lambda q: q.update({"model.layers.0.mlp.up_proj": False}),
         r"quantization\['model.layers.0.mlp.up_proj'\] keeps 'model.layers.0.mlp.up_proj' in full precision, but the checkpoint stores it quantized"),
        (lambda q: q.update({"model.layers.0.post_attention_layernorm": {"group_size": 64, "bits": 4}}),
         r"quantization\['model.layers.0.post_attention_layernorm'\] quantizes it \(4-bit, group 64\), but the checkpoint stores "
         r"model.layers.0.post_attention_layernorm.weight unquantized"),
    ],
)  # fmt: skip
def test_bad_quantization_configs_name_the_key(text_checkpoints, tmp_path, edit, message):
    folder = _quantized_copy(text_checkpoints, tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(QuantizationError, match=message):
        models.load(str(folder), tokenizer=False)


def _edit_weights(folder, edit):
    path = folder / "model.safetensors"
    weights = dict(mx.load(str(path)))
    edit(weights)
    mx.save_safetensors(str(path), weights)
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda w: w.pop("model.layers.0.mlp.up_proj.biases"), r"affine quantization needs 'model.layers.0.mlp.up_proj.biases'"),
        (lambda w: w.pop("model.layers.0.mlp.up_proj.scales"),
         r"'model.layers.0.mlp.up_proj.biases' has no 'model.layers.0.mlp.up_proj.scales' beside it"),
        (lambda w: w.update({"model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"].astype(mx.float32)}),
         r"'model.layers.0.mlp.up_proj.weight' has scales, so it must be packed uint32"),
        (lambda w: w.update({"model.layers.0.mlp.up_proj.scales": w["model.layers.0.mlp.up_proj.scales"][:, :0]}),
         r"which does not fit the stored shapes"),
        (lambda w: w.update({"model.norm.scales": mx.ones((64, 1))}), r"'model.norm.weight' has scales, so it must be packed uint32"),
    ],
)  # fmt: skip
def test_damaged_quantized_weights_name_the_key(text_checkpoints, tmp_path, edit, message):
    folder = _quantized_copy(text_checkpoints, tmp_path)
    _edit_weights(folder, edit)
    with pytest.raises(QuantizationError, match=message):
        models.load(str(folder), tokenizer=False)


def test_packed_weights_without_a_config_entry_are_refused(text_checkpoints, tmp_path):
    folder = _quantized_copy(text_checkpoints, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=r"the weights are quantized \('model.*scales' and \d+ more\) but config.json has no 'quantization'"):
        models.load(str(folder), tokenizer=False)


def test_foreign_quantization_config_is_refused(text_checkpoints, tmp_path):
    folder = tmp_path / "awq"
    shutil.copytree(text_checkpoints / "T1", folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match=r"'quantization_config' \(quant_method 'awq'\) is not an MLX quantization"):
        models.load(str(folder), tokenizer=False)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(q_bits=3), r"q_bits must be one of \(4, 8\), got 3"),
        (dict(q_bits=4, q_group_size=16), r"q_group_size must be one of \(32, 64, 128\), got 16"),
        (dict(q_group_size=64), r"q_group_size=64 was given without q_bits"),
        (dict(q_bits=4, q_policy=QuantizationPolicy(4, 64)), "either q_bits/q_group_size or q_policy"),
    ],
)
def test_bad_load_options(text_checkpoints, kwargs, message):
    with pytest.raises(QuantizationError, match=message):
        models.load(str(text_checkpoints / "T1"), tokenizer=False, **kwargs)


def test_quantizing_a_quantized_checkpoint_is_refused(text_checkpoints, tmp_path):
    folder = _quantized_copy(text_checkpoints, tmp_path)
    with pytest.raises(QuantizationError, match=r"already quantized \(4-bit, group 64\); quantization on load \(q_bits\) needs full-precision"):
        models.load(str(folder), tokenizer=False, q_bits=8)


def test_read_quantization_forms():
    q = read_quantization({"quantization": {"group_size": 64, "bits": 4, "a.b": True, "c": False, "d": {"bits": 8}}})
    assert q.default == QuantParams(4, 64)
    assert q.overrides == {"a.b": QuantParams(4, 64), "c": None, "d": QuantParams(8, 64)}
    assert read_quantization({"quantization_config": {"group_size": 32, "bits": 8}}).default == QuantParams(8, 32)
    assert read_quantization({"model_type": "gemma4_text"}) is None
    assert read_quantization({"quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}).default.mode == "mxfp4"
    with pytest.raises(QuantizationError, match="mode 'mxfp4' needs bits=4 and group_size=32"):
        read_quantization({"quantization": {"group_size": 64, "bits": 4, "mode": "mxfp4"}})
