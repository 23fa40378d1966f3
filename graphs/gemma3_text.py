"""The Gemma 3 text decoder (transformers 5.24 ``Gemma3ForCausalLM``) as an MLX graph.

Every attention is one read on the layer's cache (``cache/``): the graph computes normed, rotated
queries, keys and values and never builds a mask. What differs from Gemma 4 is small and all here:
norms scale by ``1 + weight``, scores by ``query_pre_attn_scalar ** -0.5``, keys and values keep
every layer's own projections, and full layers may use linearly scaled RoPE. The GeGLU MLP and the
RoPE kernel are the shared ones from ``graphs.layers``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn

from functools import partial

from cache import KVCache, PackedCache, Read, RotatingKVCache

from graphs.gemma3_text_config import FULL, SLIDING, Gemma3TextConfig
from zoo_cpu import fast_math

from .layers import CheckedCaches, GeGLUMLP, RoPE, SelfAttention, float_dtype, softcap
from .speedups import VocabularyHead


class GemmaRMSNorm(nn.Module):
    """Gemma 2/3 RMSNorm: ``x * rsqrt(mean(x²) + eps) * (1 + weight)``, weight initialised to zeros.

    As in the reference, the norm and the ``1 + weight`` scale are computed in float32 and the
    result is cast back to the input dtype, so bf16 weights are not rounded again after the +1.
    """

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The norm of ``x``, added to ``residual`` when given (one kernel node on the CPU)."""
        return fast_math.rms_norm(x, self.weight.astype(mx.float32), self.eps, shift=1.0, residual=residual)


def shared_rope(head_dim: int, params: Mapping[str, Any]) -> RoPE:
    """``graphs.layers.RoPE`` for a Gemma 3 layer type.

    Linear scaling divides every frequency by ``factor``. That is exactly ``layers.RoPE``'s
    ``proportional`` kind with every pair rotated (``partial_rotary_factor`` 1), whose periods are
    ``factor * theta^(2j/D)``; the default kind passes through unchanged.
    """
    if params["rope_type"] == "linear":
        params = {
            "rope_type": "proportional",
            "partial_rotary_factor": 1.0,
            "factor": params["factor"],
            "rope_theta": params["rope_theta"],
        }
    return RoPE(head_dim, params)


class DecoderLayer(nn.Module):
    """Sandwich-normed attention and GeGLU feed-forward, each added to the residual stream."""

    def __init__(self, config: Gemma3TextConfig, rope: RoPE):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(
            H, config.num_attention_heads, config.num_key_value_heads, config.head_dim, bias=config.attention_bias,
            rope=rope, scale=config.attention_scale, norm=lambda d: GemmaRMSNorm(d, eps), plus_one=True,
        )  # fmt: skip
        self.mlp = GeGLUMLP(H, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(H, eps)
        self.post_attention_layernorm = GemmaRMSNorm(H, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(H, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(H, eps)

    def __call__(self, x: mx.array, cache, offset: int, read: Read) -> mx.array:
        h = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cache, offset, read), residual=x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)), residual=h)


class Gemma3TextModel(VocabularyHead, CheckedCaches, nn.Module):
    """Gemma 3 text model with its tied (or separate) LM head: ``input_ids [B, L] -> logits [B, L, V]``.

    Parameter names are transformers' ``Gemma3TextModel`` names (no ``model.`` prefix); ``lm_head``
    exists only when embeddings are untied. Computation runs in the weights' dtype.
    """

    def __init__(self, config: Gemma3TextConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        ropes = {t: shared_rope(config.head_dim, config.rope_parameters[t]) for t in sorted(set(config.layer_types))}
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = [DecoderLayer(config, ropes[t]) for t in config.layer_types]
        self.norm = GemmaRMSNorm(H, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(H, config.vocab_size, bias=False)

    def split_head(self, parts: int) -> str | None:
        """As ``VocabularyHead``, except for an encoder (EmbeddingGemma: hidden states, no logits),
        whose table is only looked up: left as stored (no transposed copy of 805 MB made at load)."""
        return None if self.config.use_bidirectional_attention else super().split_head(parts)

    def make_cache(self) -> list:
        """One cache per layer: ``RotatingKVCache(sliding_window)`` on sliding layers, ``KVCache`` on full ones.

        The reference's sliding mask lets position p see keys in ``(p - sliding_window, p]``, which is
        the rotating cache's window semantics as is.
        """
        return [
            RotatingKVCache(self.config.sliding_window) if t == SLIDING else KVCache() for t in self.config.layer_types
        ]

    def __call__(self, input_ids: mx.array, cache: list | None = None, last_only: bool = False) -> mx.array:
        """Logits for every position of ``input_ids`` (only the last one with ``last_only``).

        Without ``cache`` this is the no-cache forward: fresh caches and one ``window`` read per layer.
        With one, the ids are appended: a ``window`` read for L > 1, a ``decode`` read for L == 1.
        """
        if self.config.use_bidirectional_attention:
            raise ValueError(
                "Gemma3TextModel: this config is a bidirectional encoder (use_bidirectional_attention: true), "
                "which has no causal forward or cache; run encode()"
            )
        cache = self.make_cache() if cache is None else cache
        self.check_cache(cache)
        offset = cache[0].offset  # read before any layer writes
        read = Read.decode() if input_ids.shape[1] == 1 else Read.window()
        h = self.run_layers(self.embed(input_ids), None, cache, offset, read, range(len(self.layers)))
        h = self.norm(h[:, -1:] if last_only else h)
        return self.logits(h)

    def run_layers(self, h, per_layer_inputs, cache: list, offset, read: Read, layers: range, need: str = "all"):
        """The layer loop: layers ``layers`` on ``h``, each on its cache (``cache`` holds theirs, in
        order), all reading at ``offset``. A pipeline stage (``models.parallel.pipeline``) runs its range.

        The signature is Gemma 4's (``Gemma4TextModel.run_layers``); Gemma 3 has no per-layer inputs
        (``per_layer_inputs`` is None) and no KV-shared layers, so every ``need`` runs every layer."""
        if per_layer_inputs is not None:
            raise ValueError("Gemma 3 has no per-layer inputs")
        for i, layer_cache in zip(layers, cache):
            h = self.layers[i](h, layer_cache, offset, read)
        return h

    def encode(self, input_ids: mx.array, lengths: list[int]) -> mx.array:
        """Final-normed hidden states ``[1, N, H]`` of texts packed end to end in ``input_ids [1, N]``
        (``lengths`` sum to N), each attending only to itself (``cache.PackedCache``): EmbeddingGemma's
        encoder, transformers' ``Gemma3TextModel`` with ``use_bidirectional_attention``.

        Every layer makes the ``bidirectional`` read. transformers ORs a symmetric overlay
        ``|q - k| < sliding_window`` onto the sliding mask, with the config's window already halved
        (``W // 2 + 1``), so a sliding layer sees ``|q - k| <= sliding_window - 1`` (the read's
        window); full layers see the whole text.
        """
        if not self.config.use_bidirectional_attention:
            raise ValueError("Gemma3TextModel.encode: this config is causal (use_bidirectional_attention is not true)")
        if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] != sum(lengths):
            raise ValueError(f"Gemma3TextModel.encode: input_ids {tuple(input_ids.shape)} is not one row of sum(lengths) = {sum(lengths)} ids")
        W = self.config.sliding_window
        make = {SLIDING: partial(RotatingKVCache, W - 1), FULL: KVCache}
        read = Read.bidirectional()
        h = self.embed(input_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            h = layer(h, PackedCache(lengths, make[layer_type]), 0, read)
        return self.norm(h)

    def embed(self, input_ids: mx.array) -> mx.array:
        """``E[ids] * sqrt(H)``, the scale cast to the weights' dtype first (bf16 rounds it, as the reference does)."""
        scale = mx.array(math.sqrt(self.config.hidden_size), dtype=float_dtype(self.embed_tokens))
        return self.embed_tokens(input_ids) * scale

    def logits(self, h: mx.array) -> mx.array:
        out = self.head_product(h)
        cap = self.config.final_logit_softcapping
        if cap:
            out = softcap(out, cap)
        return out
