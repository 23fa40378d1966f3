"""The checkpoint's preprocessing settings: ``processor_config.json`` / ``preprocessor_config.json``.

A Gemma 4 checkpoint says how its inputs were prepared: the image processor's budget and patch
size, the video processor's frame count and budget, the audio feature extractor's mel settings
(sampling rate, frame and hop length, per-bin normalisation, ...) and the processor's
``audio_seq_length`` / ``audio_ms_per_token`` / ``image_seq_length``. Other MLX ports read none of
it, and a conversion that lacks it silently gets whatever their code assumes. Here:

* a setting found in the folder is used; a missing one takes transformers 5.24's default
  (``Gemma4ImageProcessor``, ``Gemma4VideoProcessor``, ``Gemma4AudioFeatureExtractor``,
  ``Gemma4Processor``), and ``source`` records which file, if any, each part came from;
* a setting our processors do not implement with the value given (a non-identity image
  normalisation, another resampling filter, 64 mel bins for a tower that reads 128) raises
  ``ProcessorSettingsError`` naming the file and the key, instead of being ignored.

``processor_config.json`` nests the parts (``image_processor``, ``video_processor``,
``feature_extractor``) beside the processor's own keys; ``preprocessor_config.json`` is either a
flat single part (told apart by its ``*_type`` key) or the same nesting. Both files may exist;
``processor_config.json`` wins where both give a value.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

FILES = ("preprocessor_config.json", "processor_config.json")  # later files override earlier ones


class ProcessorSettingsError(ValueError):
    """A preprocessing setting of the checkpoint that our processors cannot honour (the message names it)."""


# transformers 5.24 defaults.
IMAGE_DEFAULTS: dict[str, Any] = dict(
    max_soft_tokens=280, patch_size=16, pooling_kernel_size=3, do_resize=True, do_rescale=True,
    rescale_factor=1 / 255, do_normalize=False, image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0],
    do_convert_rgb=True, resample=3,
)  # fmt: skip
VIDEO_DEFAULTS: dict[str, Any] = dict(
    max_soft_tokens=70, patch_size=16, pooling_kernel_size=3, num_frames=32, do_sample_frames=True, fps=None,
    do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.0, 0.0, 0.0],
    image_std=[1.0, 1.0, 1.0], do_convert_rgb=True, resample=3,
)  # fmt: skip
AUDIO_DEFAULTS: dict[str, Any] = dict(
    feature_size=128, sampling_rate=16_000, padding_value=0.0, frame_length_ms=20.0, hop_length_ms=10.0,
    min_frequency=0.0, max_frequency=8000.0, preemphasis=0.0, preemphasis_htk_flavor=True, fft_overdrive=False,
    dither=0.0, input_scale_factor=1.0, mel_floor=1e-3, per_bin_mean=None, per_bin_stddev=None,
)  # fmt: skip
# Gemma 4 unified (12B): transformers 5.24 ``Gemma4UnifiedAudioFeatureExtractor`` (raw waveform frames, no mel).
UNIFIED_AUDIO_DEFAULTS: dict[str, Any] = dict(feature_size=640, sampling_rate=16_000, padding_value=0.0, audio_samples_per_token=640)
# What mlx-vlm 0.7.10 writes into its gemma4_unified conversions that describes nothing these
# processors do: its Gemma 4 ``save_pretrained`` fills a feature extractor without mel settings
# (the unified one reads raw frames) with mel defaults, its unified video reader records the rate
# it assumes for frames without one, and both record the merged patch side (``model_patch_size``,
# checked to be patch_size * pooling_kernel_size).
_MLX_VLM_UNIFIED_KEYS = {
    "image": {"model_patch_size"},
    "video": {"model_patch_size", "default_fps"},
    "audio": {"num_mel_filters", "fft_length", "hop_length", "chunk_duration", "overlap_duration"},
}
# mlx-vlm 0.7.10's Gemma 4 ``save_pretrained`` writes its own feature extractor's settings when a
# folder's processor_config.json has none: the mel bins, FFT and hop in samples (checked against
# ours below) and its long-audio chunking (``chunk_duration``, ``overlap_duration``; the reference
# has no such chunking, and clips past the token cap are refused here: read and not used).
_MLX_VLM_GEMMA4_KEYS = {"audio": {"num_mel_filters", "fft_length", "hop_length", "chunk_duration", "overlap_duration"}}
# Per model family: the feature extractor's settings (with their defaults) and the keys written by
# a peer's conversion that are read and not used.
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, set[str]]]] = {
    "gemma4": (AUDIO_DEFAULTS, _MLX_VLM_GEMMA4_KEYS),
    "gemma4_unified": (UNIFIED_AUDIO_DEFAULTS, _MLX_VLM_UNIFIED_KEYS),
}
PROCESSOR_DEFAULTS: dict[str, Any] = dict(image_seq_length=280, audio_seq_length=750, audio_ms_per_token=40)

_PARTS = {"image_processor": "image", "video_processor": "video", "feature_extractor": "audio"}
_TYPES = {"image_processor_type": "image", "video_processor_type": "video", "feature_extractor_type": "audio"}
# Keys that only describe the file, never change a value.
_BOOKKEEPING = {"image_processor_type", "video_processor_type", "feature_extractor_type", "processor_class",
                "return_attention_mask", "padding_side", "input_data_format", "data_format", "device",
                "return_tensors", "return_metadata", "default_to_square", "size", "crop_size", "do_center_crop",
                "do_pad", "video_metadata"}  # fmt: skip


@dataclass(frozen=True)
class ProcessorSettings:
    """The effective settings of each part, and where each came from (``"default"`` or a file name)."""

    image: dict = field(default_factory=lambda: dict(IMAGE_DEFAULTS))
    video: dict = field(default_factory=lambda: dict(VIDEO_DEFAULTS))
    audio: dict = field(default_factory=lambda: dict(AUDIO_DEFAULTS))
    processor: dict = field(default_factory=lambda: dict(PROCESSOR_DEFAULTS))
    source: dict = field(default_factory=lambda: dict.fromkeys(("image", "video", "audio", "processor"), "default"))

    @classmethod
    def from_folder(cls, folder: str | Path | None, family: str = "gemma4") -> "ProcessorSettings":
        """Read the folder's settings files (reference defaults for whatever they do not say).

        ``family`` (``FAMILIES``) says which feature extractor the settings describe: Gemma 4's mel
        extractor or the unified model's waveform frames."""
        audio_defaults, _ = FAMILIES[family]
        found: dict[str, dict] = {"image": {}, "video": {}, "audio": {}, "processor": {}}
        source = dict.fromkeys(found, "default")
        if folder is not None:
            for name in FILES:
                path = Path(folder) / name
                if not path.is_file():
                    continue
                try:
                    raw = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError) as err:
                    raise ProcessorSettingsError(f"{path}: cannot read the preprocessing settings ({err})") from err
                if not isinstance(raw, Mapping):
                    raise ProcessorSettingsError(f"{path}: expected a JSON object, got {type(raw).__name__}")
                for part, values in _split(raw).items():
                    if values:
                        found[part].update(values)
                        source[part] = name
        settings = cls(
            image={**IMAGE_DEFAULTS, **_known(found["image"], IMAGE_DEFAULTS)},
            video={**VIDEO_DEFAULTS, **_known(found["video"], VIDEO_DEFAULTS)},
            audio={**audio_defaults, **_known(found["audio"], audio_defaults)},
            processor={**PROCESSOR_DEFAULTS, **_known(found["processor"], PROCESSOR_DEFAULTS)},
            source=source,
        )
        settings._check(found, folder, family)
        return settings

    def image_processor_settings(self, patch_size: int, pooling_kernel_size: int) -> dict:
        """``max_soft_tokens``, ``patch_size`` and ``pooling_kernel_size`` for the image processor,
        checked against the vision tower's ``patch_size`` / ``pooling_kernel_size``.

        The budget is the image processor's ``max_soft_tokens`` (280 when absent), the value
        transformers' ``Gemma4ImageProcessor`` resizes by and ``Gemma4Processor`` counts image tokens
        with; the processor's ``image_seq_length`` is stored by the reference but never used for
        either, so it is not used here. Resize, rescale, normalisation and resample filter are
        checked when the settings are read (``_check``); a patch size or pooling kernel other than
        the tower's, or a budget outside ``SUPPORTED_SOFT_TOKEN_BUDGETS``, raises
        ``ProcessorSettingsError`` naming the key.
        """
        from models.processing.image_processor import SUPPORTED_SOFT_TOKEN_BUDGETS

        values, where = self.image, self.source["image"]
        for key, tower in (("patch_size", patch_size), ("pooling_kernel_size", pooling_kernel_size)):
            if values[key] != tower:
                raise ProcessorSettingsError(
                    f"{where}: image {key} {values[key]!r} differs from the vision tower's {tower}; "
                    "the tower cannot read such patches"
                )
        budget = values["max_soft_tokens"]
        if type(budget) is not int or budget not in SUPPORTED_SOFT_TOKEN_BUDGETS:
            raise ProcessorSettingsError(
                f"{where}: image max_soft_tokens must be one of {SUPPORTED_SOFT_TOKEN_BUDGETS}, got {budget!r}"
            )
        return dict(max_soft_tokens=budget, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size)

    def _check(self, found: dict[str, dict], folder, family: str) -> None:
        audio_defaults, unused = FAMILIES[family]
        for part, defaults in (("image", IMAGE_DEFAULTS), ("video", VIDEO_DEFAULTS), ("audio", audio_defaults)):
            unknown = sorted(set(found[part]) - set(defaults) - _BOOKKEEPING - unused.get(part, set()))
            if unknown:
                raise ProcessorSettingsError(
                    f"{self.source[part]} in {folder}: {part} settings {unknown} are not implemented here "
                    f"(implemented: {sorted(defaults)}); refusing rather than ignoring them"
                )
        for part in ("image", "video"):
            values = self.__dict__[part]
            scale = float(values["rescale_factor"]) if values["do_rescale"] else 1.0
            mean = [float(m) for m in values["image_mean"]] if values["do_normalize"] else [0.0] * 3
            std = [float(s) for s in values["image_std"]] if values["do_normalize"] else [1.0] * 3
            if abs(scale - 1 / 255) > 1e-12 or mean != [0.0] * 3 or std != [1.0] * 3 or not values["do_resize"]:
                raise ProcessorSettingsError(
                    f"{self.source[part]} in {folder}: the {part} processor must rescale by 1/255 without "
                    f"normalisation and resize (Gemma 4's settings); got do_rescale={values['do_rescale']}, "
                    f"rescale_factor={values['rescale_factor']}, do_normalize={values['do_normalize']}, "
                    f"image_mean={values['image_mean']}, image_std={values['image_std']}, do_resize={values['do_resize']}"
                )
            if values["do_convert_rgb"] is not True:
                raise ProcessorSettingsError(
                    f"{self.source[part]} in {folder}: {part} do_convert_rgb={values['do_convert_rgb']!r}; our "
                    "processors always convert to RGB (transparency onto white)"
                )
            if values["resample"] not in (3, "bicubic", "BICUBIC"):
                raise ProcessorSettingsError(f"{self.source[part]} in {folder}: {part} resample must be bicubic (3), got {values['resample']!r}")
            merged = found[part].get("model_patch_size", values["patch_size"] * values["pooling_kernel_size"])
            if merged != values["patch_size"] * values["pooling_kernel_size"]:
                raise ProcessorSettingsError(
                    f"{self.source[part]} in {folder}: {part} model_patch_size {merged!r} is not patch_size * "
                    f"pooling_kernel_size ({values['patch_size']} * {values['pooling_kernel_size']})"
                )
        if family == "gemma4" and self.audio["feature_size"] != 128:
            raise ProcessorSettingsError(
                f"{self.source['audio']} in {folder}: feature_size {self.audio['feature_size']} mel bins; the Gemma 4 audio tower reads 128"
            )
        if family == "gemma4":
            audio, rate = self.audio, self.audio["sampling_rate"]
            frame = round(audio["frame_length_ms"] * rate / 1000)
            ours = {  # the mlx-vlm spellings of our settings (transformers' Gemma4AudioFeatureExtractor FFT size)
                "num_mel_filters": audio["feature_size"],
                "hop_length": round(audio["hop_length_ms"] * rate / 1000),
                "fft_length": 2 ** math.ceil(math.log2(frame)) * (2 if audio["fft_overdrive"] else 1),
            }
            for key, value in ours.items():
                if key in found["audio"] and found["audio"][key] != value:
                    raise ProcessorSettingsError(
                        f"{self.source['audio']} in {folder}: audio {key} {found['audio'][key]!r} differs from the "
                        f"{value} these settings give (feature_size, hop_length_ms, frame_length_ms)"
                    )
        if self.video["fps"] is not None and self.video["num_frames"] is not None:
            raise ProcessorSettingsError(f"{self.source['video']} in {folder}: num_frames and fps are mutually exclusive (as in transformers)")


def _split(raw: Mapping[str, Any]) -> dict[str, dict]:
    """``{part: values}`` of one settings file (nested parts, or one flat part named by its type key)."""
    out: dict[str, dict] = {"image": {}, "video": {}, "audio": {}, "processor": {}}
    nested = False
    for key, part in _PARTS.items():
        if isinstance(raw.get(key), Mapping):
            out[part].update(raw[key])
            nested = True
    flat_part = next((part for key, part in _TYPES.items() if key in raw), None)
    rest = {k: v for k, v in raw.items() if k not in _PARTS}
    if flat_part is not None and not nested:
        out[flat_part].update(rest)
    else:
        out["processor"].update({k: v for k, v in rest.items() if k in PROCESSOR_DEFAULTS})
    return out


def _known(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    return {k: v for k, v in values.items() if k in defaults}
