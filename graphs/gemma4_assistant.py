"""The Gemma 4 assistant (transformers 5.24 ``Gemma4AssistantForCausalLM``) as an MLX graph: a drafter
for multi-token prediction that reads its target's caches.

An assistant has no keys or values of its own. Each draft step takes the embedding of the last
token (the *target's* scaled embedding) concatenated with a hidden state (the target's final normed
hidden state at the position before that token, then the assistant's own projected state), projects
it to its width, and runs Gemma 4 decoder layers whose attention is one ``draft`` read on the
target's cache of the target's last owning layer of the same type (``cache`` does the masking:
every stored position on full layers, the newest ``window + 1`` on sliding ones). Every query sits
at the same position, the next one of the target, as in transformers' candidate generator. The
logits come from the tied head, or with ``use_ordered_embeddings`` from the centroid-masked head:
only the tokens of the top-k centroids get their dot product, the rest the batch's smallest
selected logit minus one.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from cache import Read
from graphs.gemma4_assistant_config import Gemma4AssistantConfig

from .gemma4_text import DecoderLayer
from .layers import RMSNorm, RoPE
from .speedups import VocabularyHead


class MaskedEmbedding(nn.Module):
    """The centroid-masked head (transformers' ``Gemma4AssistantMaskedEmbedder``)."""

    def __init__(self, config: Gemma4AssistantConfig):
        super().__init__()
        H, V, C = config.text.hidden_size, config.vocab_size, config.num_centroids
        self.top_k, self.num_centroids, self.per_centroid = config.centroid_intermediate_top_k, C, V // C
        self.centroids = nn.Linear(H, C, bias=False)
        self.token_ordering = mx.zeros((V,), dtype=mx.int32)

    def __call__(self, h: mx.array, head_rows) -> mx.array:
        """Logits ``[B, L, V]`` of ``h [B, L, H]``; ``head_rows(ids)`` gives the head's rows of ``ids``."""
        B, L, _ = h.shape
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]  # the set; order is irrelevant
        clusters = self.token_ordering.astype(mx.int32).reshape(self.num_centroids, self.per_centroid)
        ids = clusters[top].reshape(B, L, -1)  # [B, L, K * V/C] canonical token ids
        rows = head_rows(ids)  # [B, L, K * V/C, H]
        selected = (h[..., None, :] @ rows.swapaxes(-1, -2)).squeeze(-2)
        floor = selected.min() - 1.0
        out = mx.full((B, L, self.per_centroid * self.num_centroids), floor, dtype=selected.dtype)
        return mx.put_along_axis(out, ids, selected, axis=-1)


class Gemma4AssistantModel(VocabularyHead, nn.Module):
    """``step(token_embedding, hidden, target_cache, position) -> (logits, projected hidden)``.

    Parameter names are transformers' with the decoder's ``model.`` prefix dropped (``embed_tokens``,
    ``layers.*``, ``norm``) and ``pre_projection``, ``post_projection``, ``masked_embedding.*``,
    ``lm_head`` (untied only) kept. ``donors`` (set by ``pair``) maps each layer type to the index of
    the target cache that layer reads.
    """

    def __init__(self, config: Gemma4AssistantConfig):
        super().__init__()
        self.config = config
        text = config.text
        H, Hb = text.hidden_size, config.backbone_hidden_size
        ropes = {t: RoPE(text.head_dim_of(t), text.rope_parameters[t]) for t in sorted(set(text.layer_types))}
        self.embed_tokens = nn.Embedding(text.vocab_size, H)
        self.layers = [DecoderLayer(text, g, ropes[g.layer_type]) for g in config.layers]
        self.norm = RMSNorm(H, text.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * Hb, H, bias=False)
        self.post_projection = nn.Linear(H, Hb, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedding(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(H, text.vocab_size, bias=False)
        self.__dict__["donors"] = None  # plain attribute, not a parameter

    def pair(self, target_config) -> dict[str, int]:
        """Check the target (``DrafterMismatchError`` on a mismatch) and remember which of its caches each layer reads."""
        donors = self.config.check_target(target_config)
        self.__dict__["donors"] = donors
        return donors

    def make_cache(self) -> list:
        raise ValueError(
            "a gemma4_assistant has no cache of its own: it drafts for a Gemma 4 target by reading the target's "
            "caches (target.generate(..., draft=assistant))"
        )

    def __call__(self, *args, **kwargs):
        raise ValueError(
            "a gemma4_assistant does not generate on its own: it drafts for its Gemma 4 target "
            "(target.generate(..., draft=assistant), or examples.chat --draft-model)"
        )

    def step(self, token_embedding: mx.array, hidden: mx.array, target_cache: list, position: int):
        """One draft step for queries at ``position`` (the target's next position).

        ``token_embedding`` and ``hidden`` are ``[B, L, backbone hidden]``: the target's scaled
        embedding of the last token and the hidden state before it. Returns the logits
        ``[B, L, V]`` and the projected hidden state ``[B, L, backbone hidden]`` for the next step.
        """
        if self.donors is None:
            raise ValueError("Gemma4AssistantModel.step: pair() the assistant with its target first")
        x = self.pre_projection(mx.concatenate([token_embedding, hidden], axis=-1))
        read = Read.draft()
        for layer, geometry in zip(self.layers, self.config.layers):
            x = layer(x, None, target_cache[self.donors[geometry.layer_type]], position, read)
        h = self.norm(x)
        return self.logits(h), self.post_projection(h)

    def logits(self, h: mx.array) -> mx.array:
        if "masked_embedding" in self:
            return self.masked_embedding(h, self.head_rows)
        return self.head_product(h)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The head's weight rows of ``ids`` (dequantized when the head is quantized)."""
        if "lm_head" in self:
            head = self.lm_head
            if isinstance(head, nn.QuantizedLinear):
                return mx.dequantize(head.weight[ids], head.scales[ids], head.biases[ids], head.group_size, head.bits)
            return head.weight[ids]
        return self.embed_tokens(ids)
