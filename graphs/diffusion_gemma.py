"""DiffusionGemma (transformers 5.24 ``DiffusionGemmaForBlockDiffusion``) as an MLX graph.

One stack of Gemma 4 layers serves two passes that share every weight but their ``layer_scalar``:

- the **encoder** (``encode``) is a causal Gemma 4 pass whose only product is the KV cache: the
  prompt, then each committed block, go through the cache's ``encoder`` read (full layers
  ``causal OR same image``, sliding layers ``(causal AND window) OR same image``). Its hidden
  states and logits are never used, so none are computed past the last cache write (MLX evaluates
  only what the caches need).
- the **decoder** (``decode``) denoises a canvas of ``canvas_length`` tokens through the cache's
  ``canvas`` read, which writes nothing and lets the canvas see the cached prefix (sliding layers:
  the newest ``window - 1`` positions) and itself bidirectionally. Its input is
  ``rms(E[canvas] * sqrt(H) + SC)``, always unit-RMS, where ``SC`` is the self-conditioning MLP
  applied to the soft embedding ``softmax(previous processed logits) @ E * sqrt(H)``; its logits
  are computed in float32 and softcapped.

Every layer is the Gemma 4 layer with MoE beside the dense MLP and K=V on full layers
(``graphs.gemma4_text``); images go through the Gemma 4 vision tower and embedder
(``graphs.gemma4_vision``) and replace the prompt's image tokens. Parameter names are
transformers' decoder names (``layers.{l}...``, ``norm``, ``self_conditioning``, ``embed_tokens``)
plus ``layers.{l}.encoder_layer_scalar``, ``vision_tower`` and ``embed_vision``; the checkpoint
mapping is ``weights.diffusion_gemma_keys``.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cache import KVCache, RotatingKVCache, cpu_math
from graphs.diffusion_gemma_config import DiffusionGemmaConfig
from graphs.gemma4_text_config import SLIDING

from .gemma4_text import DecoderLayer
from .gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images
from .layers import RMSNorm, RoPE, float_dtype, gelu_gated, softcap
from .speedups import VocabularyHead

ENCODER_READ, CANVAS_READ = "encoder", "canvas"


class DiffusionLayer(DecoderLayer):
    """A Gemma 4 layer that also carries the encoder's own ``layer_scalar``.

    The reference ties every encoder parameter to the decoder's but not the ``layer_scalar``
    buffers, so the pass picks its scalar: ``encoder_layer_scalar`` for ``encoder`` reads,
    ``layer_scalar`` (the decoder's) for ``canvas`` reads. The body is Gemma 4's
    ``DecoderLayer.__call__`` without per-layer inputs, repeated here because that one applies
    ``layer_scalar`` itself.
    """

    def __init__(self, config, geometry, rope: RoPE):
        super().__init__(config, geometry, rope)
        self.encoder_layer_scalar = mx.ones((1,))

    def __call__(self, x: mx.array, cache, offset: int, read: str, read_args: dict) -> mx.array:
        attended = self.self_attn(self.input_layernorm(x), cache, offset, read, read_args)
        h = x + self.post_attention_layernorm(attended)
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        # The router and the experts read the post-attention residual, not the dense MLP's input.
        weights, indices = self.router(h)
        routed = self.post_feedforward_layernorm_2(self.experts(self.pre_feedforward_layernorm_2(h), indices, weights))
        h = h + self.post_feedforward_layernorm(dense + routed)
        return h * (self.encoder_layer_scalar if read == ENCODER_READ else self.layer_scalar)


class SelfConditioning(nn.Module):
    """``rms(embedded + down(gelu(gate(n)) * up(n)))`` with ``n = pre_norm(soft)``; the outer norm has no weight.

    Without a signal (the first step of a block) the MLP of zeros is exactly zero, so it is skipped.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.pre_norm = RMSNorm(hidden_size, eps)
        self.post_norm = RMSNorm(hidden_size, eps, with_weight=False)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, embedded: mx.array, soft: mx.array | None) -> mx.array:
        if soft is None:
            return self.post_norm(embedded)
        normed = self.pre_norm(soft)
        signal = self.down_proj(gelu_gated(self.up_proj(normed), self.gate_proj(normed)))
        return self.post_norm(embedded + signal)


class DiffusionGemmaModel(VocabularyHead, nn.Module):
    """The encoder/decoder stack, the self-conditioning block and (when configured) the vision tower."""

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        text = config.text
        H = text.hidden_size
        ropes = {t: RoPE(text.head_dim_of(t), text.rope_parameters[t]) for t in sorted(set(text.layer_types))}
        self.embed_tokens = nn.Embedding(text.vocab_size, H)
        self.layers = [DiffusionLayer(text, g, ropes[g.layer_type]) for g in text.layers]
        self.norm = RMSNorm(H, text.rms_norm_eps)
        self.self_conditioning = SelfConditioning(H, text.intermediate_size, text.rms_norm_eps)
        if config.vision is not None:
            self.vision_tower = Gemma4VisionTower(config.vision)
            self.embed_vision = Gemma4MultimodalEmbedder(config.vision.hidden_size, H, config.vision.rms_norm_eps)

    # ------------------------------------------------------------------------------ caches
    def make_cache(self) -> list:
        """``RotatingKVCache(window)`` on sliding layers (bounded by the window), ``KVCache`` on full layers."""
        text = self.config.text
        return [RotatingKVCache(text.sliding_window) if t == SLIDING else KVCache() for t in text.layer_types]

    # ------------------------------------------------------------------------------ encoder
    def image_features(self, images: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[mx.array]:
        """Text-space features ``[n_i, H]`` of each ``(patches, position_ids)`` (``models.processing.image_processor``)."""
        if "vision_tower" not in self:
            raise ValueError("DiffusionGemma: this checkpoint has no vision tower (no vision_config); images are not supported")
        return encode_images(self.vision_tower, self.embed_vision, images)

    def encode(self, input_ids: mx.array, cache: list, image_features: Sequence[mx.array] | None = None) -> None:
        """Append ``input_ids [B, L]`` to ``cache`` through every layer's ``encoder`` read.

        ``image_features`` (one ``[n_i, H]`` per image, in row-major order of appearance) replace
        the image tokens' embeddings, and with ``use_bidirectional_attention="vision"`` each
        maximal run of image tokens becomes one image block for the read's overlay. Without
        features every token is text, as for the reference's committed blocks (a generated image
        token is just a token). The caller must not split an image across two calls (the cache
        raises if it does).
        """
        self._check_cache(cache)
        h = self.embed(input_ids)
        overlay_id = None
        if image_features:
            h = self._place_images(input_ids, h, image_features)
            overlay_id = self.config.image_token_id if self.config.vision_overlay else None
        blocks = image_blocks(np.array(input_ids), overlay_id)
        offset = cache[0].offset
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, layer_cache, offset, ENCODER_READ, {"blocks": mx.array(blocks)})

    # ------------------------------------------------------------------------------ decoder
    def decode(self, canvas: mx.array, cache: list, self_conditioning: mx.array | None = None) -> mx.array:
        """Float32 softcapped logits ``[B, C, V]`` for ``canvas [B, C]`` over the cached prefix.

        ``self_conditioning`` is the previous step's processed logits ``[B, C, V]`` (None at a
        block's first step). The canvas sits at positions ``offset .. offset + C - 1``, right after
        the cached prefix; nothing is written to the cache.
        """
        self._check_cache(cache)
        h = self.embed(canvas)
        soft = None if self_conditioning is None else self.soft_embeddings(self_conditioning)
        h = self.self_conditioning(h, soft)
        offset = cache[0].offset
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, layer_cache, offset, CANVAS_READ, {})
        return self.logits(self.norm(h))

    def soft_embeddings(self, logits: mx.array) -> mx.array:
        """``softmax(logits) @ E * sqrt(H)``: the expected embedding under the previous prediction.

        The softmax runs in float32 and is rounded to the embedding dtype before the product, as
        in the reference."""
        table = self.embed_tokens
        probs = cpu_math.softmax(logits).astype(float_dtype(table))
        if "scales" in table:  # a quantized table: the same product on the packed rows
            expected = mx.quantized_matmul(
                probs, table.weight, table.scales, table.get("biases"), transpose=False,
                group_size=table.group_size, bits=table.bits, mode=table.mode,
            )  # fmt: skip
        else:
            expected = probs @ table.weight
        return expected * self._embed_scale()

    def embed(self, input_ids: mx.array) -> mx.array:
        """``E[ids] * sqrt(H)``, the scale cast to the weights' dtype first (bf16 rounds it, as the reference does)."""
        return self.embed_tokens(input_ids) * self._embed_scale()

    def logits(self, h: mx.array) -> mx.array:
        """The tied head in the weights' dtype, then float32 and ``cap * tanh(logits / cap)``."""
        out = self.head_product(h).astype(mx.float32)
        cap = self.config.text.final_logit_softcapping
        return softcap(out, cap)

    # ------------------------------------------------------------------------------ internals
    def _embed_scale(self) -> mx.array:
        return mx.array(math.sqrt(self.config.text.hidden_size), dtype=float_dtype(self.embed_tokens))

    def _place_images(self, input_ids: mx.array, h: mx.array, features: Sequence[mx.array]) -> mx.array:
        B, L, H = h.shape
        positions = np.flatnonzero(np.array(input_ids).reshape(-1) == self.config.image_token_id)
        rows = sum(f.shape[0] for f in features)
        if rows != positions.size:
            raise ValueError(
                f"DiffusionGemma: the prompt has {positions.size} image tokens but the images give {rows} features "
                f"({[f.shape[0] for f in features]} per image)"
            )
        flat = h.reshape(B * L, H)
        flat[mx.array(positions)] = mx.concatenate(list(features)).astype(h.dtype)
        return flat.reshape(B, L, H)

    def _check_cache(self, cache: list) -> None:
        if len(cache) != len(self.layers):
            raise ValueError(f"DiffusionGemma: cache has {len(cache)} entries for {len(self.layers)} layers")


def image_blocks(input_ids: np.ndarray, image_token_id: int | None) -> np.ndarray:
    """``[B, L]`` int32: for image tokens, the index of their maximal run in the row (0, 1, ...); -1 elsewhere.

    transformers' ``get_block_sequence_ids_for_mask``; with ``image_token_id=None`` (no vision
    overlay) every position is text.
    """
    if image_token_id is None:
        return np.full(input_ids.shape, -1, dtype=np.int32)
    is_image = input_ids == image_token_id
    starts = is_image & ~np.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
    return np.where(is_image, np.cumsum(starts, axis=1) - 1, -1).astype(np.int32)
