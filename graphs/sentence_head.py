"""A sentence-transformers head as an MLX graph: pooling, dense layers, normalization.

It turns an encoder's hidden states of packed texts (``cache.PackedCache``) into one embedding per
text, as sentence-transformers' ``Pooling``, ``Dense`` and ``Normalize`` modules do. What it holds
(pooling mode, dense shapes and activations, whether it normalizes) comes from the checkpoint
folder's ``modules.json`` and module configs, read by ``models.sentence_modules``.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

# sentence-transformers' pooling modes this head computes (its ``Pooling.pooling_mode`` names).
POOLING_MODES = ("mean", "mean_sqrt_len_tokens", "max", "cls", "lasttoken")
# Dense activations, by the torch class name sentence-transformers writes into ``config.json``.
ACTIVATIONS = {"torch.nn.modules.linear.Identity": None, "torch.nn.modules.activation.Tanh": mx.tanh}


@dataclass(frozen=True)
class DenseSpec:
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of ACTIVATIONS


@dataclass(frozen=True)
class SentenceHeadConfig:
    pooling: str  # one of POOLING_MODES
    dense: tuple[DenseSpec, ...]
    normalize: bool

    @property
    def dimension(self) -> int | None:
        """The embedding size the dense layers give (None without dense layers: the encoder's hidden size)."""
        return self.dense[-1].out_features if self.dense else None


class SentenceHead(nn.Module):
    """``hidden [1, N, H]`` of texts of ``lengths`` (packed in order) -> embeddings ``[len(lengths), D]``."""

    def __init__(self, config: SentenceHeadConfig):
        super().__init__()
        self.config = config
        self.dense = [nn.Linear(d.in_features, d.out_features, bias=d.bias) for d in config.dense]

    def __call__(self, hidden: mx.array, lengths: list[int]) -> mx.array:
        x = mx.stack([self._pool(part) for part in _split(hidden[0], lengths)])
        for layer, spec in zip(self.dense, self.config.dense):
            x = layer(x)
            activation = ACTIVATIONS[spec.activation]
            if activation is not None:
                x = activation(x)
        if self.config.normalize:
            x = normalized(x)
        return x

    def _pool(self, h: mx.array) -> mx.array:
        """One text's ``[L, H]`` hidden states -> ``[H]``, accumulated in float32 as the reference does for half types."""
        mode = self.config.pooling
        if mode == "cls":
            return h[0]
        if mode == "lasttoken":
            return h[-1]
        if mode == "max":
            return h.max(axis=0)
        total = h.astype(mx.float32).sum(axis=0)
        count = float(h.shape[0])
        return (total / (count if mode == "mean" else count**0.5)).astype(h.dtype)


def normalized(x: mx.array) -> mx.array:
    """Rows scaled to unit L2 norm, as ``torch.nn.functional.normalize`` (norm clamped at 1e-12)."""
    norm = mx.sqrt((x.astype(mx.float32) ** 2).sum(axis=-1, keepdims=True))
    return (x / mx.maximum(norm, 1e-12)).astype(x.dtype)


def _split(h: mx.array, lengths: list[int]) -> list[mx.array]:
    parts, start = [], 0
    for n in lengths:
        parts.append(h[start : start + n])
        start += n
    return parts
