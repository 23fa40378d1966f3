"""The Gemma 4 text decoder (transformers 5.24 ``Gemma4ForCausalLM``) as an MLX graph.

Every attention is one read on the layer's cache (``cache/``): the graph computes normed, rotated
queries, keys and values and never builds a mask. Layers differ in geometry (sliding layers and
full layers have their own head_dim and kv heads), and the last ``num_kv_shared_layers`` layers
compute no keys or values: they read, through a ``shared_view``, what the last earlier layer of the
same type attended in this same forward.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from cache import KVCache, Read, RotatingKVCache, advance
from graphs.gemma4_text_config import SLIDING, Gemma4TextConfig, LayerGeometry

from .layers import CheckedCaches, Experts, GeGLUMLP, RMSNorm, RoPE, Router, SelfAttention, gelu_gated, scaled, softcap
from .speedups import VocabularyHead

# q_norm and k_norm take the place of 1/sqrt(head_dim).
ATTENTION_SCALE = 1.0


class DecoderLayer(nn.Module):
    """Sandwich-normed attention and feed-forward, the MoE beside the dense MLP, the per-layer input, ``layer_scalar``."""

    def __init__(self, config: Gemma4TextConfig, geometry: LayerGeometry, rope: RoPE):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = SelfAttention(
            H, config.num_attention_heads, geometry.num_key_value_heads, geometry.head_dim, bias=config.attention_bias,
            rope=rope, scale=ATTENTION_SCALE, norm=lambda d: RMSNorm(d, eps), plus_one=False, owns_kv=not geometry.reuses_kv,
            has_v_proj=geometry.has_v_proj, v_norm=lambda d: RMSNorm(d, eps, with_weight=False),
        )  # fmt: skip
        self.mlp = GeGLUMLP(H, geometry.intermediate_size)
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.has_moe = config.enable_moe_block
        if self.has_moe:
            self.router = Router(H, config.num_experts, config.top_k_experts, eps)
            self.experts = Experts(H, config.moe_intermediate_size, config.num_experts)
            self.pre_feedforward_layernorm_2 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(H, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(H, eps)
        self.has_per_layer_input = bool(config.hidden_size_per_layer_input)
        if self.has_per_layer_input:
            P = config.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(H, P, bias=False)
            self.per_layer_projection = nn.Linear(P, H, bias=False)
            self.post_per_layer_input_norm = RMSNorm(H, eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, per_layer_input, cache, offset: int, read: Read) -> mx.array:
        attended = self.self_attn(self.input_layernorm(x), cache, offset, read)
        h = self.post_attention_layernorm(attended, residual=x)
        ff = self.mlp(self.pre_feedforward_layernorm(h))
        if self.has_moe:
            # The router and the experts read the post-attention residual, not the dense MLP's input.
            weights, indices = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(routed)
        h = self.post_feedforward_layernorm(ff, residual=h)
        if self.has_per_layer_input:
            gated = gelu_gated(per_layer_input, self.per_layer_input_gate(h))
            h = self.post_per_layer_input_norm(self.per_layer_projection(gated), residual=h)
        return h * self.scalar(read)

    def scalar(self, read: Read) -> mx.array:
        """The output scale of this layer (``layer_scalar``) for ``read``."""
        return self.layer_scalar


def _compute_dtype(module: nn.Module) -> mx.Dtype:
    """The float dtype of an embedding's weights (a quantized embedding keeps it in its scales)."""
    return module["scales"].dtype if "scales" in module else module.weight.dtype


class Gemma4TextModel(VocabularyHead, CheckedCaches, nn.Module):
    """Gemma 4 text model with its tied (or separate) LM head: ``input_ids [B, L] -> logits [B, L, V]``.

    Parameter names are transformers' ``Gemma4TextModel`` names (no ``model.`` prefix), experts as
    ``experts.switch_glu.{gate,up,down}_proj``; ``lm_head`` exists only when embeddings are untied.
    Computation runs in the weights' dtype.
    """

    def __init__(self, config: Gemma4TextConfig):
        super().__init__()
        self.config = config
        H, L, P = config.hidden_size, config.num_hidden_layers, config.hidden_size_per_layer_input
        ropes = {t: RoPE(config.head_dim_of(t), config.rope_parameters[t]) for t in sorted(set(config.layer_types))}
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.layers = [DecoderLayer(config, g, ropes[g.layer_type]) for g in config.layers]
        self.norm = RMSNorm(H, config.rms_norm_eps)
        if P:
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = nn.Linear(H, L * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(H, config.vocab_size, bias=False)

    # ------------------------------------------------------------------------------ caches
    def make_cache(self) -> list:
        """One cache per layer: ``KVCache`` on full layers, ``RotatingKVCache(window)`` on sliding layers,
        and on KV-shared layers a ``shared_view`` of the last earlier layer of the same type."""
        donors = self.config.kv_donors
        caches: list = []
        for geometry in self.config.layers:
            if geometry.reuses_kv:
                caches.append(caches[donors[geometry.layer_type]].shared_view())
            elif geometry.layer_type == SLIDING:
                caches.append(RotatingKVCache(self.config.sliding_window))
            else:
                caches.append(KVCache())
        return caches

    # ------------------------------------------------------------------------------ forward
    def __call__(
        self, input_ids: mx.array, cache: list | None = None, last_only: bool = False, with_hidden: bool = False
    ) -> mx.array:
        """Logits for every position of ``input_ids`` (only the last one with ``last_only``, which
        spares the vocabulary-wide head product over a whole prefill chunk).

        Without ``cache`` this is the no-cache forward (fresh caches for this call only). With one,
        the ids are appended: a ``window`` read for L > 1, a ``decode`` read for L == 1.
        ``with_hidden`` also returns the final normed hidden states (what a Gemma 4 assistant reads).
        """
        if self.config.use_bidirectional_attention == "all":
            offset = 0 if cache is None else cache[0].offset  # an array inside a compiled decode step
            if isinstance(offset, mx.array) or offset:
                raise ValueError("Gemma 4 use_bidirectional_attention='all' encodes a whole sequence at once; "
                                 "it has no incremental (cached) generation")
            return self.forward(input_ids, cache or self.make_cache(), Read.bidirectional(), last_only, with_hidden)
        if cache is None:
            return self.forward(input_ids, self.make_cache(), Read.window(), last_only, with_hidden)
        read = Read.decode() if input_ids.shape[1] == 1 else Read.window()
        return self.forward(input_ids, cache, read, last_only, with_hidden)

    def forward(self, input_ids: mx.array, cache: list, read: Read, last_only: bool = False, with_hidden: bool = False):
        """Run every layer with ``read`` on its cache (a list made by ``make_cache``, checked); the
        logits, or ``(logits, final normed hidden states)`` with ``with_hidden``."""
        self.check_cache(cache)
        offset = cache[0].offset  # layer 0 always owns storage; read before any layer writes
        h = self.embed(input_ids)
        per_layer_inputs = self.per_layer_inputs(input_ids, h) if "embed_tokens_per_layer" in self else None
        h = self.run_layers(h, per_layer_inputs, cache, offset, read, range(len(self.layers)), "last" if last_only else "all")
        if last_only:
            h = h[:, -1:]
        h = self.norm(h)
        return (self.logits(h), h) if with_hidden else self.logits(h)

    def run_layers(self, h, per_layer_inputs, cache: list, offset, read: Read, layers: range, need: str = "all"):
        """The layer loop: layers ``layers`` on ``h``, each on its cache (``cache`` holds theirs, in
        order), all reading at ``offset``. A pipeline stage (``models.parallel.pipeline``) runs its range.

        ``need`` says which positions the caller wants out: ``"all"``; ``"last"``: from the first
        KV-shared layer on no layer writes a cache, so only the last position goes on (the
        reference's KV-shared prefill shortcut: E2B skips 20 of its 35 layers); ``"none"``: the
        loop stops there (only the caches were wanted)."""
        for i, layer_cache in zip(layers, cache):
            if need != "all" and i == self.config.first_kv_shared_layer:
                if need == "none":
                    break
                if h.shape[1] > 1:
                    offset = advance(offset, h.shape[1] - 1)
                    h = h[:, -1:]
                    per_layer_inputs = None if per_layer_inputs is None else per_layer_inputs[:, -1:]
            per_layer_input = None if per_layer_inputs is None else per_layer_inputs[:, :, i, :]
            h = self.layers[i](h, per_layer_input, layer_cache, offset, read)
        return h

    def embed(self, input_ids: mx.array) -> mx.array:
        """``E[ids] * sqrt(H)``, the scale cast to the weights' dtype first (bf16 rounds it, as the reference does)."""
        scale = mx.array(math.sqrt(self.config.hidden_size), dtype=_compute_dtype(self.embed_tokens))
        return self.embed_tokens(input_ids) * scale

    def per_layer_inputs(self, input_ids: mx.array, embedded: mx.array) -> mx.array:
        """Per-layer embeddings ``[B, L, layers, P]``: a token-identity part plus a projection of the embedding."""
        B, L = input_ids.shape
        layers, P = self.config.num_hidden_layers, self.config.hidden_size_per_layer_input
        scale = mx.array(math.sqrt(P), dtype=_compute_dtype(self.embed_tokens_per_layer))
        token_part = (self.embed_tokens_per_layer(input_ids) * scale).reshape(B, L, layers, P)
        context = scaled(self.per_layer_model_projection(embedded), self.config.hidden_size**-0.5)
        context = self.per_layer_projection_norm(context.reshape(B, L, layers, P))
        return scaled(context + token_part, 2.0**-0.5)

    def logits(self, h: mx.array) -> mx.array:
        out = self.head_product(h)
        cap = self.config.final_logit_softcapping
        if cap:
            out = softcap(out, cap)
        return out
