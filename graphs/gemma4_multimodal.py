"""Gemma 4 with images (transformers 5.24 ``Gemma4ForConditionalGeneration``) as an MLX graph.

The vision tower and embedder turn each image into soft-token features; the text decoder reads a
prompt whose image positions hold those features, as transformers' ``modeling_gemma4.py`` does:

* image positions are embedded as ``pad_token_id`` and then overwritten by the features in
  sequence order (transformers' ``masked_scatter``);
* per-layer inputs (PLE) take their token part from the ids with image tokens replaced by pad and
  their context part from the merged embeddings;
* a prefill read that holds images goes through the cache's ``vision_prefill`` read with one block
  per run of image tokens when the config asks for vision bidirectionality (sliding layers see the
  whole image, window-limited; full layers stay causal), through ``window`` otherwise. Decode
  steps are plain text.

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

from .gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images, image_blocks, place_image_features


class ImageTokens(NamedTuple):
    """What the decoder embeds for a chunk with images: ids with image tokens replaced by pad,
    where the images are, and their features in sequence order."""

    ids: mx.array  # [B, L]
    is_image: np.ndarray  # [B, L] bool
    features: mx.array  # [number of image positions, text hidden]


class Gemma4LanguageModel(Gemma4TextModel):
    """The text decoder of a multimodal checkpoint: image tokens embed as pad, or as image features.

    Without features (a decode step that sampled the image token, a prompt given without its
    images) an image token is embedded as pad, as the reference does.
    """

    def __init__(self, config: Gemma4MultimodalConfig):
        super().__init__(config.text)
        self._image_token_id = config.image_tokens.image
        self._pad_token_id = config.pad_token_id

    def embed(self, tokens) -> mx.array:
        if not isinstance(tokens, ImageTokens):
            return super().embed(self._text_ids(tokens))
        return place_image_features(super().embed(tokens.ids), tokens.is_image, tokens.features, "Gemma4MultimodalModel")

    def per_layer_inputs(self, tokens, embedded: mx.array) -> mx.array:
        ids = tokens.ids if isinstance(tokens, ImageTokens) else self._text_ids(tokens)
        return super().per_layer_inputs(ids, embedded)

    def _text_ids(self, input_ids: mx.array) -> mx.array:
        return mx.where(input_ids == self._image_token_id, self._pad_token_id, input_ids)


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

    def make_cache(self) -> list:
        return self.language_model.make_cache()

    def image_features(self, images: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[mx.array]:
        """Text-space features ``[n_i, hidden]`` of each ``(patches, position_ids)``, in order."""
        return encode_images(self.vision_tower, self.embed_vision, images)

    def __call__(
        self, input_ids: mx.array, cache: list | None = None, last_only: bool = False, image_features: mx.array | None = None,
        with_hidden: bool = False,
    ) -> mx.array:
        """Logits of ``input_ids`` appended to ``cache`` (a fresh one when None).

        ``image_features`` ``[n, hidden]`` must hold exactly one row per image token in
        ``input_ids`` (every image of this read, whole). Without it the call is the text model's.
        ``with_hidden`` also returns the final normed hidden states (as ``Gemma4TextModel``).
        """
        if image_features is None:
            return self.language_model(input_ids, cache=cache, last_only=last_only, with_hidden=with_hidden)
        ids = np.array(input_ids)
        is_image = ids == self.config.image_tokens.image
        tokens = ImageTokens(mx.array(np.where(is_image, self.config.pad_token_id, ids)), is_image, image_features)
        cache = self.make_cache() if cache is None else cache
        read = self._prefill_read(is_image, cache)
        return self.language_model.forward(tokens, cache, read, last_only=last_only, with_hidden=with_hidden)

    def _prefill_read(self, is_image: np.ndarray, cache: list) -> Read:
        mode = self.config.text.use_bidirectional_attention
        if mode == "all":
            if cache[0].offset:
                raise ValueError("Gemma 4 use_bidirectional_attention='all' encodes a whole sequence at once; "
                                 "it has no incremental (cached) prefill")
            return Read.bidirectional()
        if mode == "vision":
            return Read.vision_prefill(mx.array(image_blocks(is_image)))
        return Read.window()
