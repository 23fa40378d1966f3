"""Gemma 4 unified's processors against transformers 5.24's (``models.processing.unified``).

* Images: our merged 48 px patches and positions equal, bit for bit, the reference image
  processor's steps on PIL images (``tests.unified_tiny.reference_patches``: transformers'
  ``convert_to_rgb``, ``get_aspect_ratio_preserving_size``, ``convert_image_to_patches`` and
  ``patches_merge``, torch's uint8 antialiased bicubic as torchvision runs it, the backend's rescale),
  on synthetic images and (slow) on the 17 real photos at every budget.
* Video: our frames equal the Gemma 4 video reference steps (``tests.test_gemma4_video.reference_video``)
  merged by transformers' ``patches_merge``, on arrays and (slow) on the three real videos.
* Audio: waveform frames equal ``Gemma4UnifiedAudioFeatureExtractor``'s and the token count
  ``Gemma4UnifiedProcessor``'s, on synthetic clips at several rates and (slow) on the real recording
  in six containers; the checkpoint's settings are read, wrong ones refused by name.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
from PIL import Image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from models.processing.audio import AudioTooLongError, load_audio  # noqa: E402
from models.processing.image_processor import SUPPORTED_SOFT_TOKEN_BUDGETS  # noqa: E402
from models.processing.settings import ProcessorSettings, ProcessorSettingsError  # noqa: E402
from models.processing.unified import Gemma4UnifiedAudioProcessor, Gemma4UnifiedImageProcessor, unified_video_processor  # noqa: E402
from tests.media_tiny import synthetic_clip  # noqa: E402
from tests.test_gemma4_video import reference_video, synthetic_video  # noqa: E402
from tests.unified_tiny import reference_patches, unified_image_module  # noqa: E402


def assert_same_as_reference(image: Image.Image, budget: int, what: str) -> None:
    ours = Gemma4UnifiedImageProcessor(budget, exif_transpose=False).process(image)
    patches, positions = reference_patches(image, budget)
    assert ours.patches.dtype == np.float32 and ours.patches.shape == patches.shape, what
    assert np.array_equal(ours.patches, patches), what
    assert np.array_equal(ours.position_ids, positions), what
    assert ours.num_soft_tokens == len(positions) <= budget, what


def noise_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


@pytest.mark.parametrize("budget", [70, 280, 1120])
@pytest.mark.parametrize("size", [(100, 150), (300, 100), (48, 48), (47, 500), (700, 400)])
def test_images_equal_the_reference(size, budget):
    assert_same_as_reference(noise_image(*size, seed=size[0]), budget, f"{size} @ {budget}")


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_transparency_and_grayscale_as_the_reference(mode):
    assert_same_as_reference(noise_image(120, 90, mode, seed=7), 140, mode)


def test_merged_patches_are_48_pixel_blocks():
    """One soft token is one 48x48 block flattened [y][x][channel], in row-major block order."""
    image = noise_image(336, 480)  # exactly 70 blocks of 48 px: no resize
    ours = Gemma4UnifiedImageProcessor(70).process(image)
    block = np.asarray(image)[48:96, 96:144].astype(np.float32) * np.float32(1 / 255)
    assert ours.grid == (7, 10) and np.array_equal(ours.patches[12], block.reshape(-1))
    assert ours.position_ids[:3].tolist() == [[0, 0], [1, 0], [2, 0]] and ours.position_ids[10].tolist() == [0, 1]


def reference_video_merged(frames: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    patches, grid = reference_video(frames, budget)
    module = unified_image_module()
    count = torch.from_numpy(np.broadcast_to(grid, (len(patches), *grid.shape)).copy())
    merged, positions = module.patches_merge(torch.from_numpy(patches), count, patches.shape[1] // 9)
    assert (positions == positions[:1]).all()  # every frame has the same cells
    return merged.numpy(), positions[0].numpy()


@pytest.mark.parametrize("budget, frames", [(70, 32), (280, 6)])
def test_video_equals_the_reference(budget, frames):
    video = synthetic_video(frames=37)
    ours = unified_video_processor(None, 16, 3).process(video, max_soft_tokens=budget, num_frames=frames, fps=12.5)
    patches, positions = reference_video_merged(video[list(ours.frame_indices)], budget)
    assert np.array_equal(ours.patches, patches) and np.array_equal(ours.position_ids, positions)
    assert ours.num_soft_tokens == len(positions) and ours.patches.shape[-1] == 6912


def reference_audio(samples: np.ndarray) -> tuple[np.ndarray, int]:
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor
    from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor

    out = Gemma4UnifiedAudioFeatureExtractor()([samples], return_tensors="np")
    processor = types.SimpleNamespace(feature_extractor=types.SimpleNamespace(audio_samples_per_token=640))
    count = Gemma4UnifiedProcessor._compute_audio_num_tokens(processor, samples, 16_000)
    assert int(out["input_features_mask"][0].sum()) == count  # what replace_audio_token writes
    return out["input_features"][0], count


@pytest.mark.parametrize("seconds", [0.01, 0.04, 0.0401, 1.0, 7.3])
def test_audio_frames_equal_the_reference(seconds):
    clip = synthetic_clip(seconds, seed=int(seconds * 100))
    ours = Gemma4UnifiedAudioProcessor().process(clip)
    want, count = reference_audio(clip)
    assert ours.num_soft_tokens == count == ours.features.shape[0]
    assert np.array_equal(ours.features, want)


@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_other_rates_and_stereo_are_decoded_as_for_gemma4(rate):
    stereo = np.stack([synthetic_clip(0.5, rate, seed=1), synthetic_clip(0.5, rate, seed=2)], axis=1)
    ours = Gemma4UnifiedAudioProcessor().process((stereo, rate))
    samples, _ = load_audio((stereo, rate))
    want, _ = reference_audio(samples)
    assert np.array_equal(ours.features, want)


def test_a_clip_over_the_cap_is_refused_with_the_way_out():
    processor = Gemma4UnifiedAudioProcessor(audio_seq_length=10)
    assert processor.process(np.zeros(6400, np.float32)).num_soft_tokens == 10
    with pytest.raises(AudioTooLongError, match="split_audio"):
        processor.process(np.zeros(6401, np.float32))


def test_checkpoint_settings_are_read_and_checked(tmp_path):
    extractor = {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor", "feature_size": 320,
                 "audio_samples_per_token": 320, "sampling_rate": 16000, "padding_value": 0.0, "return_attention_mask": True}  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": extractor, "audio_seq_length": 500}))
    settings = ProcessorSettings.from_folder(tmp_path, "gemma4_unified")
    processor = Gemma4UnifiedAudioProcessor(settings.audio, settings.processor["audio_seq_length"])
    assert processor.process(np.zeros(3200, np.float32)).features.shape == (10, 320)
    with pytest.raises(ValueError, match="audio_embed_dim 640"):
        Gemma4UnifiedAudioProcessor(settings.audio, samples_per_token=640)
    extractor["mel_floor"] = 0.001
    (tmp_path / "processor_config.json").write_text(json.dumps({"feature_extractor": extractor}))
    with pytest.raises(ProcessorSettingsError, match="mel_floor"):
        ProcessorSettings.from_folder(tmp_path, "gemma4_unified")


# What mlx-vlm 0.7.10's convert wrote as processor_config.json for a gemma4_unified checkpoint (the
# tiny one of tests.unified_tiny, with processor files like the 12B's): mel keys and model_patch_size.
MLX_VLM_WRITTEN = {
    "image_processor": {"do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                        "image_processor_type": "Gemma4UnifiedImageProcessor", "image_std": [0.5, 0.5, 0.5], "max_soft_tokens": 280,
                        "model_patch_size": 48, "patch_size": 16, "pooling_kernel_size": 3, "resample": 3,
                        "rescale_factor": 0.00392156862745098, "size": {"height": 224, "width": 224}},
    "processor_class": "Gemma4UnifiedProcessor",
    "video_processor": {"default_fps": 2.0, "do_normalize": False, "do_rescale": True, "do_resize": True, "image_mean": [0.0, 0.0, 0.0],
                        "image_std": [1.0, 1.0, 1.0], "max_soft_tokens": 70, "model_patch_size": 48, "num_frames": 32, "patch_size": 16,
                        "pooling_kernel_size": 3, "rescale_factor": 0.00392156862745098, "video_processor_type": "Gemma4UnifiedVideoProcessor"},
    "feature_extractor": {"feature_extractor_type": "Gemma4UnifiedAudioFeatureExtractor", "sampling_rate": 16000, "num_mel_filters": 128,
                          "fft_length": 512, "hop_length": 160, "chunk_duration": 8.0, "overlap_duration": 1.0},
    "audio_ms_per_token": 40,
}  # fmt: skip


def test_an_mlx_vlm_conversion_s_settings_are_read(tmp_path):
    (tmp_path / "processor_config.json").write_text(json.dumps(MLX_VLM_WRITTEN))
    settings = ProcessorSettings.from_folder(tmp_path, "gemma4_unified")
    assert settings.image["max_soft_tokens"] == 280 and settings.audio["audio_samples_per_token"] == 640
    with pytest.raises(ProcessorSettingsError, match="not implemented here"):  # the allowance is the unified family's only
        ProcessorSettings.from_folder(tmp_path, "gemma4")
    bad = json.loads(json.dumps(MLX_VLM_WRITTEN))
    bad["video_processor"]["model_patch_size"] = 32
    (tmp_path / "processor_config.json").write_text(json.dumps(bad))
    with pytest.raises(ProcessorSettingsError, match="model_patch_size 32"):
        ProcessorSettings.from_folder(tmp_path, "gemma4_unified")


# --------------------------------------------------------------------------------------- real assets
def fetched(what: str, names=None) -> dict:
    """The cached real assets (``models.assets``): ``what`` is "photos" or "media"; skip when they cannot be downloaded."""
    from models.assets.fetch import AssetFetchError
    from tests.real_media import fetch_media
    from tests.real_media import fetch_photos

    try:
        return fetch_photos() if what == "photos" else fetch_media(names)
    except AssetFetchError as exc:
        pytest.skip(f"could not download the {what}: {exc}")


@pytest.mark.slow
@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKEN_BUDGETS)
def test_real_photos_equal_the_reference(budget):
    photos = fetched("photos")
    assert len(photos) >= 17
    for name, path in sorted(photos.items()):
        assert_same_as_reference(Image.open(path), budget, f"{name} @ {budget}")


@pytest.mark.slow
@pytest.mark.parametrize("budget", [70, 280])
def test_real_videos_equal_the_reference(budget):
    from functools import partial

    from transformers.video_utils import default_sample_indices_fn, read_video_pyav

    from tests.real_media import VIDEO_FILES

    paths = fetched("media", VIDEO_FILES)
    for name, path in paths.items():
        ours = unified_video_processor(None, 16, 3).process(str(path), max_soft_tokens=budget)
        frames, metadata = read_video_pyav(str(path), partial(default_sample_indices_fn, num_frames=32))
        assert list(ours.frame_indices) == list(metadata.frames_indices), name
        patches, positions = reference_video_merged(frames, budget)
        assert np.array_equal(ours.patches, patches) and np.array_equal(ours.position_ids, positions), name


@pytest.mark.slow
def test_a_real_recording_in_six_containers():
    from tests.real_media import AUDIO_FILES

    paths = fetched("media", AUDIO_FILES)
    processor = Gemma4UnifiedAudioProcessor()
    assert processor.process(str(paths["lena.wav"])).num_soft_tokens == 307  # 12.27 s at 40 ms per token
    for name, path in paths.items():
        samples, _ = load_audio(str(path))
        want, count = reference_audio(samples)
        ours = processor.process(str(path))
        assert ours.num_soft_tokens == count and np.array_equal(ours.features, want), name
