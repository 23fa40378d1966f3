"""Gemma 4 with images against transformers' ``Gemma4ForConditionalGeneration`` (fp32, tiny random weights).

The checkpoints are T5 (``tests.hf_tiny``: vision tower, PLE, sliding window
4, so every image is far longer than the window) with stronger random weights, in three text
variants: vision bidirectionality (sliding layers see the whole image), none (plain causal), and
vision bidirectionality with KV-shared layers (the shared layers replay the donors' image masks).
transformers runs its own processor's padded batch, with ``mm_token_type_ids`` so that it applies
the image mask; we run ``models.load`` on the files it saved. The vocabulary is 512, so the image
ids are the config's (boi 300, image 301, eoi 302), not the released tokenizer's.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from models.generation.chat import image_safe_prefix  # noqa: E402
from models.generation.generate import generate_tokens, prefill  # noqa: E402
from models.generation.prompts import ImageSpan, Prompt, prefill_chunks  # noqa: E402
from tests.hf_tiny import F, S, T5_TEXT, T5_TOKENS, T5_VISION, read_safetensors  # noqa: E402
from tests.test_gemma4_vision_parity import randomize, synthetic_images  # noqa: E402

HFProcessor = transformers.models.gemma4.image_processing_pil_gemma4.Gemma4ImageProcessorPil
TOL = 1e-4
BUDGET = 70
IMAGE, BOI, EOI = T5_TOKENS["image_token_id"], T5_TOKENS["boi_token_id"], T5_TOKENS["eoi_token_id"]

TEXT_VARIANTS = {
    "vision": dict(T5_TEXT, initializer_range=0.15),
    "causal": dict(T5_TEXT, initializer_range=0.15, use_bidirectional_attention=None),
    "vision_kv_shared": dict(T5_TEXT, initializer_range=0.15, layer_types=[S, F, S, F], num_kv_shared_layers=2),
}
# Text around two image placeholders: ids below the image ids, above the special ones.
PROMPT_TWO = [2, 10, 11, IMAGE, 12, 13, 14, IMAGE, 15, 16, 17]
PROMPT_ONE = [2, 20, 21, 22, IMAGE, 23, 24, 25, 26]


def save_multimodal(directory, text_config: dict, seed: int = 0):
    """``Gemma4ForConditionalGeneration`` with random text (std 0.15) and a randomized vision tower, saved."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma4Config(text_config=text_config, vision_config=T5_VISION, audio_config=None,
                          initializer_range=0.15, **T5_TOKENS)  # fmt: skip
    reference = Gemma4ForConditionalGeneration(config).eval()
    randomize(reference.model.vision_tower, seed=seed + 2)
    randomize(reference.model.embed_vision, seed=seed + 3)
    reference.save_pretrained(directory)
    return reference


@pytest.fixture(scope="module", params=sorted(TEXT_VARIANTS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = save_multimodal(directory, TEXT_VARIANTS[request.param])
    return request.param, reference, models.load(str(directory), tokenizer=False), directory


@pytest.fixture(scope="module")
def vision_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision")
    reference = save_multimodal(directory, TEXT_VARIANTS["vision"])
    return reference, models.load(str(directory), tokenizer=False), directory


@pytest.fixture(scope="module")
def images():
    """Two synthetic images of different shapes: 60 and 56 soft tokens at budget 70."""
    return synthetic_images()[:2]


def hf_logits(reference, prompt: Prompt, images, image_mask: bool = True) -> np.ndarray:
    batch = HFProcessor(max_soft_tokens=BUDGET)(images=images, return_tensors="pt")
    assert batch["num_soft_tokens_per_image"].tolist() == [s.end - s.start for s in prompt.images]
    ids = torch.tensor([prompt.ids])
    extra = {"mm_token_type_ids": (ids == IMAGE).long()} if image_mask else {}
    with torch.no_grad():
        return reference(
            input_ids=ids, pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"], **extra
        ).logits.numpy()


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


# ------------------------------------------------------------------------------ parity


@pytest.mark.parametrize("count", [1, 2])
def test_logits_equal_transformers(pair, images, count):
    variant, reference, model, _ = pair
    prompt = model.prompt(PROMPT_ONE if count == 1 else PROMPT_TWO, images[:count], BUDGET)
    assert [(s.start, s.end) for s in prompt.images][:1] == [(5, 65) if count == 1 else (4, 64)]
    want = hf_logits(reference, prompt, images[:count])
    assert worst(model.logits(prompt), want) < TOL
    if variant != "causal":
        # The comparison discriminates: without the image mask the reference moves by far more.
        assert worst(hf_logits(reference, prompt, images[:count], image_mask=False), want) > 0.1


def test_image_features_reach_the_logits(vision_pair, images):
    """Features replace the image positions' embeddings and feed PLE: other features, other logits."""
    _, model, _ = vision_pair
    prompt = model.prompt(PROMPT_ONE, images[:1], BUDGET)
    other = Prompt(prompt.ids, (ImageSpan(5, 65, prompt.images[0].features[::-1]),))
    assert worst(model.logits(prompt)[0, -1], model.logits(other)[0, -1]) > 0.1


def test_greedy_generation_equals_transformers(pair, images):
    """Prefill with images in chunks, then decode: transformers' generate drops the image mask after prefill too."""
    _, reference, model, _ = pair
    prompt = model.prompt(PROMPT_TWO, images, BUDGET)
    ours = list(generate_tokens(model.forward, prompt.ids, model.make_cache(), max_tokens=12, prefill_step_size=7,
                                images=prompt.images))  # fmt: skip
    batch = HFProcessor(max_soft_tokens=BUDGET)(images=images, return_tensors="pt")
    ids = torch.tensor([prompt.ids])
    pixels = dict(pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"])
    with torch.no_grad():
        out = reference.generate(input_ids=ids, **pixels, mm_token_type_ids=(ids == IMAGE).long(), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None)  # fmt: skip
    assert ours == out[0, len(prompt.ids):].tolist()


def test_bfloat16_weights_read_images(vision_pair, images):
    """With bf16 weights the features and the decoder run in bf16; the features differ from fp32 by
    bf16 rounding (transformers' own bf16 features differ from its fp32 ones by about 0.04 here)."""
    _, model, directory = vision_pair
    half = models.load(str(directory), dtype="bfloat16", tokenizer=False)
    prompt = half.prompt(PROMPT_TWO, images, BUDGET)
    reference = model.prompt(PROMPT_TWO, images, BUDGET)
    for ours, full in zip(prompt.images, reference.images):
        assert ours.features.dtype == mx.bfloat16
        assert worst(ours.features.astype(mx.float32), full.features) < 0.1
    logits = half.logits(prompt)
    assert logits.dtype == mx.bfloat16 and bool(mx.isfinite(logits).all())


# ------------------------------------------------------------------------------ cache


def chunked_logits(model, prompt: Prompt, step: int, cache) -> np.ndarray:
    """Every position's logits, fed to ``cache`` in the prefill's own chunks."""
    pieces = []
    for start, end in prefill_chunks(len(prompt.ids), prompt.images, step):
        inside = [s.features for s in prompt.images if start <= s.start < end]
        extra = {"image_features": mx.concatenate(inside)} if inside else {}
        pieces.append(np.array(model.forward(mx.array([prompt.ids[start:end]]), cache, **extra)))
    return np.concatenate(pieces, axis=1)


@pytest.mark.parametrize("step", [1, 5, 7, 61, 1000])
def test_cached_prefill_equals_one_read(pair, images, step):
    """Chunks of 5 and 7 end inside both images (their boundaries move), 61 splits the second, 1 makes
    every image a read of its own; all must equal one no-cache read."""
    variant, _, model, _ = pair
    prompt = model.prompt(PROMPT_TWO + [30, 31, 32, 33, 34, 35], images, BUDGET)
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    assert worst(chunked_logits(model, prompt, step, cache), whole) < TOL
    assert cache[0].offset == len(prompt.ids)
    fresh = model.make_cache()
    last = prefill(model.forward, prompt.ids, fresh, step, prompt.images)
    assert worst(last, whole[0, -1]) < TOL


def test_teacher_forced_decode_after_an_image_prompt(pair, images):
    """After an image prefill, 24 decode steps (past every window) equal the no-cache forward."""
    _, _, model, _ = pair
    prompt = model.prompt(PROMPT_TWO, images, BUDGET)
    continuation = np.random.default_rng(0).integers(3, 290, 24).tolist()
    full = Prompt(prompt.ids + continuation, prompt.images)
    whole = np.array(model.logits(full))
    cache = model.make_cache()
    prefill(model.forward, prompt.ids, cache, 16, prompt.images)
    steps = [np.array(model.forward(mx.array([[t]]), cache))[0, 0] for t in continuation]
    assert worst(np.stack(steps[:-1]), whole[0, len(prompt.ids) : -1]) < TOL


def test_text_chunk_after_cached_images_and_images_after_cached_text(vision_pair, images):
    """Text after an image, then an image after text, in separate reads: equals one read."""
    _, model, _ = vision_pair
    prompt = model.prompt(PROMPT_TWO, images, BUDGET)
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    second = prompt.images[1]
    first_part = Prompt(prompt.ids[: second.start], prompt.images[:1])
    rest = prompt.suffix(second.start)
    got = np.concatenate([np.array(model.logits(first_part, cache)), np.array(model.logits(rest, cache))], axis=1)
    assert worst(got, whole) < TOL


# ------------------------------------------------------------------------------ errors


def test_soft_token_mismatch_names_both_numbers(vision_pair, images):
    _, model, _ = vision_pair
    prompt = model.prompt(PROMPT_ONE, images[:1], BUDGET)  # 60 image tokens
    wrong = mx.zeros((56, 64))
    with pytest.raises(ValueError, match="the prompt has 60 image tokens, the images give 56 soft tokens"):
        model.forward(mx.array([prompt.ids]), model.make_cache(), image_features=wrong)
    with pytest.raises(ValueError, match=r"span \[5, 65\) holds 60 image tokens, but its features give 56"):
        ImageSpan(5, 65, wrong)


def test_placeholder_count_must_match_the_images(vision_pair, images):
    _, model, _ = vision_pair
    with pytest.raises(ValueError, match=r"1 image placeholder \(token 301\) but 2 images were given"):
        model.prompt(PROMPT_ONE, images, BUDGET)
    with pytest.raises(ValueError, match=r"2 image placeholders \(token 301\) but no images were given"):
        model.prompt(PROMPT_TWO)
    with pytest.raises(ValueError, match="max_soft_tokens must be one of"):
        model.prompt(PROMPT_ONE, images[:1], 100)


def test_a_read_that_splits_an_image_is_refused(vision_pair, images):
    _, model, _ = vision_pair
    prompt = model.prompt(PROMPT_ONE, images[:1], BUDGET)
    with pytest.raises(ValueError, match="falls inside the image at \\[5, 65\\)"):
        prompt.suffix(30)
    features = prompt.images[0].features
    cache = model.make_cache()
    model.forward(mx.array([prompt.ids[:30]]), cache, image_features=features[:25])
    with pytest.raises(ValueError, match="a span must be given in a single read"):
        model.forward(mx.array([prompt.ids[30:]]), cache, image_features=features[25:])


# ------------------------------------------------------------------------------ checkpoints


def copy_with_keys(source, target, rename) -> None:
    """``source``'s checkpoint with every key renamed (keys mapped to None are dropped)."""
    target.mkdir(exist_ok=True)
    weights = {}
    for key, value in read_safetensors(source).items():
        new = rename(key)
        if new is not None:
            weights[new] = value
    mx.save_safetensors(str(target / "model.safetensors"), weights, metadata={"format": "mlx"})
    shutil.copy(source / "config.json", target / "config.json")


def mlx_converter_key(key: str) -> str:
    """mlx-vlm's ``gemma4`` layout: ``language_model.model.*``, ``vision_tower.*``, ``embed_vision.*``."""
    if key.startswith("model.language_model."):
        return "language_model.model." + key.removeprefix("model.language_model.")
    return key.removeprefix("model.")


def test_mlx_converter_layout_loads_the_same_model(vision_pair, images, tmp_path):
    _, model, directory = vision_pair
    copy_with_keys(directory, tmp_path, mlx_converter_key)
    converted = models.load(str(tmp_path), tokenizer=False)
    assert converted.supports_images
    prompt = converted.prompt(PROMPT_TWO, images, BUDGET)
    assert worst(converted.logits(prompt), model.logits(model.prompt(PROMPT_TWO, images, BUDGET))) == 0.0


def test_checkpoint_without_the_tower_loads_as_text(vision_pair, tmp_path):
    """mlx-lm conversions keep the gemma4 config (vision_config included) and drop the tower."""
    _, model, directory = vision_pair
    copy_with_keys(directory, tmp_path, lambda k: k if k.startswith("model.language_model.") else None)
    text = models.load(str(tmp_path), tokenizer=False)
    assert not text.supports_images and type(text.graph).__name__ == "Gemma4TextModel"
    ids = [2, 40, 41, 42, 43]
    assert worst(text.logits(ids), model.logits(ids)) == 0.0
    with pytest.raises(ValueError, match="is a text model .* cannot read images"):
        text.prompt([2, IMAGE], [np.zeros((48, 48, 3), np.uint8)])


def test_gemma4_without_vision_config_is_a_text_model(tmp_path):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    text_config = TEXT_VARIANTS["causal"]
    reference = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text_config, vision_config=None, audio_config=None,
                                                             initializer_range=0.15)).eval()  # fmt: skip
    reference.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("vision_config") is None
    model = models.load(str(tmp_path), tokenizer=False)
    assert not model.supports_images
    ids = [[2, 40, 41, 42, 43, 44, 45]]
    with torch.no_grad():
        want = reference(input_ids=torch.tensor(ids)).logits.numpy()
    assert worst(model.logits(ids), want) < TOL


# ------------------------------------------------------------------------------ pure helpers


def spans(*bounds):
    return [ImageSpan(s, e, mx.zeros((e - s, 1))) for s, e in bounds]


def test_prefill_chunks_never_cut_an_image():
    images = spans((4, 64), (69, 125))
    assert prefill_chunks(130, images, 5) == [(0, 4), (4, 64), (64, 69), (69, 125), (125, 130)]
    assert prefill_chunks(130, images, 100) == [(0, 69), (69, 130)]
    assert prefill_chunks(130, images, 56) == [(0, 4), (4, 64), (64, 69), (69, 125), (125, 130)]
    assert prefill_chunks(130, images, 1000) == [(0, 130)]
    assert prefill_chunks(10, spans((0, 6)), 4) == [(0, 6), (6, 10)]
    for step in range(1, 140):
        bounds = prefill_chunks(130, images, step)
        assert bounds[0][0] == 0 and bounds[-1][1] == 130
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        assert not any(s.start < end < s.end for _, end in bounds for s in images)
    with pytest.raises(ValueError, match="ordered, separated"):
        prefill_chunks(130, spans((4, 64), (64, 70)), 5)


def test_image_safe_prefix_keeps_whole_identical_images():
    a, b = spans((4, 64), (69, 125))
    other = ImageSpan(69, 125, mx.zeros((56, 1)))
    assert image_safe_prefix(130, [a, b], [a, b]) == 130  # same images: keep everything
    assert image_safe_prefix(100, [a, b], [a, b]) == 69  # inside the second image: back to its start
    assert image_safe_prefix(130, [a, b], [a, other]) == 69  # same tokens, another image
    assert image_safe_prefix(130, [a, b], [a]) == 69
    assert image_safe_prefix(66, [a, b], [a]) == 66  # the second image lies beyond the prefix
