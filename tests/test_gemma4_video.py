"""Gemma 4 video against transformers (fp32, tiny random weights) and the video processor against the reference steps.

transformers' ``Gemma4VideoProcessor`` needs torchvision, which would pull a CUDA build of torch,
so the reference processor is re-assembled from the pieces it calls: ``read_video_pyav`` and
``default_sample_indices_fn`` (``transformers.video_utils``), ``get_aspect_ratio_preserving_size``
(``processing_gemma4.py``), torch's uint8 antialiased bicubic ``interpolate`` (what torchvision's
``resize`` runs on a CPU uint8 tensor), the fused float32 ``x / 255`` and ``convert_video_to_patches``
(five lines of tensor reshapes, restated below). Real videos are ``@slow``.
"""

from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from cache import MediaSplitError  # noqa: E402
from models.generation.media import timestamp_text  # noqa: E402
from models.generation.prompts import Prompt, prefill_chunks  # noqa: E402
from models.media import VideoNotSupportedError  # noqa: E402
from models.processing.video import Gemma4VideoProcessor, NoVideoFramesError, VideoDecodeError  # noqa: E402
from tests.media_tiny import AUDIO, VIDEO, hf_inputs, save_media_model, synthetic_clip  # noqa: E402
from tests.test_gemma4_audio import VARIANTS  # noqa: E402

TOL = 1e-4
PROMPT_VIDEO = [2, 30, 31, VIDEO, 32, 33]
PROMPT_VIDEO_AUDIO = [2, 30, VIDEO, 31, AUDIO, 32, 33]


def fake_text(text: str) -> list[int]:
    """Timestamps as ids of a tiny vocabulary (the tiny checkpoints have no tokenizer)."""
    return [100 + (ord(c) % 60) for c in text]


def synthetic_video(frames: int = 40, height: int = 90, width: int = 120, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    out = []
    for t in range(frames):
        base = np.stack([(xs + 3 * t) * 255 / width, ys * 255 / height, ((xs + ys + 5 * t) % 97) * 2.5], axis=-1)
        out.append(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))
    return np.stack(out)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"video_{request.param}")
    reference = save_media_model(directory, VARIANTS[request.param])
    model = models.load(str(directory), tokenizer=False)
    model._encode_plain = fake_text
    return request.param, reference, model


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def video_prompt(model, ids, video, frames=4, **media):
    processed = model.process_videos([video], num_frames=frames)
    return model.prompt(ids, videos=processed, **media), processed


def test_text_and_video_logits_equal_transformers(pair):
    variant, reference, model = pair
    prompt, processed = video_prompt(model, PROMPT_VIDEO, synthetic_video())
    assert len(prompt.images) == 4  # one span per frame
    with torch.no_grad():
        want = reference(**hf_inputs(prompt.ids, videos=processed)).logits.numpy()
    assert worst(model.logits(prompt), want) < TOL
    if variant == "vision":
        # Frames are bidirectional on sliding layers; without the overlay the reference moves.
        inputs = hf_inputs(prompt.ids, videos=processed)
        inputs["mm_token_type_ids"] = torch.zeros_like(inputs["mm_token_type_ids"])
        with torch.no_grad():
            assert worst(reference(**inputs).logits.numpy(), want) > 0.05


def test_video_and_audio_in_one_prompt_cached_in_chunks(pair):
    _, reference, model = pair
    clip = synthetic_clip(0.9, seed=3)
    processed = model.process_videos([synthetic_video(seed=1)], num_frames=3)
    prompt = model.prompt(PROMPT_VIDEO_AUDIO, videos=processed, audio=[clip])
    with torch.no_grad():
        want = reference(**hf_inputs(prompt.ids, videos=processed, audio=[clip])).logits.numpy()
    whole = np.array(model.logits(prompt))
    assert worst(whole, want) < TOL
    for step in (5, 50):
        cache, pieces = model.make_cache(), []
        for start, end in prefill_chunks(len(prompt.ids), prompt.images, step):
            inside = [s.features for s in prompt.images if start <= s.start < end]
            extra = {"image_features": mx.concatenate(inside)} if inside else {}
            pieces.append(np.array(model.forward(mx.array([prompt.ids[start:end]]), cache, **extra)))
        assert worst(np.concatenate(pieces, axis=1), whole) < TOL


def test_video_after_cached_text_and_a_cut_frame(pair):
    _, _, model = pair
    prompt, _ = video_prompt(model, PROMPT_VIDEO, synthetic_video(), frames=2)
    whole = np.array(model.logits(prompt))
    cache = model.make_cache()
    got = [np.array(model.logits(Prompt(prompt.ids[:3]), cache)), np.array(model.logits(prompt.suffix(3), cache))]
    assert worst(np.concatenate(got, axis=1), whole) < TOL
    span = prompt.images[0]
    cache = model.make_cache()
    model.forward(mx.array([prompt.ids[: span.start + 5]]), cache, image_features=span.features[:5])
    rest = [span.features[5:], prompt.images[1].features]
    with pytest.raises(MediaSplitError):
        model.forward(mx.array([prompt.ids[span.start + 5 :]]), cache, image_features=mx.concatenate(rest))


def test_timestamps_are_written_as_the_processor_writes_them():
    """``Gemma4Processor.replace_video_token`` on the same metadata gives the same text."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    seconds = [0.0, 0.04, 1.999, 59.99, 60.0, 61.5, 3599.9, 6000.0]
    metadata = types.SimpleNamespace(fps=25.0, timestamps=seconds)
    fake = types.SimpleNamespace(boi_token="<B>", eoi_token="<E>", video_token="V")
    text = Gemma4Processor.replace_video_token(fake, {"num_soft_tokens_per_video": [2], "video_metadata": [metadata]}, 0)
    assert text == " ".join(f"{timestamp_text(s)} <B>VV<E>" for s in seconds)


def reference_video(frames_uint8: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference processor's steps on decoded frames ``[F, H, W, 3]``: (patches, positions) unpadded."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

    video = torch.from_numpy(frames_uint8).permute(0, 3, 1, 2).contiguous()
    height, width = get_aspect_ratio_preserving_size(video.shape[-2], video.shape[-1], 16, budget * 9, 3)
    if (height, width) != tuple(video.shape[-2:]):
        video = torch.nn.functional.interpolate(video, size=[height, width], mode="bicubic", antialias=True, align_corners=False)
    # rescale_and_normalize with rescale fused into the (identity) normalisation: (x - 0) / 255 in float32
    video = (video.to(torch.float32) - torch.zeros(3).view(1, 3, 1, 1)) / (torch.ones(3) * 255.0).view(1, 3, 1, 1)
    # convert_video_to_patches (video_processing_gemma4.py)
    n, c, h, w = video.shape
    patches = video.reshape(n, c, h // 16, 16, w // 16, 16).permute(0, 2, 4, 3, 5, 1).reshape(n, (h // 16) * (w // 16), -1)
    grid = torch.stack(torch.meshgrid(torch.arange(w // 16), torch.arange(h // 16), indexing="xy"), dim=-1).reshape(-1, 2)
    return patches.numpy(), grid.numpy()


@pytest.mark.parametrize("budget", [70, 280])
def test_processor_equals_the_reference_steps_on_arrays(budget):
    video = synthetic_video(frames=37)
    ours = Gemma4VideoProcessor().process(video, max_soft_tokens=budget, fps=12.5)
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    indices = default_sample_indices_fn(VideoMetadata(total_num_frames=37, fps=12.5), num_frames=32)
    assert list(ours.frame_indices) == indices.tolist()
    assert list(ours.timestamps) == [i / 12.5 for i in indices]
    patches, grid = reference_video(video[indices], budget)
    assert np.array_equal(ours.patches, patches) and np.array_equal(ours.position_ids, grid)


def test_short_videos_give_every_frame():
    """The reference refuses fewer frames than num_frames; we sample every frame."""
    ours = Gemma4VideoProcessor().process(synthetic_video(frames=5))
    assert ours.frame_indices == (0, 1, 2, 3, 4) and ours.timestamps == (0.0, 1 / 24, 2 / 24, 3 / 24, 4 / 24)


def test_bad_videos_are_refused_by_name(tmp_path, pair):
    _, _, model = pair
    processor = Gemma4VideoProcessor()
    corrupt = tmp_path / "corrupt.mp4"
    corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    with pytest.raises(VideoDecodeError):
        processor.process(str(corrupt))
    with pytest.raises(VideoDecodeError, match="no such file"):
        processor.process(str(tmp_path / "missing.mp4"))
    import soundfile

    audio_only = tmp_path / "sound.wav"
    soundfile.write(audio_only, synthetic_clip(0.5), 16_000)
    with pytest.raises((NoVideoFramesError, VideoDecodeError)):
        processor.process(str(audio_only))
    with pytest.raises(ValueError, match="1 video placeholder"):
        model.prompt(PROMPT_VIDEO, videos=model.process_videos([synthetic_video()] * 2, num_frames=2))


def test_video_to_a_text_model_is_refused(tmp_path):
    from tests.hf_tiny import TEXT_CONFIGS, save_causal_lm

    save_causal_lm(TEXT_CONFIGS["T1"], tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    with pytest.raises(VideoNotSupportedError, match="cannot take video"):
        model.prompt([2, 3], videos=[synthetic_video(frames=2)])


@pytest.mark.slow
@pytest.mark.parametrize("budget", [70, 280])
def test_processor_equals_the_reference_on_real_videos(budget):
    from functools import partial

    from transformers.video_utils import default_sample_indices_fn, read_video_pyav

    from models.assets.fetch import AssetFetchError
    from tests.real_media import VIDEO_FILES, fetch_media

    try:
        paths = fetch_media(VIDEO_FILES)
    except AssetFetchError as exc:
        pytest.skip(f"could not download the videos: {exc}")
    for name, path in paths.items():
        ours = Gemma4VideoProcessor().process(str(path), max_soft_tokens=budget)
        frames, metadata = read_video_pyav(str(path), partial(default_sample_indices_fn, num_frames=32))
        assert list(ours.frame_indices) == list(metadata.frames_indices), name
        assert list(ours.timestamps) == list(metadata.timestamps) and ours.fps == metadata.fps, name
        patches, grid = reference_video(frames, budget)
        assert np.array_equal(ours.patches, patches), name
        assert np.array_equal(ours.position_ids, grid), name
