"""Gemma 4 12B "unified" (transformers 5.24 ``Gemma4UnifiedForConditionalGeneration``) as an MLX graph.

There is no vision or audio tower. Each soft token is one input row projected into the text
model's space, as ``modeling_gemma4_unified.py`` does:

* an image or video frame is cut into merged ``48 x 48`` pixel patches (the processor's
  ``patches_merge``); each patch goes LayerNorm -> Linear -> LayerNorm, plus the sum of a learned
  column and row embedding (``pos_embedding[x, 0] + pos_embedding[y, 1]``), LayerNorm
  (``Gemma4UnifiedVisionEmbedder``), then the weightless RMSNorm and projection every Gemma 4
  embedder has (``embed_vision``);
* an audio clip is cut into raw waveform frames of 640 samples (40 ms at 16 kHz); each frame goes
  through that RMSNorm and projection (``embed_audio``).

Every row is independent (no attention among patches or frames), so all images of a call go
through the embedder together, as batches of at most ``ROWS_PER_CALL`` rows.

The text decoder is Gemma 4's (``Gemma4LanguageModel``: no per-layer inputs, no MoE in this
family) and the prompt plumbing is ``Gemma4MultimodalModel``'s. The mask differs from Gemma 4's:
the reference builds it with ``create_masks_for_generate`` and ``block_sequence_ids`` from
``mm_token_type_ids``, which overlays each image or video-frame run (types 1 and 2) on *every*
layer, not only the sliding ones: full layers see ``causal OR same span``, sliding layers
``(causal AND window) OR same span`` (the overlay not limited by the window). That is the cache's
``encoder`` read. Audio (type 3) stays causal; a read without an overlaid span takes the
``vision_prefill`` read, whose spans are all causal (its fast masks), and every span still goes
whole into one read.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cache import Read
from graphs.gemma4_unified_config import Gemma4UnifiedConfig, Gemma4UnifiedVisionConfig

from .gemma4_multimodal import Gemma4LanguageModel, Gemma4MultimodalModel, media_blocks
from .gemma4_vision import Gemma4MultimodalEmbedder
from .layers import float_dtype

# torch.nn.LayerNorm's default, which the reference's three vision LayerNorms keep.
LAYER_NORM_EPS = 1e-5
# Elements summed per partial sum in ``PairwiseLayerNorm``.
_BLOCK = 128
# Patch rows per embedder call: one image at the largest budget (1120 soft tokens) goes in one, and
# many images or video frames never hold more than this many 6912-wide rows and their activations.
ROWS_PER_CALL = 2048


def _mean(x: mx.array) -> mx.array:
    """The float32 mean over the last axis as sums of ``_BLOCK``-element blocks, then of the blocks.

    One running float32 sum over a merged patch's 6912 pixel values (all positive, mean about 0.5)
    is off by about 3e-6 relative (MLX's ``mean`` and ``fast.layer_norm`` on the CPU); torch's
    reduction sums in a tree and is off by 3e-7. The error of the mean is amplified by the
    LayerNorm's 1/std (about 3.5 for pixels) and then by the decoder: on a tiny random model with
    unit norm weights the features moved 1.3e-5 from float64 and the logits 2.7e-4 with one running
    sum, 2e-6 and 6e-5 with blocks (torch: 1.5e-6 and 4e-5). ``docs/unified.md``.
    """
    n = x.shape[-1]
    pad = -n % _BLOCK
    if pad:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    blocks = x.reshape(*x.shape[:-1], -1, _BLOCK).sum(axis=-1)
    return blocks.sum(axis=-1, keepdims=True) / n


class PairwiseLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters) with the mean and variance summed in blocks (``_mean``), in float32."""

    def __call__(self, x: mx.array) -> mx.array:
        dtype = x.dtype
        x = x.astype(mx.float32)
        centred = x - _mean(x)
        normed = centred * mx.rsqrt(_mean(centred * centred) + self.eps)
        return (normed * self.weight.astype(mx.float32) + self.bias.astype(mx.float32)).astype(dtype)


class Gemma4UnifiedVisionEmbedder(nn.Module):
    """Merged pixel patches ``[..., 48*48*3]`` and their ``(x, y)`` cells to ``[..., mm_embed_dim]``."""

    def __init__(self, config: Gemma4UnifiedVisionConfig):
        super().__init__()
        self.config = config
        width = config.mm_embed_dim
        self.patch_ln1 = PairwiseLayerNorm(config.patch_dim, eps=LAYER_NORM_EPS)
        self.patch_dense = nn.Linear(config.patch_dim, width)
        self.patch_ln2 = PairwiseLayerNorm(width, eps=LAYER_NORM_EPS)
        self.pos_embedding = mx.zeros((config.mm_posemb_size, 2, width))
        self.pos_norm = PairwiseLayerNorm(width, eps=LAYER_NORM_EPS)

    def __call__(self, patches: mx.array, position_ids: np.ndarray) -> mx.array:
        """``patches [N, patch_dim]`` (no padding rows) at ``position_ids [N, 2]`` (column, row)."""
        positions = np.asarray(position_ids)
        limit = self.config.mm_posemb_size
        if positions.shape != (patches.shape[0], 2) or patches.shape[-1] != self.config.patch_dim:
            raise ValueError(
                f"Gemma4UnifiedVisionEmbedder: expected patches [N, {self.config.patch_dim}] and positions [N, 2], "
                f"got {list(patches.shape)} and {list(positions.shape)}"
            )
        if positions.size and (positions.min() < 0 or positions.max() >= limit):
            raise ValueError(
                f"Gemma4UnifiedVisionEmbedder: patch positions must lie in [0, {limit}) (mm_posemb_size), "
                f"got [{positions.min()}, {positions.max()}]"
            )
        h = self.patch_ln2(self.patch_dense(self.patch_ln1(patches.astype(float_dtype(self.patch_dense)))))
        x, y = mx.array(positions[:, 0]), mx.array(positions[:, 1])
        return self.pos_norm(h + self.pos_embedding[x, 0] + self.pos_embedding[y, 1])


class Gemma4UnifiedModel(Gemma4MultimodalModel):
    """Text decoder and the media embedders; parameter names are the Hub checkpoint's below ``model.``
    (``language_model``, ``vision_embedder``, ``embed_vision``, ``embed_audio``; also mlx-vlm's).

    The call is ``Gemma4MultimodalModel``'s (``image_features`` rows fill the image, video and
    audio positions, in sequence order); only the prefill read differs (module docstring).
    """

    def __init__(self, config: Gemma4UnifiedConfig):
        nn.Module.__init__(self)  # not the parent's towers: the embedders below replace them
        self.config = config
        self.language_model = Gemma4LanguageModel(config)
        hidden = config.text.hidden_size
        if config.vision is not None:
            self.vision_embedder = Gemma4UnifiedVisionEmbedder(config.vision)
            self.embed_vision = Gemma4MultimodalEmbedder(config.vision.output_proj_dims, hidden, config.vision.rms_norm_eps)
        if config.audio is not None:
            self.embed_audio = Gemma4MultimodalEmbedder(config.audio.audio_embed_dim, hidden, config.audio.rms_norm_eps)

    @property
    def has_vision(self) -> bool:
        return self.config.vision is not None

    def image_features(self, images: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[mx.array]:
        """Text-space features ``[n_i, hidden]`` of each ``(merged patches [n_i, 6912], positions [n_i, 2])``."""
        if self.config.vision is None:
            raise ValueError("Gemma4UnifiedModel: this checkpoint has no vision embedder (vision_config is null)")
        if not images:
            return []
        patches = np.concatenate([np.asarray(p, dtype=np.float32).reshape(-1, self.config.vision.patch_dim) for p, _ in images])
        positions = np.concatenate([np.asarray(q).reshape(-1, 2) for _, q in images])
        rows = mx.concatenate([
            self.embed_vision(self.vision_embedder(mx.array(patches[i : i + ROWS_PER_CALL]), positions[i : i + ROWS_PER_CALL]))
            for i in range(0, len(patches), ROWS_PER_CALL)
        ])  # fmt: skip
        bounds = np.cumsum([np.asarray(q).reshape(-1, 2).shape[0] for _, q in images])[:-1]
        return mx.split(rows, bounds.tolist()) if len(images) > 1 else [rows]

    def audio_features(self, clips: Sequence[np.ndarray]) -> list[mx.array]:
        """Text-space features ``[n_i, hidden]`` of each clip's waveform frames ``[n_i, 640]``."""
        if self.config.audio is None:
            raise ValueError("Gemma4UnifiedModel: this checkpoint has no audio embedder (audio_config is null)")
        width = self.config.audio.audio_embed_dim
        dtype = float_dtype(self.embed_audio.embedding_projection)
        out = []
        for frames in clips:
            frames = mx.array(np.asarray(frames, dtype=np.float32))
            if frames.ndim != 2 or frames.shape[1] != width:
                raise ValueError(f"Gemma4UnifiedModel: audio frames must be [n, {width}], got {list(frames.shape)}")
            out.append(self.embed_audio(frames.astype(dtype)))
        return out

    def _prefill_read(self, ids: np.ndarray, cache: list) -> Read:
        if self.config.text.use_bidirectional_attention == "all":
            return super()._prefill_read(ids, cache)
        blocks = media_blocks(ids, self.config)
        if (blocks >= 0).any():
            return Read.encoder(mx.array(blocks))
        return Read.vision_prefill(mx.array(blocks))
