"""The image processor takes its settings from the checkpoint folder, as transformers does.

A tiny multimodal checkpoint (vision tower patch 16, pooling 3) is given a ``preprocessor_config.json``
or ``processor_config.json`` with a non-default budget; ``Model.process_images`` must then give the
soft-token count and pixel values of transformers' ``Gemma4ImageProcessorPil.from_pretrained`` on
the same folder (``trust_remote_code=False``), and the count ``Gemma4Processor`` computes from that
image processor. An explicit budget (call argument or ``Model.max_soft_tokens``) still wins, a
folder without settings keeps the reference default 280, and settings we cannot honour are refused
by name.
"""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models.processing.settings import ProcessorSettingsError  # noqa: E402
from tests.hf_tiny import T5_TEXT  # noqa: E402
from tests.media_tiny import save_media_model  # noqa: E402

from PIL import Image  # noqa: E402


def photo(height=300, width=400, seed=0) -> Image.Image:
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / width, ys * 255 / height, (xs + ys) % 200], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    directory = tmp_path_factory.mktemp("image_settings")
    save_media_model(directory, dict(T5_TEXT), audio=False)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (directory / name).unlink(missing_ok=True)
    return directory


def write(folder, name: str, content: dict) -> None:
    for old in ("preprocessor_config.json", "processor_config.json"):
        (folder / old).unlink(missing_ok=True)
    (folder / name).write_text(json.dumps(content))


def reference(folder, image):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    processor = Gemma4ImageProcessorPil.from_pretrained(str(folder), trust_remote_code=False)
    out = processor(images=[image], return_tensors="np")
    real = out["image_position_ids"][0, :, 0] >= 0
    # Gemma4Processor's own count from that image processor (its __init__ wants a tokenizer and a
    # torchvision video processor; the counting method reads only these two attributes).
    fake = types.SimpleNamespace(
        image_processor=processor,
        _merge_kwargs=lambda **kw: {"images_kwargs": {}, "videos_kwargs": {}, "audio_kwargs": {}},
    )
    counted = Gemma4Processor._get_num_multimodal_tokens(fake, image_sizes=[(image.height, image.width)])
    return (
        out["pixel_values"][0][real], out["image_position_ids"][0][real], int(out["num_soft_tokens_per_image"][0]),
        counted["num_image_tokens"][0],
    )


@pytest.mark.parametrize(
    "name, content",
    [
        ("preprocessor_config.json", {"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 140}),
        ("processor_config.json", {"processor_class": "Gemma4Processor", "image_seq_length": 70,
                                   "image_processor": {"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 70,
                                                       "patch_size": 16, "pooling_kernel_size": 3, "do_rescale": True,
                                                       "rescale_factor": 1 / 255, "do_normalize": False, "resample": 3}}),
    ],
)  # fmt: skip
def test_checkpoint_budget_equals_transformers(folder, name, content):
    write(folder, name, content)
    model = models.load(str(folder), tokenizer=False)
    image = photo()
    (ours,) = model.process_images([image])
    pixels, positions, count, counted = reference(folder, image)
    budget = (content.get("image_processor") or content)["max_soft_tokens"]
    assert ours.num_soft_tokens == count == counted <= budget
    assert count != reference_count_at(280, image)  # not the default budget's count
    assert np.array_equal(ours.position_ids, positions)
    assert np.array_equal(ours.patches, pixels)
    # an explicit budget wins: the call's, then the model's
    assert model.process_images([image], 280)[0].num_soft_tokens == reference_count_at(280, image)
    model.max_soft_tokens = 560
    assert model.process_images([image])[0].num_soft_tokens == reference_count_at(560, image)


def reference_count_at(budget: int, image) -> int:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return int(Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[image], return_tensors="np")["num_soft_tokens_per_image"][0])


def test_no_settings_gives_the_reference_default(folder):
    write(folder, "unused.json", {})
    model = models.load(str(folder), tokenizer=False)
    assert model.process_images([photo()])[0].num_soft_tokens == reference_count_at(280, photo())


@pytest.mark.parametrize(
    "image_settings, word",
    [
        ({"patch_size": 14}, "patch_size"),
        ({"pooling_kernel_size": 2}, "pooling_kernel_size"),
        ({"max_soft_tokens": 100}, "max_soft_tokens"),
        ({"do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}, "do_normalize"),
        ({"rescale_factor": 1 / 127.5}, "rescale_factor"),
        ({"resample": 2}, "resample"),
        ({"do_convert_rgb": False}, "do_convert_rgb"),
        ({"do_resize": False}, "do_resize"),
        ({"crop_pct": 0.9}, "crop_pct"),
    ],
)
def test_settings_we_cannot_honour_are_refused_by_name(folder, image_settings, word):
    write(folder, "preprocessor_config.json", {"image_processor_type": "Gemma4ImageProcessor", **image_settings})
    model = models.load(str(folder), tokenizer=False)
    with pytest.raises(ProcessorSettingsError, match=word):
        model.process_images([photo()])


def test_mlx_vlm_audio_keys_are_read_and_checked(tmp_path):
    """mlx-vlm's Gemma 4 save_pretrained writes its feature extractor's mel settings: the values
    that equal ours load (its chunking keys are not used), a different one is refused by name."""
    from models.processing.settings import ProcessorSettings

    written = {"feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor", "sampling_rate": 16000,
               "num_mel_filters": 128, "fft_length": 512, "hop_length": 160, "chunk_duration": 8.0,
               "overlap_duration": 1.0}, "audio_ms_per_token": 40}  # fmt: skip
    (tmp_path / "processor_config.json").write_text(json.dumps(written))
    settings = ProcessorSettings.from_folder(tmp_path)
    assert settings.audio["feature_size"] == 128 and settings.audio["hop_length_ms"] == 10.0
    written["feature_extractor"]["hop_length"] = 320
    (tmp_path / "processor_config.json").write_text(json.dumps(written))
    with pytest.raises(ProcessorSettingsError, match="hop_length 320 differs from the 160"):
        ProcessorSettings.from_folder(tmp_path)
