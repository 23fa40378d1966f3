"""Gemma 4 unified (12B) preprocessing: images and video frames as merged 48 px patches, audio as raw frames.

transformers 5.24's unified processors (``image_processing_gemma4_unified.py``,
``video_processing_gemma4_unified.py``, ``feature_extraction_gemma4_unified.py``) reuse Gemma 4's
steps and change what comes out:

* **Images** (``Gemma4UnifiedImageProcessor``): the same aspect-preserving size as Gemma 4, but
  resized by torchvision (the reference has no Pillow variant), which on a CPU uint8 tensor is
  torch's antialiased bicubic: ``models.processing.video.resize_uint8_bicubic`` reimplements it.
  Rescaled ``float32(x) * float32(1/255)`` (torch's uint8 tensor times a Python float), cut into
  16 px patches, then ``patches_merge`` groups each 3x3 block of them into one ``48 * 48 * 3`` row.
  The merged row of a block is exactly that 48 x 48 pixel block flattened ``[y][x][channel]``, and
  merged blocks come in row-major order with their (column, row) cell: patchifying at 48 px gives
  the same rows and positions, so that is what we do (``tests/test_gemma4_unified_processors.py``
  checks it equal to the reference's ``patches_merge``). Unpadded, as for Gemma 4.
* **Video** (``unified_video_processor``): Gemma 4's video processor (same sampling, timestamps,
  resize and fused ``/ 255``) with 48 px patches and no pooling, for the same reason.
* **Audio** (``Gemma4UnifiedAudioProcessor``): decoded and resampled to 16 kHz as for Gemma 4
  (``models.processing.audio.load_audio``), then transformers' own
  ``Gemma4UnifiedAudioFeatureExtractor`` cuts the waveform into frames of 640 samples, the last
  one zero-padded: one soft token per frame (``ceil(samples / 640)``, the count
  ``Gemma4UnifiedProcessor`` writes). A clip over the processor's ``audio_seq_length`` (750 tokens,
  30 s) is refused with ``AudioTooLongError``, as for Gemma 4: the reference places any length,
  but documents 750 as the cap; ``split_audio`` cuts a recording into clips.

Path inputs are decoded with Pillow (as for Gemma 4); the reference's torchvision backend decodes
paths with torchcodec or torchvision, whose JPEG decoder may differ from Pillow's. PIL images and
arrays take the reference's path exactly, except RGBA arrays, which are composited onto white with
the Pillow backend's formula (``models.processing.image_processor``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from models.processing.audio import AudioInput, AudioTooLongError, ProcessedAudio, load_audio
from models.processing.image_processor import Gemma4ImageProcessor, ImageInput, ProcessedImage, _patchify, target_size
from models.processing.settings import PROCESSOR_DEFAULTS, UNIFIED_AUDIO_DEFAULTS
from models.processing.video import Gemma4VideoProcessor, resize_uint8_bicubic

# torch's arithmetic for ``uint8 tensor * (1 / 255)``: both operands float32.
_RESCALE = np.float32(1 / 255)


class Gemma4UnifiedImageProcessor(Gemma4ImageProcessor):
    """Images to ``ProcessedImage`` s whose rows are merged ``(patch * pool)``-pixel patches, one per soft token."""

    def process(self, image: ImageInput, max_soft_tokens: int | None = None) -> ProcessedImage:
        budget = self.max_soft_tokens if max_soft_tokens is None else max_soft_tokens
        rgb, source = self.load_rgb(image)
        height, width = target_size(rgb.height, rgb.width, budget, self.patch_size, self.pooling_kernel_size)
        pixels = np.asarray(rgb)
        if (height, width) != pixels.shape[:2]:
            pixels = resize_uint8_bicubic(pixels, height, width)
        patches, position_ids = _patchify(pixels.astype(np.float32) * _RESCALE, self.patch_size * self.pooling_kernel_size)
        return ProcessedImage(patches, position_ids, len(patches), height, width, source)


def unified_video_processor(settings: Mapping | None, patch_size: int, pooling_kernel_size: int) -> Gemma4VideoProcessor:
    """Gemma 4's video processor cutting merged ``patch_size * pooling_kernel_size`` patches (module docstring)."""
    return Gemma4VideoProcessor(settings, patch_size * pooling_kernel_size, 1)


class Gemma4UnifiedAudioProcessor:
    """Audio inputs to ``ProcessedAudio`` whose ``features`` are ``[tokens, samples per token]`` waveform frames.

    ``settings`` is the ``audio`` part of ``ProcessorSettings`` read with ``UNIFIED_AUDIO_DEFAULTS``;
    ``samples_per_token`` is what the model's audio embedder reads (``audio_embed_dim``) and must
    agree with the settings."""

    def __init__(
        self, settings: Mapping | None = None, audio_seq_length: int = PROCESSOR_DEFAULTS["audio_seq_length"],
        samples_per_token: int | None = None,
    ):  # fmt: skip
        from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

        self.settings = {**UNIFIED_AUDIO_DEFAULTS, **(settings or {})}
        self.extractor = Gemma4UnifiedAudioFeatureExtractor(**self.settings)
        self.samples_per_token = int(self.extractor.audio_samples_per_token)
        self.sampling_rate = int(self.extractor.sampling_rate)
        self.audio_seq_length = int(audio_seq_length)
        for name, value in (("feature_size", self.extractor.feature_size), ("model audio_embed_dim", samples_per_token)):
            if value is not None and int(value) != self.samples_per_token:
                raise ValueError(
                    f"Gemma4UnifiedAudioProcessor: audio_samples_per_token {self.samples_per_token} differs from the "
                    f"{name} {value}; the embedder reads one frame of its width per soft token"
                )

    def process(self, audio: AudioInput | ProcessedAudio) -> ProcessedAudio:
        if isinstance(audio, ProcessedAudio):
            return audio
        limit = self.audio_seq_length * self.samples_per_token / self.sampling_rate
        samples, name = load_audio(audio, self.sampling_rate, limit)
        tokens = -(-len(samples) // self.samples_per_token)
        if tokens > self.audio_seq_length:
            seconds = len(samples) / self.sampling_rate
            raise AudioTooLongError(
                f"audio {name} lasts {seconds:.2f} s ({tokens} soft tokens); one clip may hold at most "
                f"{self.audio_seq_length} soft tokens ({limit:g} s, the processor's audio_seq_length). Split it "
                "(models.processing.audio.split_audio) and give each piece its own <|audio|> placeholder"
            )
        out = self.extractor([samples], return_tensors="np")
        features, mask = out["input_features"][0], out["input_features_mask"][0]
        if features.shape[0] != tokens or not mask.all():
            raise AssertionError(f"audio {name}: the extractor gave {features.shape[0]} frames, expected {tokens}")
        return ProcessedAudio(np.ascontiguousarray(features, dtype=np.float32), tokens, len(samples), self.sampling_rate, name)

    def __call__(self, audio: Sequence[AudioInput]) -> list[ProcessedAudio]:
        return [self.process(a) for a in audio]
