"""DiffusionGemma (transformers 5.24 ``DiffusionGemmaForBlockDiffusion``) as an MLX graph.

One stack of Gemma 4 layers serves two passes that share every weight but their ``layer_scalar``:

- the **encoder** (``prefill``) is a causal Gemma 4 pass whose only product is the KV cache: the
  prompt, then each committed block, go through the cache's ``encoder`` read (full layers
  ``causal OR same image``, sliding layers ``(causal AND window) OR same image``). Its hidden
  states and logits are never used, so none are computed past the last cache write (MLX evaluates
  only what the caches need).
- the **decoder** (``denoise``) denoises a canvas of ``canvas_length`` tokens through the cache's
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

from cache import KVCache, Read, RotatingKVCache

from graphs.diffusion_gemma_config import DiffusionGemmaConfig
from graphs.gemma4_text_config import SLIDING
from zoo_cpu import fast_math, prefill

from .gemma4_text import DecoderLayer
from .gemma4_vision import Gemma4MultimodalEmbedder, Gemma4VisionTower, encode_images, image_blocks, place_image_features
from .layers import CheckedCaches, RMSNorm, RoPE, float_dtype, gelu_gated, softcap
from .speedups import VocabularyHead


class DiffusionLayer(DecoderLayer):
    """A Gemma 4 layer that also carries the encoder's own ``layer_scalar``.

    The reference ties every encoder parameter to the decoder's but not the ``layer_scalar``
    buffers, so the pass picks its scalar: ``encoder_layer_scalar`` for ``encoder`` reads,
    ``layer_scalar`` (the decoder's) for ``canvas`` reads.
    """

    def __init__(self, config, geometry, rope: RoPE):
        super().__init__(config, geometry, rope)
        self.encoder_layer_scalar = mx.ones((1,))

    def scalar(self, read: Read) -> mx.array:
        return self.encoder_layer_scalar if read.name == "encoder" else self.layer_scalar


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


class DiffusionGemmaModel(VocabularyHead, CheckedCaches, nn.Module):
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

    def prefill(self, input_ids: mx.array, cache: list, image_features: Sequence[mx.array] | None = None) -> None:
        """Append ``input_ids [B, L]`` to ``cache`` through every layer's ``encoder`` read.

        ``image_features`` (one ``[n_i, H]`` per image, in row-major order of appearance) replace
        the image tokens' embeddings, and with ``use_bidirectional_attention="vision"`` each
        maximal run of image tokens becomes one image block for the read's overlay. Without
        features every token is text, as for the reference's committed blocks (a generated image
        token is just a token). The caller must not split an image across two calls (the cache
        raises if it does).
        """
        self.check_cache(cache)
        h = self.embed(input_ids)
        is_image = np.zeros(input_ids.shape, dtype=bool)
        if image_features:
            is_image = np.array(input_ids) == self.config.image_token_id
            h = place_image_features(h, is_image, mx.concatenate(list(image_features)), "DiffusionGemma")
        read = Read.encoder(mx.array(image_blocks(is_image if self.config.vision_overlay else np.zeros_like(is_image))))
        offset = cache[0].offset
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, None, layer_cache, offset, read)

    # ------------------------------------------------------------------------------ decoder
    def denoise(self, canvas: mx.array, cache: list, self_conditioning: mx.array | None = None) -> mx.array:
        """Float32 softcapped logits ``[B, C, V]`` for ``canvas [B, C]`` over the cached prefix.

        ``self_conditioning`` is the previous step's processed logits ``[B, C, V]`` (None at a
        block's first step). The canvas sits at positions ``offset .. offset + C - 1``, right after
        the cached prefix; nothing is written to the cache.
        """
        soft = None if self_conditioning is None else self.soft_embeddings(self_conditioning)
        return self.logits(self.decoder_states(canvas, cache, soft))

    def decoder_states(self, canvas: mx.array, cache: list, soft: mx.array | None) -> mx.array:
        """The decoder's final-normed hidden states ``[B, C, H]`` given the soft embedding ``soft [B, C, H]``
        (``expected_embedding``; None at a block's first step): everything of ``denoise`` but the head.
        The generation loop calls it with the soft embedding made from the probabilities it samples from."""
        self.check_cache(cache)
        h = self.self_conditioning(self.embed(canvas), soft)
        offset = cache[0].offset
        read = Read.canvas()
        for layer, layer_cache in zip(self.layers, cache):
            h = layer(h, None, layer_cache, offset, read)
        return self.norm(h)

    def soft_embeddings(self, logits: mx.array) -> mx.array:
        """``softmax(logits) @ E * sqrt(H)``: the expected embedding under the previous prediction.

        The softmax runs in float32 and is rounded to the embedding dtype before the product, as
        in the reference."""
        return self.expected_embedding(fast_math.softmax(logits))

    def expected_embedding(self, probs: mx.array) -> mx.array:
        """``probs @ E * sqrt(H)`` for float32 probabilities ``[B, C, V]``, rounded to the embedding
        dtype first; one product on the table as stored (``[V, H]``: the extension's kernel for a
        weight stored transposed where it takes float32, 15-40% faster than the BLAS's there, else
        the BLAS), or the quantized product on its packed rows."""
        table = self.embed_tokens
        probs = probs.astype(float_dtype(table))
        if "scales" in table:
            expected = mx.quantized_matmul(
                probs, table.weight, table.scales, table.get("biases"), transpose=False,
                group_size=table.group_size, bits=table.bits, mode=table.mode,
            )  # fmt: skip
        elif prefill.takes_linear(probs, table.weight):
            expected = prefill.linear(probs, table.weight, transposed=True)
        else:
            expected = probs @ table.weight
        return expected * self._embed_scale()

    def split_head(self, parts: int) -> str | None:
        """Left as stored: every head product here has a canvas of rows, which the extension's GEMM
        takes on the row-major table (``head_product``), about twice the BLAS's speed on
        ``h @ E^T`` from the transposed copy (``docs/diffusion.md``)."""
        return None

    def head_product(self, h: mx.array) -> mx.array:
        """``h @ E^T``: the extension's GEMM where it takes the product (float32, a canvas of rows,
        the CPU backend's prefill kernels), else the tied head as ``VocabularyHead`` computes it."""
        weight = self.embed_tokens.get("weight")
        if "scales" not in self.embed_tokens and prefill.takes_linear(h, weight):
            return prefill.linear(h, weight)
        return super().head_product(h)

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
