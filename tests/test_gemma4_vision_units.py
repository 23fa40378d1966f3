"""Vision config parsing, checkpoint key mapping, the tower's input checks, pooling order and
``encode_images``: everything that needs no reference model (parity is in test_gemma4_vision_parity)."""

from __future__ import annotations

import logging
import math
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from graphs.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images
from graphs.gemma4_vision_config import Gemma4VisionConfig
from models.processing.image_processor import Gemma4ImageProcessor
from models.registry import load_gemma4_vision_weights
from weights.gemma4_vision_keys import map_gemma4_vision_weights

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=16, position_embedding_size=64)  # fmt: skip


def tiny_config(**changes) -> Gemma4VisionConfig:
    return Gemma4VisionConfig(**dict(TINY, **changes))


def random_tower(config: Gemma4VisionConfig, seed: int = 0) -> Gemma4VisionTower:
    """A tower with seeded random parameters (norm weights around 1)."""
    tower = Gemma4VisionTower(config)
    params = []
    for i, (name, value) in enumerate(tree_flatten(tower.parameters())):
        noise = 0.3 * mx.random.normal(value.shape, key=mx.random.key(seed * 1000 + i))
        params.append((name, noise + 1.0 if "norm" in name else noise))
    tower.load_weights(params, strict=True)
    return tower


def checkpoint(tower, embedder=None, tower_prefix="model.vision_tower.", embedder_prefix="model.embed_vision."):
    weights = {tower_prefix + k: v for k, v in tree_flatten(tower.parameters())}
    if embedder is not None:
        weights.update({embedder_prefix + k: v for k, v in tree_flatten(embedder.parameters())})
    return weights


def image(height=100, width=150, budget=70, seed=0):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Gemma4ImageProcessor(budget)(pixels)[0]


# ---------------------------------------------------------------------------------------------
# Config


def test_config_defaults_are_transformers_defaults():
    config = Gemma4VisionConfig.from_dict({"model_type": "gemma4_vision"})
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (768, 16, 12, 64)
    assert (config.patch_size, config.pooling_kernel_size, config.position_embedding_size) == (16, 3, 10240)
    assert (config.use_clipped_linears, config.standardize, config.rope_theta) == (False, False, 100.0)


@pytest.mark.parametrize("model_type", ["gemma4", "diffusion_gemma"])
def test_config_inside_a_multimodal_config(model_type):
    raw = {"model_type": model_type, "text_config": {"hidden_size": 64},
           "vision_config": dict(TINY, model_type="gemma4_vision", standardize=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": 50.0})}  # fmt: skip
    config = Gemma4VisionConfig.from_dict(raw)
    assert config == tiny_config(standardize=True, rope_theta=50.0)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "gemma4", "vision_config": None}, "this gemma4 config has no vision_config"),
        ({"model_type": "gemma3"}, "unsupported model_type 'gemma3'"),
        ({"model_type": "gemma4_vision", "rope_parameters": {"rope_type": "yarn"}}, "unsupported rope_type 'yarn'"),
        ({"model_type": "gemma4_vision", "hidden_activation": "gelu"}, "unsupported hidden_activation 'gelu'"),
        ({"model_type": "gemma4_vision", "head_dim": 18}, "head_dim must be a multiple of 4 .* got 18"),
        ({"model_type": "gemma4_vision", "num_key_value_heads": 5}, "num_attention_heads 12 is not a multiple of num_key_value_heads 5"),
        ({"model_type": "gemma4_vision", "pooling_kernel_size": 0}, "pooling_kernel_size must be a positive int, got 0"),
        ({"model_type": "gemma4_vision", "attention_bias": True}, "attention_bias=True is not implemented"),
    ],
)  # fmt: skip
def test_config_errors(raw, message):
    with pytest.raises(ValueError, match=message):
        Gemma4VisionConfig.from_dict(raw)


# ---------------------------------------------------------------------------------------------
# Key mapping


LAYOUTS = {
    "transformers": ("model.vision_tower.", "model.embed_vision."),
    "diffusion_gemma": ("model.encoder.vision_tower.", "model.encoder.embed_vision."),
    "mlx-vlm": ("vision_tower.", "embed_vision."),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_to_the_same_graph(layout):
    config = tiny_config(use_clipped_linears=True, standardize=True)
    source, embedder = random_tower(config), Gemma4MultimodalEmbedder(32, 64, 1e-6)
    weights = checkpoint(source, embedder, *LAYOUTS[layout])
    weights["model.language_model.embed_tokens.weight"] = mx.zeros((8, 64))  # other graphs' keys are ignored
    tower, loaded_embedder = Gemma4VisionTower(config), Gemma4MultimodalEmbedder(32, 64, 1e-6)
    load_gemma4_vision_weights(tower, loaded_embedder, weights)
    for (name, want), (_, got) in zip(tree_flatten(source.parameters()), tree_flatten(tower.parameters())):
        assert mx.array_equal(want, got), name
    assert mx.array_equal(embedder.embedding_projection.weight, loaded_embedder.embedding_projection.weight)


def test_bare_tower_checkpoint():
    """transformers' Gemma4VisionModel.save_pretrained writes the tower's names without a prefix."""
    source = random_tower(tiny_config())
    tower = Gemma4VisionTower(tiny_config())
    load_gemma4_vision_weights(tower, None, checkpoint(source, tower_prefix=""))
    assert mx.array_equal(tower.patch_embedder.input_proj.weight, source.patch_embedder.input_proj.weight)


def _mapping_error(weights, config, embedder=True):
    expected_tower = {k: v.shape for k, v in tree_flatten(Gemma4VisionTower(config).parameters())}
    expected_embedder = {k: v.shape for k, v in tree_flatten(Gemma4MultimodalEmbedder(32, 64, 1e-6).parameters())}
    with pytest.raises(ValueError) as info:
        map_gemma4_vision_weights(weights, expected_tower, expected_embedder if embedder else None, clipped=config.use_clipped_linears)
    return str(info.value)


def test_unexpected_key():
    weights = checkpoint(random_tower(tiny_config()), Gemma4MultimodalEmbedder(32, 64, 1e-6))
    weights["model.vision_tower.encoder.layers.0.self_attn.q_proj.bias"] = mx.zeros((32,))
    assert _mapping_error(weights, tiny_config()) == (
        "gemma4 vision keys: unexpected key 'model.vision_tower.encoder.layers.0.self_attn.q_proj.bias' "
        "(no parameter 'encoder.layers.0.self_attn.q_proj.bias' in the vision tower)"
    )


def test_std_buffers_without_standardize_are_unexpected():
    weights = checkpoint(random_tower(tiny_config(standardize=True)), Gemma4MultimodalEmbedder(32, 64, 1e-6))
    assert "unexpected key 'model.vision_tower.std_bias'" in _mapping_error(weights, tiny_config())


def test_missing_keys_are_listed():
    weights = checkpoint(random_tower(tiny_config(standardize=True)), Gemma4MultimodalEmbedder(32, 64, 1e-6))
    del weights["model.vision_tower.std_scale"], weights["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"]
    assert _mapping_error(weights, tiny_config(standardize=True)) == (
        "gemma4 vision keys: the checkpoint lacks 2 vision tower parameters: "
        "'model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight', 'model.vision_tower.std_scale'"
    )


def test_missing_embedder():
    weights = checkpoint(random_tower(tiny_config()))
    assert "no vision embedder weights in the checkpoint" in _mapping_error(weights, tiny_config())


def test_no_vision_tower():
    message = _mapping_error({"model.language_model.norm.weight": mx.ones((64,))}, tiny_config())
    assert message.startswith("gemma4 vision keys: no vision tower weights in the checkpoint (looked for ")


def test_shape_mismatch_names_both_shapes():
    weights = checkpoint(random_tower(tiny_config()), Gemma4MultimodalEmbedder(32, 64, 1e-6))
    weights["model.embed_vision.embedding_projection.weight"] = mx.zeros((48, 32))
    assert _mapping_error(weights, tiny_config()) == (
        "gemma4 vision keys: 'model.embed_vision.embedding_projection.weight' has shape [48, 32] in the "
        "checkpoint, the vision embedder expects [64, 32]"
    )
    weights = checkpoint(random_tower(tiny_config(position_embedding_size=32)), Gemma4MultimodalEmbedder(32, 64, 1e-6))
    assert "'model.vision_tower.patch_embedder.position_embedding_table' has shape [2, 32, 32] in the checkpoint, " \
           "the vision tower expects [2, 64, 32]" in _mapping_error(weights, tiny_config())  # fmt: skip


def test_stray_scales_are_refused_by_name():
    """Scales that fit no weight of the tower (here: the wrong number of rows) are unexpected keys;
    packed weights that do fit load quantized (tests/test_quantized_weights.py)."""
    weights = checkpoint(random_tower(tiny_config()), Gemma4MultimodalEmbedder(32, 64, 1e-6), "vision_tower.", "embed_vision.")
    weights["vision_tower.encoder.layers.0.mlp.up_proj.linear.scales"] = mx.zeros((63, 1))
    assert _mapping_error(weights, tiny_config()) == (
        "gemma4 vision keys: unexpected key 'vision_tower.encoder.layers.0.mlp.up_proj.linear.scales' "
        "(no parameter 'encoder.layers.0.mlp.up_proj.linear.scales' in the vision tower)"
    )


def test_clip_bounds_are_dropped_when_the_config_has_them_off(caplog):
    """What transformers does too: the config decides; finite bounds get a warning, infinite ones do not."""
    source = random_tower(tiny_config())
    weights = checkpoint(source, Gemma4MultimodalEmbedder(32, 64, 1e-6))
    weights["model.vision_tower.encoder.layers.0.self_attn.q_proj.input_min"] = mx.array(-math.inf)
    weights["model.vision_tower.encoder.layers.0.self_attn.q_proj.input_max"] = mx.array(2.0)
    weights["model.vision_tower.rotary_emb.inv_freq"] = mx.ones((4,))
    tower = Gemma4VisionTower(tiny_config())
    with caplog.at_level(logging.WARNING, logger="weights.gemma4_vision_keys"):
        load_gemma4_vision_weights(tower, Gemma4MultimodalEmbedder(32, 64, 1e-6), weights)
    assert "ignoring finite clip bound model.vision_tower.encoder.layers.0.self_attn.q_proj.input_max" in caplog.text
    assert "q_proj.input_min" not in caplog.text
    assert mx.array_equal(tower.encoder.layers[0].mlp.up_proj.linear.weight, source.encoder.layers[0].mlp.up_proj.linear.weight)


# ---------------------------------------------------------------------------------------------
# The tower's input checks


@pytest.fixture(scope="module")
def tower():
    return random_tower(tiny_config())


def test_output_shapes(tower):
    processed = image()  # 100x150 @ 70 -> 18x30 patches -> 6x10 cells
    assert processed.grid == (18, 30)
    assert tower(processed.patches, processed.position_ids).shape == (60, 32)
    batch = np.stack([processed.patches, processed.patches])
    assert tower(batch, processed.position_ids).shape == (2, 60, 32)
    assert tower(batch, np.stack([processed.position_ids] * 2)).shape == (2, 60, 32)
    assert tower(mx.array(processed.patches), mx.array(processed.position_ids)).shape == (60, 32)


def test_patch_width_must_match(tower):
    with pytest.raises(ValueError, match=re.escape("patches must be [L, 768] or [B, L, 768] with L > 0, got [9, 700]")):
        tower(np.zeros((9, 700), np.float32), np.zeros((9, 2), np.int32))
    with pytest.raises(ValueError, match=re.escape("got [0, 768]")):
        tower(np.zeros((0, 768), np.float32), np.zeros((0, 2), np.int32))


def test_position_ids_must_match_patches(tower):
    processed = image()
    with pytest.raises(ValueError, match=re.escape("position_ids must be [540, 2] for patches [540, 768], got [539, 2]")):
        tower(processed.patches, processed.position_ids[:-1])


@pytest.mark.parametrize("corrupt", ["padded", "permuted", "transposed"])
def test_position_ids_must_be_the_row_major_grid(tower, corrupt):
    processed = image()
    patches, positions = processed.patches, processed.position_ids.copy()
    if corrupt == "padded":  # transformers' padding rows: the tower runs unpadded
        patches = np.concatenate([patches, np.zeros((9, 768), np.float32)])
        positions = np.concatenate([positions, -np.ones((9, 2), np.int32)])
    elif corrupt == "permuted":
        positions[[0, 1]] = positions[[1, 0]]
    else:
        positions = positions[:, ::-1]
    with pytest.raises(ValueError, match="position_ids must be the row-major .* patch grid"):
        tower(patches, positions)


def test_grid_must_divide_into_pooling_cells(tower):
    """mlx-vlm pools a ragged grid silently (a 14x14 grid gives cells of 4 to 15 patches)."""
    ys, xs = np.divmod(np.arange(14 * 14, dtype=np.int32), 14)
    with pytest.raises(ValueError, match="the patch grid 14x14 does not divide into 3x3 pooling cells"):
        tower(np.zeros((196, 768), np.float32), np.stack([xs, ys], axis=1))


def test_grid_must_fit_the_position_table(tower):
    """MLX indexing does not bounds-check: a grid wider than the table would read garbage."""
    wide = Gemma4ImageProcessor(70)(np.zeros((10, 2000, 3), np.uint8))[0]  # 3 x 210 patches, table of 64
    with pytest.raises(ValueError, match="the patch grid 3x210 exceeds the position embedding table .64 positions per axis."):
        tower(wide.patches, wide.position_ids)


# ---------------------------------------------------------------------------------------------
# Pooling order and encode_images


def test_pooling_is_row_major_over_cells_on_a_non_square_grid():
    """Feed the pooler each patch's own (x, y): cell means must be the cell centres, row by row."""
    tower = Gemma4VisionTower(tiny_config())
    rows, cols = 6, 9
    ys, xs = np.divmod(np.arange(rows * cols), cols)
    hidden = np.zeros((1, rows * cols, 32), np.float32)
    hidden[0, :, 0], hidden[0, :, 1] = xs, ys
    pooled = np.array(tower._pool(mx.array(hidden), rows, cols))[0]
    centres = [(3 * c + 1, 3 * r + 1) for r in range(rows // 3) for c in range(cols // 3)]
    np.testing.assert_allclose(pooled[:, :2], centres)


def test_encode_images_keeps_input_order_and_batches_equal_grids():
    config = tiny_config()
    tower, embedder = random_tower(config), Gemma4MultimodalEmbedder(32, 64, 1e-6)
    images = [image(100, 150, seed=1), image(300, 100, seed=2), image(100, 150, seed=3), image(64, 64, seed=4), image(100, 150, seed=5)]
    pairs = [(p.patches, p.position_ids) for p in images]
    together = encode_images(tower, embedder, pairs, max_batch=2)
    assert [tuple(t.shape) for t in together] == [(p.num_soft_tokens, 64) for p in images]
    for got, (patches, positions) in zip(together, pairs):
        alone = embedder(tower(patches, positions))
        assert float(mx.abs(got - alone).max()) < 1e-5


def test_embedder_is_weightless_norm_then_projection():
    embedder = Gemma4MultimodalEmbedder(32, 64, 1e-6)
    embedder.embedding_projection.weight = mx.random.normal((64, 32), key=mx.random.key(0))
    features = mx.random.normal((5, 32), key=mx.random.key(1)) * 7.0
    rms = features / mx.sqrt(mx.mean(features * features, axis=-1, keepdims=True) + 1e-6)
    want = rms @ embedder.embedding_projection.weight.T
    assert float(mx.abs(embedder(features) - want).max()) < 1e-4
    assert [name for name, _ in tree_flatten(embedder.parameters())] == ["embedding_projection.weight"]
