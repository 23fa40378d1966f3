"""What ``models.load`` returns for Gemma 4 unified (12B): a ``Model`` with the unified processors.

Everything but preprocessing is ``Model``'s (prompts, chat, generation, speculative decoding): the
graph takes the same calls as Gemma 4's multimodal graph. Images and video frames are cut into
merged 48 px patches and audio into raw waveform frames (``models.processing.unified``), with the
checkpoint's settings (``processor_config.json`` / ``preprocessor_config.json``; the feature
extractor's are the unified ones, family ``gemma4_unified`` of ``models.processing.settings``).
"""

from __future__ import annotations

from models.model import Model
from models.processing.settings import ProcessorSettings
from models.processing.unified import Gemma4UnifiedAudioProcessor, Gemma4UnifiedImageProcessor, unified_video_processor


class UnifiedModel(Model):
    """``Model`` for ``gemma4_unified`` checkpoints."""

    @property
    def processor_settings(self) -> ProcessorSettings:
        if self._settings is None:
            self._settings = ProcessorSettings.from_folder(self.path, "gemma4_unified")
        return self._settings

    def image_processor(self, max_soft_tokens: int | None = None) -> Gemma4UnifiedImageProcessor:
        processor = super().image_processor(max_soft_tokens)
        return Gemma4UnifiedImageProcessor(processor.max_soft_tokens, processor.patch_size, processor.pooling_kernel_size)

    def video_processor(self):
        vision = self.config.vision
        return unified_video_processor(self.processor_settings.video, vision.patch_size, vision.pooling_kernel_size)

    def audio_processor(self) -> Gemma4UnifiedAudioProcessor:
        settings = self.processor_settings
        return Gemma4UnifiedAudioProcessor(settings.audio, settings.processor["audio_seq_length"], self.config.audio.audio_embed_dim)
