"""The DiffusionGemma graph against transformers 5.24 on tiny random checkpoints it saved (fp32).

For each case the encoder appends a prompt and then committed blocks (teacher-forced: the same
ids on both sides); after every append the cache contents (sliding layers: the newest
``window - 1`` positions the reference keeps) and the decoder's logits for a canvas, with and
without self-conditioning, must equal transformers' to 1e-4. Prompts are shorter and longer than
the window, with and without an image (whose span is longer than the window, so the encoder's
image overlay, which the window does not limit, matters).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from graphs.diffusion_gemma import DiffusionGemmaModel  # noqa: E402
from models.processing.image_processor import Gemma4ImageProcessor  # noqa: E402
from tests import diffusion_tiny as tiny  # noqa: E402

TOL = 1e-4
C = 8  # canvas_length of the tiny configs
IMAGE = 251


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with tiny.one_torch_thread():
        yield


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (transformers model, our model loaded from its files), built once per module."""
    built = {}

    def get(name):
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            built[name] = tiny.save_diffusion(name, directory), tiny.load_ours(directory)
        return built[name]

    return get


def image():
    rng = np.random.default_rng(1)
    ys, xs = np.mgrid[0:100, 0:150]
    base = np.stack([xs * 255 / 150, ys * 255 / 100, (xs + ys) * 0.5], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))


def image_prompt(num_image_tokens: int, before: int = 5, after: int = 4, batch: int = 1) -> np.ndarray:
    rng = np.random.default_rng(2)
    rows = []
    for _ in range(batch):
        rows.append([*rng.integers(3, 250, before), 250, *[IMAGE] * num_image_tokens, 252, *rng.integers(3, 250, after)])
    return np.array(rows)


def compare_caches(hf_cache, ours) -> float:
    worst = 0.0
    for layer, ours_layer in zip(hf_cache.layers, ours):
        keys, values = ours_layer.temporal()
        n = layer.keys.shape[2]
        assert keys.shape[2] >= n  # we may keep more (trim slack), never less
        worst = max(worst, float(np.abs(np.array(keys)[:, :, -n:] - layer.keys.numpy()).max()))
        worst = max(worst, float(np.abs(np.array(values)[:, :, -n:] - layer.values.numpy()).max()))
    return worst


def check_decoder(hf, ours, hf_cache, cache, position: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    B = cache[0].temporal()[0].shape[0]
    canvas = rng.integers(0, 256, (B, C))
    self_conditioning = (rng.normal(size=(B, C, 256)) * 4).astype(np.float32)
    for sc in (None, self_conditioning):
        want = tiny.hf_decode(hf, canvas, hf_cache, position, sc)
        got = np.array(ours.denoise(mx.array(canvas), cache, None if sc is None else mx.array(sc)))
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= TOL, f"decoder logits at position {position}, sc={sc is not None}"


def run_blocks(hf, ours, prompt: np.ndarray, *, images=None, hf_images=None, blocks: int = 3, prefill_step=None):
    """Prompt then ``blocks`` committed blocks on both sides; caches and logits checked after each append."""
    from models.generation.diffusion import _encode_prompt

    hf_cache = tiny.hf_encode(hf, prompt, None, image_inputs=hf_images)
    cache = ours.make_cache()
    features = ours.image_features(images) if images else []
    _encode_prompt(ours, prompt, cache, features, prefill_step or prompt.shape[1])
    position = prompt.shape[1]
    rng = np.random.default_rng(3)
    for block in range(blocks + 1):
        assert cache[0].offset == position
        assert compare_caches(hf_cache, cache) <= TOL, f"cache after block {block}"
        check_decoder(hf, ours, hf_cache, cache, position, seed=block)
        committed = rng.integers(0, 256, (prompt.shape[0], C))
        tiny.hf_encode(hf, committed, hf_cache, start=position)
        ours.prefill(mx.array(committed), cache)
        position += C
    return cache


@pytest.mark.parametrize(
    "name, length",
    [
        ("T7", 2),  # shorter than the window's history (W - 1 = 3)
        ("T7", 11),  # longer than the window
        ("T7_wide", 5),  # W = 16: shorter ...
        ("T7_wide", 40),  # ... and longer
        ("T7_gqa", 9),
        ("T7_pattern", 13),
    ],
)
def test_text_prompt_then_blocks(pairs, name, length):
    hf, ours = pairs(name)
    prompt = np.random.default_rng(length).integers(3, 250, (2, length))  # batch of 2
    run_blocks(hf, ours, prompt)


@pytest.mark.parametrize("step", [1, 3, 7])
def test_chunked_prefill_is_exact(pairs, step):
    """Appending the prompt in chunks (of 1, < W, > W) gives the reference's one-pass cache."""
    hf, ours = pairs("T7")
    prompt = np.random.default_rng(0).integers(3, 250, (1, 17))
    run_blocks(hf, ours, prompt, blocks=1, prefill_step=step)


@pytest.mark.parametrize("name", ["T7", "T7_no_overlay"])
def test_image_prompt(pairs, name):
    """An image of 60 soft tokens (span > window) in the prompt: the overlay (or, without it, plain
    causal attention) on full and sliding layers; chunked prefill never splits the image."""
    hf, ours = pairs(name)
    pictures = [image()]
    processed = Gemma4ImageProcessor(70)(pictures)
    prompt = image_prompt(processed[0].num_soft_tokens)
    images = [(p.patches, p.position_ids) for p in processed]
    run_blocks(hf, ours, prompt, images=images, hf_images=tiny.hf_image_inputs(pictures), blocks=1, prefill_step=8)


def test_image_overlay_matters(pairs):
    """The check above discriminates: without the overlay the same prompt's cache differs by far more than TOL."""
    hf, ours = pairs("T7")
    pictures = [image()]
    processed = Gemma4ImageProcessor(70)(pictures)
    prompt = image_prompt(processed[0].num_soft_tokens)
    hf_cache = tiny.hf_encode(hf, prompt, None, image_inputs=tiny.hf_image_inputs(pictures))
    config = replace(ours.config, text=replace(ours.config.text, use_bidirectional_attention=None))
    causal = DiffusionGemmaModel(config)
    causal.update(ours.parameters())
    cache = causal.make_cache()
    causal.prefill(mx.array(prompt), cache, causal.image_features([(p.patches, p.position_ids) for p in processed]))
    assert compare_caches(hf_cache, cache) > 100 * TOL


def test_two_images_batch_of_two(pairs):
    """Two rows, each with an image: features are placed row-major, each image is its own block."""
    hf, ours = pairs("T7")
    pictures = [image(), image().transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    processed = Gemma4ImageProcessor(70)(pictures)
    prompt = image_prompt(processed[0].num_soft_tokens, batch=2)
    images = [(p.patches, p.position_ids) for p in processed]
    run_blocks(hf, ours, prompt, images=images, hf_images=tiny.hf_image_inputs(pictures), blocks=1)


def test_layer_scalars_are_separate(pairs):
    """Encoder and decoder scalars were randomized independently; both were loaded where they belong."""
    hf, ours = pairs("T7")
    for layer, (ours_layer, hf_encoder_layer, hf_decoder_layer) in enumerate(
        zip(ours.layers, hf.model.encoder.language_model.layers, hf.model.decoder.layers)
    ):
        assert float(ours_layer.encoder_layer_scalar[0]) == pytest.approx(float(hf_encoder_layer.layer_scalar))
        assert float(ours_layer.layer_scalar[0]) == pytest.approx(float(hf_decoder_layer.layer_scalar))
        assert float(hf_encoder_layer.layer_scalar) != float(hf_decoder_layer.layer_scalar)
