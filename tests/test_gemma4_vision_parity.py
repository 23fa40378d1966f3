"""The MLX vision tower and embedder against transformers (the reference), fp32, random tiny weights.

transformers builds each tiny model (``tests.hf_tiny``'s T5 and T6, plus variants), every
parameter and buffer gets seeded random values (the default init leaves norms, position tables and
clip bounds at constants, which would hide mistakes in them), ``save_pretrained`` writes it, and our
graph loads those files. transformers runs its own processor's padded batch; we run the same images
unpadded, one grid at a time. The soft-token features must agree to 1e-4.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from graphs.gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images  # noqa: E402
from graphs.gemma4_vision_config import Gemma4VisionConfig  # noqa: E402
from models.processing.image_processor import Gemma4ImageProcessor  # noqa: E402
from tests.hf_tiny import T5_TEXT, T5_TOKENS, T5_VISION, read_config, read_safetensors  # noqa: E402
from tests.test_image_processor import photos  # noqa: E402,F401  (a fixture)
from models.registry import load_gemma4_vision_weights  # noqa: E402

HFProcessor = transformers.models.gemma4.image_processing_pil_gemma4.Gemma4ImageProcessorPil
TOL = 1e-4

T6 = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
          head_dim=16, position_embedding_size=64, use_clipped_linears=True, standardize=True)  # fmt: skip
TOWER_CONFIGS = {
    "T6": T6,  # clip bounds on every projection, std_bias / std_scale
    "T5_vision": T5_VISION,  # neither
    "gqa_2_layers": dict(T6, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, standardize=False),
    "clipped_only": dict(T5_VISION, use_clipped_linears=True),
    "standardize_only": dict(T5_VISION, standardize=True),
}

# (height, width): non-square both ways, a square, and sizes that need up- and down-scaling
SYNTHETIC = [(100, 150), (300, 100), (64, 64), (47, 48), (700, 400)]


def randomize(module, seed: int) -> None:
    """Seeded random values for every saved parameter and buffer.

    Clip bounds land at ±(1..1.5), so many activations really are clamped. Projections get unit-scale
    outputs; the post-norms (what each layer adds to the residual) and the q/k norms get weights around
    0.5. That keeps the features within about ±40 and the attention soft: with weights around 1,
    near-one-hot attention on flat photos (coins.png) amplified fp32 rounding tenfold in the second
    layer, for transformers as for us (MLX's CPU ``exp`` and matmul are a few ulps less precise than
    torch's), and the tolerance is absolute. Mutations (x/y swapped, rotate_half over the whole head,
    column-major pooling, no v norm) still move the features by 0.7 to 25.
    """
    generator = torch.Generator().manual_seed(seed)

    def randn(t):
        return torch.randn(t.shape, generator=generator, dtype=t.dtype)

    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if "inv_freq" in name:  # non-persistent, recomputed
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("input_min", "output_min", "input_max", "output_max"):
                magnitude = 1.0 + 0.5 * float(torch.rand((), generator=generator))
                tensor.fill_(-magnitude if leaf.endswith("min") else magnitude)
            elif any(part in name for part in ("post_attention_layernorm", "post_feedforward_layernorm", "q_norm", "k_norm")):
                tensor.copy_(0.5 + 0.15 * randn(tensor))
            elif "norm" in name or leaf == "std_scale":
                tensor.copy_(1.0 + 0.3 * randn(tensor))
            elif leaf in ("std_bias", "position_embedding_table"):
                tensor.copy_(0.3 * randn(tensor))
            else:
                tensor.copy_(randn(tensor) / math.sqrt(tensor.shape[-1]))


def hf_features(model, images, budget, pooling_kernel_size=3):
    """transformers' per-image soft-token features from its own padded batch."""
    batch = HFProcessor(max_soft_tokens=budget, pooling_kernel_size=pooling_kernel_size)(images=images, return_tensors="pt")
    with torch.no_grad():
        flat = model(pixel_values=batch["pixel_values"], pixel_position_ids=batch["image_position_ids"]).last_hidden_state
    return [t.numpy() for t in torch.split(flat, batch["num_soft_tokens_per_image"].tolist())]


def worst(ours: mx.array, reference: np.ndarray) -> float:
    assert tuple(ours.shape) == reference.shape
    return float(np.abs(np.array(ours) - reference).max())


def synthetic_images():
    rng = np.random.default_rng(0)
    images = []
    for height, width in SYNTHETIC:
        # smooth structure plus noise, so that pooling order and positions matter
        ys, xs = np.mgrid[0:height, 0:width]
        base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) * 127 / (width + height)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8)
        images.append(Image.fromarray(pixels))
    return images


@pytest.fixture(scope="module", params=sorted(TOWER_CONFIGS))
def tower_pair(request, tmp_path_factory):
    """(transformers Gemma4VisionModel, our tower loaded from its save_pretrained files)."""
    from transformers import Gemma4VisionConfig as HFVisionConfig
    from transformers import Gemma4VisionModel

    torch.manual_seed(0)
    reference = Gemma4VisionModel(HFVisionConfig(**TOWER_CONFIGS[request.param])).eval()
    randomize(reference, seed=1)
    directory = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(directory)
    ours = Gemma4VisionTower(Gemma4VisionConfig.from_dict(read_config(directory)))
    load_gemma4_vision_weights(ours, None, read_safetensors(directory))
    return reference, ours


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    """T5 ``Gemma4ForConditionalGeneration`` with random vision tower and embedder, and ours from its files."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    config = Gemma4Config(text_config=T5_TEXT, vision_config=T5_VISION, audio_config=None, **T5_TOKENS)
    reference = Gemma4ForConditionalGeneration(config).eval()
    randomize(reference.model.vision_tower, seed=2)
    randomize(reference.model.embed_vision, seed=3)
    directory = tmp_path_factory.mktemp("t5")
    reference.save_pretrained(directory)

    raw = read_config(directory)
    vision_config = Gemma4VisionConfig.from_dict(raw)
    tower = Gemma4VisionTower(vision_config)
    embedder = Gemma4MultimodalEmbedder(vision_config.hidden_size, raw["text_config"]["hidden_size"], vision_config.rms_norm_eps)
    load_gemma4_vision_weights(tower, embedder, read_safetensors(directory))
    return reference, tower, embedder


# ---------------------------------------------------------------------------------------------


def test_tower_synthetic_images(tower_pair):
    reference, ours = tower_pair
    images = synthetic_images()
    expected = hf_features(reference, images, 70)
    for image, want in zip(images, expected):
        got = Gemma4ImageProcessor(70)(image)[0]
        assert worst(ours(got.patches, got.position_ids), want) <= TOL, image.size


@pytest.mark.slow
def test_tower_real_photos(tower_pair, photos):
    reference, ours = tower_pair
    images = [Image.open(photos[name]) for name in sorted(photos)]
    expected = hf_features(reference, images, 70)
    for name, image, want in zip(sorted(photos), images, expected):
        got = Gemma4ImageProcessor(70, exif_transpose=False)(image)[0]
        assert worst(ours(got.patches, got.position_ids), want) <= TOL, name


def test_tower_batch_of_equal_grids(tower_pair):
    reference, ours = tower_pair
    first = synthetic_images()[0]
    images = [first, first.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    expected = hf_features(reference, images, 70)
    processed = Gemma4ImageProcessor(70)(images)
    batched = ours(np.stack([p.patches for p in processed]), processed[0].position_ids)
    assert batched.shape == (2, 60, reference.config.hidden_size)
    for row, want in enumerate(expected):
        assert worst(batched[row], want) <= TOL


def test_t5_features_and_embedder(t5):
    """Gemma4Model.get_image_features (tower + embed_vision, per image) against encode_images."""
    reference, tower, embedder = t5
    images = synthetic_images()
    batch = HFProcessor(max_soft_tokens=70)(images=images, return_tensors="pt")
    with torch.no_grad():
        out = reference.model.get_image_features(batch["pixel_values"], batch["image_position_ids"])
    processed = Gemma4ImageProcessor(70)(images)
    ours = encode_images(tower, embedder, [(p.patches, p.position_ids) for p in processed])
    assert [int(o.shape[0]) for o in ours] == batch["num_soft_tokens_per_image"].tolist()
    for got, want in zip(ours, out.pooler_output):
        assert worst(got, want.numpy()) <= TOL
    # the tower alone too (before the embedder)
    tower_flat = np.concatenate([np.array(tower(p.patches, p.position_ids)) for p in processed])
    assert worst(mx.array(tower_flat), out.last_hidden_state.numpy()) <= TOL


@pytest.mark.slow
def test_t5_real_photos_and_a_large_grid(t5, photos):
    reference, tower, embedder = t5
    for budget, names in ((70, sorted(photos)), (280, ["astronaut.png", "retina.jpg"])):  # 280: 48x48 patches
        images = [Image.open(photos[n]) for n in names]
        batch = HFProcessor(max_soft_tokens=budget)(images=images, return_tensors="pt")
        with torch.no_grad():
            out = reference.model.get_image_features(batch["pixel_values"], batch["image_position_ids"])
        processed = Gemma4ImageProcessor(budget, exif_transpose=False)(images)
        ours = encode_images(tower, embedder, [(p.patches, p.position_ids) for p in processed])
        for name, got, want in zip(names, ours, out.pooler_output):
            assert worst(got, want.numpy()) <= TOL, f"{name} @ {budget}"


# DiffusionGemma T7 (``tests.diffusion_tiny``): the same tower under model.encoder.vision_tower.
T7_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, sliding_window=4,
               layer_types=["sliding_attention"] * 3 + ["full_attention"], num_experts=4, top_k_experts=2,
               moe_intermediate_size=32, use_bidirectional_attention="vision", pad_token_id=0, bos_token_id=2,
               eos_token_id=1, initializer_range=0.15)  # fmt: skip
T7_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=16, patch_size=16, pooling_kernel_size=3, position_embedding_size=64)  # fmt: skip


def test_diffusion_gemma_vision_encoder(tmp_path):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    config = DiffusionGemmaConfig(text_config=T7_TEXT, vision_config=T7_VISION, canvas_length=8, boi_token_id=250,
                                  eoi_token_id=252, image_token_id=251)  # fmt: skip
    reference = DiffusionGemmaForBlockDiffusion(config).eval()
    encoder = reference.model.encoder
    randomize(encoder.vision_tower, seed=5)
    randomize(encoder.embed_vision, seed=6)
    reference.save_pretrained(tmp_path)

    raw = read_config(tmp_path)
    vision_config = Gemma4VisionConfig.from_dict(raw)
    tower = Gemma4VisionTower(vision_config)
    embedder = Gemma4MultimodalEmbedder(vision_config.hidden_size, raw["text_config"]["hidden_size"], vision_config.rms_norm_eps)
    load_gemma4_vision_weights(tower, embedder, read_safetensors(tmp_path))

    images = synthetic_images()
    expected = hf_features(encoder.vision_tower, images, 70)
    processed = Gemma4ImageProcessor(70)(images)
    for got, want in zip(encode_images(tower, embedder, [(p.patches, p.position_ids) for p in processed]), expected):
        with torch.no_grad():
            want = encoder.embed_vision(torch.from_numpy(want)).numpy()
        assert worst(got, want) <= TOL


def test_clip_bounds_and_standardization_are_exercised(tmp_path):
    """The T6 parity above would not notice a tower that ignored its clip bounds or std buffers
    unless they change the output; they do, by far more than the tolerance."""
    from transformers import Gemma4VisionConfig as HFVisionConfig
    from transformers import Gemma4VisionModel

    torch.manual_seed(0)
    reference = Gemma4VisionModel(HFVisionConfig(**T6)).eval()
    randomize(reference, seed=1)
    reference.save_pretrained(tmp_path)
    weights = read_safetensors(tmp_path)
    image = Gemma4ImageProcessor(70)(synthetic_images()[0])[0]

    def features(**changes):
        config = Gemma4VisionConfig.from_dict(dict(read_config(tmp_path), **changes))
        tower = Gemma4VisionTower(config)
        kept = {k: v for k, v in weights.items() if config.standardize or not k.startswith("std_")}
        load_gemma4_vision_weights(tower, None, kept)
        return np.array(tower(image.patches, image.position_ids))

    full = features()
    assert np.abs(full - features(use_clipped_linears=False)).max() > 100 * TOL  # (warns: bounds ignored)
    assert np.abs(full - features(standardize=False)).max() > 100 * TOL


def test_no_pooling_keeps_every_patch(tmp_path):
    """pooling_kernel_size=1: one feature per patch. transformers' no-pool branch selects rows by
    the *padding* mask, so it returns the padding rows instead of the image's (mlx-vlm returns none);
    the reference here is therefore its encoder output on the valid rows, times sqrt(hidden)."""
    from transformers import Gemma4VisionConfig as HFVisionConfig
    from transformers import Gemma4VisionModel

    torch.manual_seed(0)
    reference = Gemma4VisionModel(HFVisionConfig(**dict(T5_VISION, pooling_kernel_size=1))).eval()
    randomize(reference, seed=4)
    reference.save_pretrained(tmp_path)
    ours = Gemma4VisionTower(Gemma4VisionConfig.from_dict(read_config(tmp_path)))
    load_gemma4_vision_weights(ours, None, read_safetensors(tmp_path))

    image = synthetic_images()[0]
    batch = HFProcessor(max_soft_tokens=70, pooling_kernel_size=1)(images=[image], return_tensors="pt")
    valid = (batch["image_position_ids"][0] != -1).all(-1)
    with torch.no_grad():
        returned = reference(batch["pixel_values"], batch["image_position_ids"]).last_hidden_state
        assert 0 < returned.shape[0] == int((~valid).sum())  # the padding rows
        embedded = reference.patch_embedder(batch["pixel_values"], batch["image_position_ids"], ~valid[None])
        encoded = reference.encoder(embedded, valid[None], pixel_position_ids=batch["image_position_ids"])
    want = (encoded.last_hidden_state[0][valid] * math.sqrt(T5_VISION["hidden_size"])).numpy()

    processed = Gemma4ImageProcessor(70, pooling_kernel_size=1)(image)[0]
    got = ours(processed.patches, processed.position_ids)
    assert got.shape[0] == processed.num_soft_tokens == len(processed.patches) == int(valid.sum())
    assert worst(got, want) <= TOL
