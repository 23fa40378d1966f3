"""Gemma 4 unified (12B architecture) against transformers: tiny random checkpoints, fp32, logits within 1e-4.

``tests.unified_tiny`` writes a ``Gemma4UnifiedForConditionalGeneration`` (T5-shaped text decoder
with K=V on its full layer, a 48-wide vision embedder, the 640-sample audio embedder); our loader
reads the files and our logits must equal the reference's for text, images, audio, video and a
mix, without a cache and cached in chunks, and with media after cached text. Two variants:
``use_bidirectional_attention="vision"`` (the release: image and frame spans bidirectional on every
layer) and ``None`` (causal everywhere). Then the key layouts (mlx-vlm's, transformers' module
names), configs, named errors, and 4-/8-bit round trips through ``models.convert``.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from cache import MediaSplitError, Read  # noqa: E402
from graphs.config import ConfigError  # noqa: E402
from graphs.gemma4_unified_config import Gemma4UnifiedConfig, unified_text_config  # noqa: E402
from models.generation.prompts import Prompt  # noqa: E402
from models.media import AudioNotSupportedError, VideoNotSupportedError  # noqa: E402
from models.registry import UnsupportedModelError  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests.hf_tiny import read_config, read_safetensors  # noqa: E402
from tests.media_tiny import synthetic_clip  # noqa: E402
from tests.test_gemma4_multimodal import chunked_logits  # noqa: E402
from tests.test_gemma4_video import synthetic_video  # noqa: E402
from tests.unified_tiny import AUDIO, IMAGE, UNIFIED_TEXT, VIDEO, hf_inputs, save_unified_model  # noqa: E402

TOL = 1e-4
VARIANTS = {"vision": UNIFIED_TEXT, "causal": dict(UNIFIED_TEXT, use_bidirectional_attention=None)}
PROMPT_IMAGES = [2, 30, IMAGE, 31, 32, IMAGE, 33]
PROMPT_MIXED = [2, 30, IMAGE, 31, AUDIO, 32, VIDEO, 33, 34]


def fake_text(text: str) -> list[int]:
    """Timestamps as ids of the tiny vocabulary (the tiny checkpoints have no tokenizer)."""
    return [100 + (ord(c) % 60) for c in text]


def photo_like(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) % 64 * 4], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8))


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def reference_logits(reference, prompt_ids, **media) -> np.ndarray:
    with torch.no_grad():
        return reference(**hf_inputs(prompt_ids, **media)).logits.numpy()


_BUILT: dict = {}


def _built(variant, tmp_path_factory):
    if variant not in _BUILT:
        directory = tmp_path_factory.mktemp(f"unified_{variant}")
        reference = save_unified_model(directory, VARIANTS[variant])
        model = models.load(str(directory), tokenizer=False)
        model._encode_plain = fake_text
        _BUILT[variant] = (variant, reference, model, directory)
    return _BUILT[variant]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    return _built(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The released setting only (``use_bidirectional_attention="vision"``), for tests one variant covers."""
    return _built("vision", tmp_path_factory)


def mixed_prompt(model):
    image = photo_like(100, 150, seed=1)
    clip = synthetic_clip(0.5, seed=2)
    video = model.process_videos([synthetic_video(frames=12, seed=3)], max_soft_tokens=70, num_frames=3)
    images = model.process_images([image], max_soft_tokens=70)
    prompt = model.prompt(PROMPT_MIXED, images=images, audio=[clip], videos=video)
    return prompt, dict(images=images, audio=[clip], videos=video)


# ------------------------------------------------------------------------------------------- parity
def test_loads_as_the_unified_model(pair):
    _, _, model, _ = pair
    assert type(model).__name__ == "UnifiedModel" and type(model.graph).__name__ == "Gemma4UnifiedModel"
    assert model.supports_images and model.supports_audio and model.supports_video


def test_text_logits_equal_transformers_cached_and_not(pair):
    _, reference, model, _ = pair
    ids = [2] + np.random.default_rng(0).integers(3, 300, 23).tolist()
    want = reference_logits(reference, ids)
    assert worst(model.logits(ids), want) < TOL
    for step in (1, 7):
        cache = model.make_cache()
        got = [np.array(model.logits(ids[i : i + step], cache)) for i in range(0, len(ids), step)]
        assert worst(np.concatenate(got, axis=1), want) < TOL


def test_images_equal_transformers_and_the_overlay_covers_full_layers(pair):
    variant, reference, model, _ = pair
    images = model.process_images([photo_like(100, 150, 0), photo_like(90, 60, 1)], max_soft_tokens=70)
    prompt = model.prompt(PROMPT_IMAGES, images=images)
    want = reference_logits(reference, prompt.ids, images=images)
    assert worst(model.logits(prompt), want) < TOL
    if variant == "vision":
        # Without mm_token_type_ids the reference is causal: the overlay is what makes it differ.
        assert worst(reference_logits(reference, prompt.ids, images=images, with_types=False), want) > 0.05
        # Gemma 4's rule (overlay on sliding layers only) is not this model's.
        graph, ids = model.graph, np.array([prompt.ids])
        tokens_read = Read.vision_prefill(mx.array(np.where(np.isin(ids, IMAGE), 0, -1).astype(np.int32)))
        from graphs.gemma4_multimodal import ImageTokens

        tokens = ImageTokens(mx.array(np.where(ids == IMAGE, 0, ids)), ids == IMAGE, mx.concatenate([s.features for s in prompt.images]))
        sliding_only = graph.language_model.forward(tokens, graph.make_cache(), tokens_read)
        assert worst(sliding_only, want) > 0.05


def test_audio_equals_transformers_and_stays_causal(pair):
    variant, reference, model, _ = pair
    clips = [synthetic_clip(0.7, seed=4), synthetic_clip(0.23, seed=5)]
    prompt = model.prompt([2, 30, AUDIO, 31, AUDIO, 32], audio=clips)
    assert [s.end - s.start for s in prompt.images] == [18, 6]  # ceil(samples / 640)
    want = reference_logits(reference, prompt.ids, audio=clips)
    assert worst(model.logits(prompt), want) < TOL


def test_video_equals_transformers(pair):
    _, reference, model, _ = pair
    videos = model.process_videos([synthetic_video(frames=20, seed=6)], max_soft_tokens=70, num_frames=4)
    prompt = model.prompt([2, 30, VIDEO, 31], videos=videos)
    assert len(prompt.images) == 4  # one span per frame
    want = reference_logits(reference, prompt.ids, videos=videos)
    assert worst(model.logits(prompt), want) < TOL


def test_mixed_media_cached_in_chunks_and_decoded(pair):
    _, reference, model, _ = pair
    prompt, media = mixed_prompt(model)
    tail = [40, 41, 42]
    want = reference_logits(reference, prompt.ids + tail, **media)
    whole = np.array(model.logits(Prompt(prompt.ids + tail, prompt.images)))
    assert worst(whole, want) < TOL
    for step in (5, 50):
        cache = model.make_cache()
        pieces = [chunked_logits(model, prompt, step, cache)]
        for token in tail:  # decode steps after the media prefill
            pieces.append(np.array(model.forward(mx.array([[token]]), cache)))
        assert worst(np.concatenate(pieces, axis=1), whole) < TOL


def test_media_after_cached_text_and_a_cut_span(pair):
    _, _, model, _ = pair
    prompt, _ = mixed_prompt(model)
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    got = [np.array(model.logits(Prompt(prompt.ids[:2]), cache)), np.array(model.logits(prompt.suffix(2), cache))]
    assert worst(np.concatenate(got, axis=1), whole) < TOL
    span = prompt.images[0]
    cache = model.make_cache()
    model.forward(mx.array([prompt.ids[: span.start + 5]]), cache, image_features=span.features[:5])
    rest = mx.concatenate([span.features[5:]] + [s.features for s in prompt.images[1:]])
    with pytest.raises(MediaSplitError):
        model.forward(mx.array([prompt.ids[span.start + 5 :]]), cache, image_features=rest)


def test_generation_with_media_runs_in_chunks(pair):
    _, _, model, _ = pair
    prompt, _ = mixed_prompt(model)
    first = [c.token for c in model.stream(prompt, max_tokens=4, prefill_step_size=7) if c.token is not None]
    again = [c.token for c in model.stream(prompt, max_tokens=4, prefill_step_size=1000) if c.token is not None]
    assert first == again and len(first) == 4


# ------------------------------------------------------------------------------------------- layouts
def _rewrite(source, target, rename):
    target.mkdir()
    weights = read_safetensors(source)
    mx.save_safetensors(str(target / "model.safetensors"), {rename(k): v for k, v in weights.items() if rename(k)})
    shutil.copy(source / "config.json", target / "config.json")


def _mlx_vlm_name(key: str) -> str | None:
    """mlx-vlm 0.7.10 ``gemma4_unified.Model.sanitize``: strip ``model.``; ``language_model.X`` -> ``language_model.model.X``."""
    key = key.removeprefix("model.")
    if key.startswith("language_model."):
        key = "language_model.model." + key.removeprefix("language_model.")
    return key


def _transformers_module_name(key: str) -> str:
    """The module names of transformers' ``Gemma4UnifiedModel`` (before its checkpoint conversion mapping)."""
    key = key.replace("model.vision_embedder.", "model.embed_vision.")
    return key.replace("model.embed_vision.embedding_projection.", "model.embed_vision.multimodal_embedder.embedding_projection.")


@pytest.mark.parametrize("rename", [_mlx_vlm_name, _transformers_module_name], ids=["mlx_vlm", "transformers_modules"])
def test_other_layouts_load_the_same_model(release, tmp_path, rename):
    _, _, model, directory = release
    _rewrite(directory, tmp_path / "copy", rename)
    other = models.load(str(tmp_path / "copy"), tokenizer=False)
    other._encode_plain = fake_text
    prompt, _ = mixed_prompt(model)
    again, _ = mixed_prompt(other)
    assert worst(other.logits(again), model.logits(prompt)) == 0


def test_missing_and_stray_keys_are_named(release, tmp_path):
    _, _, _, directory = release
    _rewrite(directory, tmp_path / "missing", lambda k: None if k == "model.vision_embedder.pos_norm.bias" else k)
    with pytest.raises(ValueError, match="pos_norm.bias"):
        models.load(str(tmp_path / "missing"), tokenizer=False)
    _rewrite(directory, tmp_path / "stray", lambda k: k)
    config = read_config(tmp_path / "stray")
    config["vision_config"] = None
    (tmp_path / "stray" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no vision_embedder"):
        models.load(str(tmp_path / "stray"), tokenizer=False)


def test_a_checkpoint_without_audio_refuses_audio_and_without_vision_refuses_images(tmp_path):
    save_unified_model(tmp_path / "no_audio", audio=False)
    model = models.load(str(tmp_path / "no_audio"), tokenizer=False)
    assert model.supports_images and not model.supports_audio
    with pytest.raises(AudioNotSupportedError):
        model.prompt([2, AUDIO], audio=[synthetic_clip(0.3)])
    _rewrite(tmp_path / "no_audio", tmp_path / "text_only", lambda k: None if "vision_embedder" in k or "embed_vision" in k else k)
    text_only = models.load(str(tmp_path / "text_only"), tokenizer=False)  # vision_config kept, weights dropped
    assert not text_only.supports_images and not text_only.supports_video
    with pytest.raises(VideoNotSupportedError):
        text_only.prompt([2, VIDEO], videos=[synthetic_video(frames=2)])


def test_causal_lm_checkpoint(tmp_path):
    from transformers import Gemma4UnifiedForCausalLM, Gemma4UnifiedTextConfig

    torch.manual_seed(3)
    reference = Gemma4UnifiedForCausalLM(Gemma4UnifiedTextConfig(**UNIFIED_TEXT)).eval()
    reference.save_pretrained(tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    ids = [2] + np.random.default_rng(1).integers(3, 300, 15).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits.numpy()
    assert worst(model.logits(ids), want) < TOL


# ------------------------------------------------------------------------------------------- configs
def test_config_defaults_are_the_unified_ones():
    config = Gemma4UnifiedConfig.from_dict({"model_type": "gemma4_unified", "text_config": {}, "vision_config": {}, "audio_config": {}})
    text = config.text
    assert (text.sliding_window, text.use_bidirectional_attention, text.max_position_embeddings) == (1024, "vision", 262_144)
    assert text.hidden_size_per_layer_input == 0 and not text.enable_moe_block
    assert (config.vision.patch_dim, config.vision.mm_posemb_size, config.audio.audio_samples_per_token) == (6912, 1120, 640)
    assert (config.image_tokens.image, config.media_tokens.audio, config.media_tokens.video) == (258_880, 258_881, 258_884)
    bare = Gemma4UnifiedConfig.from_dict({"model_type": "gemma4_unified"})
    assert bare.vision is None and bare.audio is None  # as transformers: absent parts are None


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["text_config"].update(hidden_size_per_layer_input=256), "per-layer"),
        (lambda c: c["text_config"].update(enable_moe_block=True), "MoE"),
        (lambda c: c["vision_config"].update(output_proj_dims=32), "output_proj_dims"),
        (lambda c: c["vision_config"].update(mm_posemb_size="64"), "mm_posemb_size"),
        (lambda c: c["audio_config"].update(model_type="gemma4_audio"), "gemma4_unified_audio"),
        (lambda c: c.update(video_token_id=c["image_token_id"]), "placeholders"),
    ],
)
def test_bad_configs_are_refused_by_key(release, edit, message):
    _, _, _, directory = release
    config = read_config(directory)
    edit(config)
    with pytest.raises(ConfigError, match=message):
        Gemma4UnifiedConfig.from_dict(config)


def test_unified_text_reads_a_bare_text_config(pair):
    _, _, model, directory = pair
    assert unified_text_config(read_config(directory)) == model.config.text


def test_unknown_model_types_list_what_the_zoo_runs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma5_unified"}))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(UnsupportedModelError, match="gemma5_unified.*gemma4_unified"):
        models.load(str(tmp_path), tokenizer=False)


# ------------------------------------------------------------------------------------------- quantized
@pytest.mark.parametrize("bits", [4, 8])
def test_converted_folders_reload_with_equal_logits(release, tmp_path, bits):
    from models.convert import convert

    _, _, model, directory = release
    convert(str(directory), tmp_path / "q", q_bits=bits, q_group_size=32)
    on_load = models.load(str(directory), tokenizer=False, q_bits=bits, q_group_size=32)
    reloaded = models.load(str(tmp_path / "q"), tokenizer=False)
    written = read_safetensors(tmp_path / "q")
    config = read_config(tmp_path / "q")["text_config"]  # the flat keys mlx-vlm's gemma4_unified reads
    assert (config["global_head_dim"], config["num_global_key_value_heads"]) == (64, 1)
    assert "vision_embedder.patch_dense.weight" in written and "language_model.model.layers.0.mlp.up_proj.scales" in written
    assert "vision_embedder.patch_dense.scales" not in written  # the policy keeps the vision embedder in full precision
    for m in (on_load, reloaded):
        m._encode_plain = fake_text
    prompt, _ = mixed_prompt(model)
    full = model.logits(prompt)
    a, b = on_load.logits(mixed_prompt(on_load)[0]), reloaded.logits(mixed_prompt(reloaded)[0])
    assert worst(a, b) == 0
    kl, _, _ = qt.kl_and_top1(full, a)
    assert kl < {4: 0.6, 8: 0.06}[bits]


@pytest.mark.parametrize("bits, bound", [(8, 1e-4), (4, 1e-2)])  # measured 4.7e-6 and 8.5e-4
def test_quantized_kv_caches_read_media(release, bits, bound):
    """A prompt whose second image is read (encoder read) on caches already quantized, then decode steps."""
    from models.generation.generate import KVQuantization, prefill

    _, _, model, _ = release
    images = model.process_images([photo_like(100, 150, 0), photo_like(90, 60, 1)], max_soft_tokens=70)
    prompt = model.prompt(PROMPT_IMAGES + [40, 41, 42], images=images)
    tail = [43, 44, 45]
    want = model.logits(Prompt(prompt.ids + tail, prompt.images))[0, len(prompt.ids) - 1 :]
    kv = KVQuantization(bits, 32, start=0)
    cache = model.make_cache()
    split = prompt.images[1].start - 1
    prefill(model.forward, prompt.ids[:split], cache, 7, prompt.images[:1], kv_quantization=kv)
    rest = prompt.suffix(split)
    rows = [prefill(model.forward, rest.ids, cache, 1000, rest.images, kv_quantization=kv)[None]]
    assert type(cache[0]).__name__.startswith("RotatingQuantized")
    for token in tail:
        rows.append(model.forward(mx.array([[token]]), cache)[0])
    kl, _, top1 = qt.kl_and_top1(want, mx.concatenate(rows))
    assert kl < bound and top1 >= 0.75


def test_batched_rows_with_media_equal_each_alone(release):
    """``models.generation.batch``: requests with an image, a clip and none, decoded together, each
    sampling as it does alone (its own seed)."""
    from models.generation.batch import BatchGenerator, BatchRequest
    from models.generation.generate import SamplingOptions

    _, _, model, _ = release
    prompts = [
        model.prompt([2, 30, IMAGE, 31], images=model.process_images([photo_like(100, 150, 0)], max_soft_tokens=70)),
        model.prompt([2, 30, AUDIO, 31, 32, 33], audio=[synthetic_clip(0.5)]),
        model.prompt([2, 50, 51, 52]),
    ]
    options = [SamplingOptions(temp=1.0, seed=i) for i in range(3)]
    alone = [[c.token for c in model.stream(p, max_tokens=12, sampling=o) if c.token is not None] for p, o in zip(prompts, options)]
    together = BatchGenerator(model, max_batch=3).run([BatchRequest(p, max_tokens=12, sampling=o) for p, o in zip(prompts, options)])
    assert [list(t) for t in together] == alone and len({tuple(a) for a in alone}) == 3


def test_images_are_embedded_in_bounded_batches(release, monkeypatch):
    import graphs.gemma4_unified as unified

    _, _, model, _ = release
    images = model.process_images([photo_like(100, 150, 0), photo_like(90, 60, 1)], max_soft_tokens=70)
    pairs = [(i.patches, i.position_ids) for i in images]
    whole = model.graph.image_features(pairs)
    monkeypatch.setattr(unified, "ROWS_PER_CALL", 7)
    pieces = model.graph.image_features(pairs)
    assert [p.shape for p in pieces] == [w.shape for w in whole] and max(worst(p, w) for p, w in zip(pieces, whole)) < 1e-5  # BLAS blocking differs with the rows
