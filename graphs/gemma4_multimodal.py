"""Gemma 4 with images, video and audio (transformers 5.24 ``Gemma4ForConditionalGeneration``) as an MLX graph.

The vision tower and embedder turn each image and each video frame into soft-token features, the
audio tower and its embedder each audio clip (E2B/E4B); the text decoder reads a prompt whose media
positions hold those features, as transformers' ``modeling_gemma4.py`` does:

* media positions (image, video and audio tokens) are embedded as ``pad_token_id`` and then
  overwritten by the features in sequence order (the reference scatters images, then video, then
  audio, each into its own token positions; one scatter in sequence order is the same);
* per-layer inputs (PLE) take their token part from the ids with media tokens replaced by pad and
  their context part from the merged embeddings;
* a prefill read that holds media goes through the cache's ``vision_prefill`` read with one block
  per run of media tokens (``media_blocks``). The reference's mask (``get_block_sequence_ids_for_mask``
  over ``mm_token_type_ids``) overlays only image (type 1) and video (type 2) runs: with
  ``use_bidirectional_attention == "vision"`` the sliding layers see a whole image or video frame
  (window-limited), full layers stay causal; audio (type 3) is causal on every layer. Runs without
  an overlay get negative block ids, so that the cache still refuses a read that splits them.
  Decode steps are plain text.

The decoder loop is ``Gemma4TextModel.forward``'s: it embeds through ``embed`` and
``per_layer_inputs``, which ``Gemma4LanguageModel`` extends to image positions, so every
optimisation of the text decoder applies unchanged.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig

from .gemma4_text import Gemma4TextModel
from cache import Read

from .gemma4_audio import Gemma4AudioTower
from .gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images, image_blocks, place_image_features


class ImageTokens(NamedTuple):
    """What the decoder embeds for a chunk with images: ids with image tokens replaced by pad,
    where the images are, and their features in sequence order."""

    ids: mx.array  # [B, L]
    is_image: np.ndarray  # [B, L] bool: every media position (image, video frame, audio)
    features: mx.array  # [number of media positions, text hidden]


class Gemma4LanguageModel(Gemma4TextModel):
    """The text decoder of a multimodal checkpoint: image tokens embed as pad, or as image features.

    Without features (a decode step that sampled the image token, a prompt given without its
    images) an image token is embedded as pad, as the reference does.
    """

    def __init__(self, config: Gemma4MultimodalConfig):
        super().__init__(config.text)
        self._media_token_ids = media_token_list(config)
        self._pad_token_id = config.pad_token_id

    def embed(self, tokens) -> mx.array:
        if not isinstance(tokens, ImageTokens):
            return super().embed(self._text_ids(tokens))
        return place_image_features(super().embed(tokens.ids), tokens.is_image, tokens.features, "Gemma4MultimodalModel")

    def per_layer_inputs(self, tokens, embedded: mx.array) -> mx.array:
        ids = tokens.ids if isinstance(tokens, ImageTokens) else self._text_ids(tokens)
        return super().per_layer_inputs(ids, embedded)

    def _text_ids(self, input_ids: mx.array) -> mx.array:
        media = mx.zeros(input_ids.shape, dtype=mx.bool_)
        for token in self._media_token_ids:
            media = media | (input_ids == token)
        return mx.where(media, self._pad_token_id, input_ids)


class Gemma4MultimodalModel(nn.Module):
    """Vision tower, embedder and text decoder; parameter names are transformers' below ``model.``.

    ``model(ids, cache, last_only)`` is the text forward (as ``Gemma4TextModel``); with
    ``image_features`` (the rows of every image inside ``ids``, in order) the images are merged and
    the read is ``vision_prefill``. ``image_features`` gives the features of processed images.
    """

    def __init__(self, config: Gemma4MultimodalConfig):
        super().__init__()
        self.config = config
        self.language_model = Gemma4LanguageModel(config)
        self.vision_tower = Gemma4VisionTower(config.vision)
        self.embed_vision = Gemma4MultimodalEmbedder(
            config.vision.hidden_size, config.text.hidden_size, config.vision.rms_norm_eps
        )
        if config.audio is not None:
            self.audio_tower = Gemma4AudioTower(config.audio)
            self.embed_audio = Gemma4MultimodalEmbedder(config.audio.output_proj_dims, config.text.hidden_size, config.audio.rms_norm_eps)

    def make_cache(self) -> list:
        return self.language_model.make_cache()

    def image_features(self, images: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[mx.array]:
        """Text-space features ``[n_i, hidden]`` of each ``(patches, position_ids)``, in order."""
        return encode_images(self.vision_tower, self.embed_vision, images)

    @property
    def has_audio(self) -> bool:
        return self.config.audio is not None

    def audio_features(self, clips: Sequence[np.ndarray]) -> list[mx.array]:
        """Text-space features ``[n_i, hidden]`` of each clip's valid log-mel frames ``[T_i, 128]``, in order.

        One clip per tower call: clips of different lengths never share a padded batch."""
        if self.config.audio is None:
            raise ValueError("Gemma4MultimodalModel: this checkpoint has no audio tower")
        return [self.embed_audio(self.audio_tower(frames)) for frames in clips]

    def __call__(
        self, input_ids: mx.array, cache: list | None = None, last_only: bool = False, image_features: mx.array | None = None,
        with_hidden: bool = False,
    ) -> mx.array:
        """Logits of ``input_ids`` appended to ``cache`` (a fresh one when None).

        ``image_features`` ``[n, hidden]`` must hold exactly one row per media token (image, video,
        audio) in ``input_ids``, in sequence order (every clip and frame of this read, whole).
        Without it the call is the text model's.
        ``with_hidden`` also returns the final normed hidden states (as ``Gemma4TextModel``).
        """
        if image_features is None:
            return self.language_model(input_ids, cache=cache, last_only=last_only, with_hidden=with_hidden)
        ids = np.array(input_ids)
        is_media = np.isin(ids, media_token_list(self.config))
        tokens = ImageTokens(mx.array(np.where(is_media, self.config.pad_token_id, ids)), is_media, image_features)
        cache = self.make_cache() if cache is None else cache
        read = self._prefill_read(ids, cache)
        return self.language_model.forward(tokens, cache, read, last_only=last_only, with_hidden=with_hidden)

    def _prefill_read(self, ids: np.ndarray, cache: list) -> Read:
        mode = self.config.text.use_bidirectional_attention
        if mode == "all":
            if cache[0].offset:
                raise ValueError("Gemma 4 use_bidirectional_attention='all' encodes a whole sequence at once; "
                                 "it has no incremental (cached) prefill")
            return Read.bidirectional()
        return Read.vision_prefill(mx.array(media_blocks(ids, self.config)))


def media_token_list(config: Gemma4MultimodalConfig) -> list[int]:
    """The ids whose positions hold media features: image, video and audio soft tokens."""
    return [config.image_tokens.image, config.media_tokens.video, config.media_tokens.audio]


def media_blocks(ids: np.ndarray, config: Gemma4MultimodalConfig) -> np.ndarray:
    """``[B, L]`` block ids of a read (``cache.Read.vision_prefill``): each maximal run of image or
    video tokens gets its index (>= 0, the bidirectional overlay on sliding layers) when the config
    has ``use_bidirectional_attention == "vision"``; audio runs, and image/video runs without that
    setting, get ``-2 - index`` (causal, but never split across reads); text is -1."""
    vision = np.isin(ids, [config.image_tokens.image, config.media_tokens.video])
    audio = ids == config.media_tokens.audio
    vision_runs, audio_runs = image_blocks(vision), image_blocks(audio)
    blocks = np.full(ids.shape, -1, dtype=np.int32)
    blocks[vision] = vision_runs[vision] if config.vision_bidirectional else -2 - vision_runs[vision]
    blocks[audio] = -2 - audio_runs[audio]
    return blocks
