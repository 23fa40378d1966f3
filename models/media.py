"""Audio and video for ``Model``: processing with the checkpoint's settings, towers, and the prompt.

``Model`` mixes this in. A model without the tower a modality needs refuses that input by name
(``AudioNotSupportedError``, ``VideoNotSupportedError``), before any decoding: a text-only or
vision-only conversion never drops a clip silently. Settings come from the checkpoint folder
(``models.processing.settings``), reference defaults otherwise, and are read once.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from models.generation.media import VideoFeatures, expand_media_placeholders
from models.generation.prompts import Prompt
from models.processing.audio import AudioInput, Gemma4AudioProcessor, ProcessedAudio
from models.processing.settings import ProcessorSettings
from models.processing.video import Gemma4VideoProcessor, ProcessedVideo, VideoInput


class ModalityNotSupportedError(ValueError):
    """The model has no tower for this kind of input (the message names the model and why)."""


class AudioNotSupportedError(ModalityNotSupportedError):
    """Audio sent to a model without an audio tower (Gemma 4 31B/26B, text-only or audio-less conversions)."""


class VideoNotSupportedError(ModalityNotSupportedError):
    """Video sent to a model without a vision tower."""


class MediaMixin:
    """The audio and video calls of ``Model`` (``self.graph``, ``self.config``, ``self.path`` are Model's)."""

    _settings: ProcessorSettings | None = None

    @property
    def processor_settings(self) -> ProcessorSettings:
        """The checkpoint's preprocessing settings (``processor_config.json`` / ``preprocessor_config.json``)."""
        if self._settings is None:
            self._settings = ProcessorSettings.from_folder(self.path)
        return self._settings

    # ---------------------------------------------------------------------------------- audio
    @property
    def supports_audio(self) -> bool:
        """True for checkpoints whose audio tower is loaded (E2B/E4B with their audio weights)."""
        return bool(getattr(self.graph, "has_audio", False))

    def _check_audio(self) -> None:
        if self.supports_audio:
            return
        if getattr(self.graph, "image_features", None) is not None:
            why = "its config has no audio_config, or its weights no audio tower"
        else:
            why = f"a text model ({self.model_type})"
        raise AudioNotSupportedError(f"{self.path} has no audio tower ({why}); it cannot take audio input")

    def audio_processor(self) -> Gemma4AudioProcessor:
        settings = self.processor_settings
        return Gemma4AudioProcessor(settings.audio, settings.processor["audio_seq_length"])

    def process_audio(self, audio: Sequence[AudioInput | ProcessedAudio]) -> list[ProcessedAudio]:
        """Paths, ``(samples, rate)`` tuples or 16 kHz arrays as the audio tower reads them."""
        self._check_audio()
        processor = self.audio_processor()
        return [processor.process(clip) for clip in audio]

    def encode_audio(self, audio: Sequence[AudioInput | ProcessedAudio]) -> list[mx.array]:
        """Each clip's soft-token features ``[n_i, hidden]``, evaluated."""
        processed = self.process_audio(audio)
        features = self.graph.audio_features([clip.features for clip in processed])
        for clip, rows in zip(processed, features):
            if rows.shape[0] != clip.num_soft_tokens:
                raise AssertionError(f"audio {clip.source}: the tower gives {rows.shape[0]} soft tokens, the processor announced {clip.num_soft_tokens}")
        mx.eval(features)
        return features

    # ---------------------------------------------------------------------------------- video
    @property
    def supports_video(self) -> bool:
        """True for checkpoints with a vision tower (every Gemma 4 size reads video through it)."""
        return getattr(self.graph, "image_features", None) is not None and getattr(self.graph, "has_vision", True)

    def _check_video(self) -> None:
        if not self.supports_video:
            raise VideoNotSupportedError(f"{self.path} is a text model ({self.model_type} without a vision tower); it cannot take video input")

    def process_videos(
        self, videos: Sequence[VideoInput | ProcessedVideo], max_soft_tokens: int | None = None, num_frames: int | None = None
    ) -> list[ProcessedVideo]:
        """Paths or uint8 ``[frames, H, W, 3]`` arrays as sampled, resized frame patches."""
        self._check_video()
        processor = self.video_processor()
        return [v if isinstance(v, ProcessedVideo) else processor.process(v, max_soft_tokens, num_frames) for v in videos]

    def video_processor(self) -> Gemma4VideoProcessor:
        vision = self.config.vision
        return Gemma4VideoProcessor(self.processor_settings.video, vision.patch_size, vision.pooling_kernel_size)

    def encode_videos(
        self, videos: Sequence[VideoInput | ProcessedVideo], max_soft_tokens: int | None = None, num_frames: int | None = None
    ) -> list[VideoFeatures]:
        """Each video's frames through the vision tower and embedder: features per frame, and timestamps."""
        out = []
        for video in self.process_videos(videos, max_soft_tokens, num_frames):
            frames = self.graph.image_features([(patches, video.position_ids) for patches in video.patches])
            mx.eval(frames)
            out.append(VideoFeatures(tuple(frames), video.timestamps, video.source))
        return out

    # ---------------------------------------------------------------------------------- prompt
    def media_prompt(
        self,
        ids: list[int],
        images: Sequence = (),
        audio: Sequence = (),
        videos: Sequence = (),
        max_soft_tokens: int | None = None,
    ) -> Prompt:
        """``ids`` with every image, audio and video placeholder expanded and the features attached.

        Items may be inputs (paths, arrays) or already encoded features (``mx.array`` per image or
        clip, ``VideoFeatures`` per video), as a chat keeps them."""
        if audio:
            self._check_audio()
        if videos:
            self._check_video()
        if images:
            self._check_vision()
        image_features = _encoded(images, mx.array) or (self.encode_images(images, max_soft_tokens) if images else [])
        audio_features = _encoded(audio, mx.array) or (self.encode_audio(audio) if audio else [])
        video_features = _encoded(videos, VideoFeatures) or (self.encode_videos(videos) if videos else [])
        return expand_media_placeholders(
            ids,
            self.config.image_tokens,
            self.config.media_tokens,
            images=image_features,
            audio=audio_features,
            videos=video_features,
            encode_text=self._encode_plain,
        )

    def _encode_plain(self, text: str) -> list[int]:
        """``text`` as ids without BOS (timestamps inside a prompt)."""
        if self.tokenizer is None:
            raise ValueError(f"{self.path} has no tokenizer; video prompts need one to write each frame's timestamp")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def placeholder_errors(self, ids: Sequence[int]) -> None:
        """Refuse audio/video placeholders given without their inputs (as images already are)."""
        if not hasattr(self.config, "media_tokens"):
            return
        for name, token in (("audio", self.config.media_tokens.audio), ("video", self.config.media_tokens.video)):
            count = sum(1 for t in ids if t == token)
            if count:
                raise ValueError(f"the prompt has {count} {name} placeholders (token {token}) but no {name} was given")


def _encoded(items: Sequence, kind) -> list | None:
    """``items`` when every one is already encoded (``kind``), None when none is; a mix is refused."""
    if not items:
        return None
    flags = [isinstance(item, kind) for item in items]
    if all(flags):
        return list(items)
    if any(flags):
        raise ValueError("pass either inputs or encoded features for one modality, not a mix")
    return None
