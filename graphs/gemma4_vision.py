"""The Gemma 4 vision tower and multimodal embedder in MLX (also DiffusionGemma's vision encoder).

Reference: transformers 5.24 ``Gemma4VisionModel`` and ``Gemma4MultimodalEmbedder``
(``modeling_gemma4.py``). Module and parameter names mirror
transformers' below ``vision_tower.`` / ``embed_vision.``, so a checkpoint maps onto them by
stripping a prefix (``weights.gemma4_vision_keys``).

Images run **unpadded**, one patch grid per call (or a batch of equal grids). transformers pads
every image to the budget's patch count and masks the padding out of attention and pooling; the
features of the real patches are the same either way, so we skip the padding and the mask, and the
attention is plain bidirectional ``mx.fast.scaled_dot_product_attention`` over one image. No KV
cache is involved: the tower is an encoder, run once per image.

The tower checks what the peers leave unchecked: the position ids must be the row-major patch grid
the processor emits, the grid must divide by the pooling kernel (mlx-vlm pools a ragged grid
silently), ``pooling_kernel_size=1`` returns one feature per patch (mlx-vlm and transformers return
none), and positions beyond the learned table raise instead of reading out of bounds.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cache.attention import attend
from graphs.layers import RMSNorm, gelu_gated
from graphs.gemma4_vision_config import Gemma4VisionConfig


class ClippableLinear(nn.Module):
    """``Linear(bias=False)`` under ``.linear``, optionally clamping its input and output.

    With ``use_clipped_linears`` the checkpoint carries scalar ``input_min/input_max/output_min/
    output_max`` per projection (initialised to ±inf, i.e. no clamp).
    """

    def __init__(self, in_dims: int, out_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min = mx.array(-math.inf)
            self.input_max = mx.array(math.inf)
            self.output_min = mx.array(-math.inf)
            self.output_max = mx.array(math.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.clipped:
            return self.linear(x)
        x = mx.clip(x, self.input_min.astype(x.dtype), self.input_max.astype(x.dtype))
        y = self.linear(x)
        return mx.clip(y, self.output_min.astype(y.dtype), self.output_max.astype(y.dtype))


def axial_rope(position_ids: mx.array, head_dim: int, theta: float) -> tuple[mx.array, mx.array]:
    """cos/sin ``[B, L, 1, D]`` for 2-D RoPE: head dims ``[0, D/2)`` turn with x, ``[D/2, D)`` with y.

    Each half is an ordinary ``rotate_half`` RoPE of width D/2 (pairs i, i + D/4) with frequencies
    ``theta^(-2j / (D/2))``. Positions are per patch, not contiguous, hence no ``mx.fast.rope``.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (mx.arange(0, half, 2, dtype=mx.float32) / half))  # [D/4]
    angles = position_ids.astype(mx.float32)[..., None] * inv_freq  # [B, L, 2, D/4]
    angles = mx.concatenate([angles, angles], axis=-1)  # [B, L, 2, D/2]: both members of a pair
    angles = angles.reshape(*position_ids.shape[:-1], 1, head_dim)
    return mx.cos(angles), mx.sin(angles)


def apply_axial_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """``x [B, L, H, D]``: ``x * cos + rotate_half_within_each_half(x) * sin``."""
    quarters = x.reshape(*x.shape[:-1], 2, 2, x.shape[-1] // 4)  # [..., axis, first|second, D/4]
    rotated = mx.concatenate([-quarters[..., 1:, :], quarters[..., :1, :]], axis=-2).reshape(x.shape)
    return x * cos.astype(x.dtype) + rotated * sin.astype(x.dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention over one image: q/k norms with weight, weightless v norm, 2-D RoPE,
    scale 1.0 (the q/k norms replace 1/sqrt(D))."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        hidden, heads, kv_heads, head_dim = (
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )  # fmt: skip
        clip = config.use_clipped_linears
        self.head_dim = head_dim
        self.q_proj = ClippableLinear(hidden, heads * head_dim, clip)
        self.k_proj = ClippableLinear(hidden, kv_heads * head_dim, clip)
        self.v_proj = ClippableLinear(hidden, kv_heads * head_dim, clip)
        self.o_proj = ClippableLinear(heads * head_dim, hidden, clip)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.v_norm = RMSNorm(head_dim, config.rms_norm_eps, with_weight=False)

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        batch, length, _ = x.shape
        shape = (batch, length, -1, self.head_dim)
        q = apply_axial_rope(self.q_norm(self.q_proj(x).reshape(shape)), *rope)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).reshape(shape)), *rope)
        v = self.v_norm(self.v_proj(x).reshape(shape))
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = attend(q, k, v, 1.0, None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class VisionMLP(nn.Module):
    """GeGLU on clippable projections: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        hidden, inner, clip = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj = ClippableLinear(hidden, inner, clip)
        self.up_proj = ClippableLinear(hidden, inner, clip)
        self.down_proj = ClippableLinear(inner, hidden, clip)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(gelu_gated(self.up_proj(x), self.gate_proj(x)))


class VisionEncoderLayer(nn.Module):
    """Sandwich norms around attention and MLP, as in the text decoder (no MoE, PLE or layer scalar)."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def __call__(self, x: mx.array, rope: tuple[mx.array, mx.array]) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class VisionEncoder(nn.Module):
    """Holds the layers under ``encoder.layers`` (transformers' nesting)."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.layers = [VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)]


class VisionPatchEmbedder(nn.Module):
    """``input_proj(2 * (pixels - 0.5))`` plus learned x and y position embeddings."""

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = mx.zeros((2, config.position_embedding_size, config.hidden_size))

    def __call__(self, patches: mx.array, position_ids: mx.array) -> mx.array:
        table = self.position_embedding_table
        hidden = self.input_proj((2 * (patches - 0.5)).astype(table.dtype))
        return hidden + (table[0][position_ids[..., 0]] + table[1][position_ids[..., 1]])


class Gemma4VisionTower(nn.Module):
    """Patches of one image (or a batch of equal grids) to soft-token features.

    ``__call__(patches, position_ids)``: ``patches [L, 3*p*p]`` (or ``[B, L, 3*p*p]``) in ``[0, 1]``
    and ``position_ids [L, 2]`` (or ``[B, L, 2]``) as ``models.processing.image_processor`` makes them. Returns
    ``[L / k², hidden]`` (or ``[B, L / k², hidden]``): the mean of each ``k x k`` patch cell in
    row-major cell order, times ``sqrt(hidden)``, then ``(h - std_bias) * std_scale`` when the config
    standardizes. Pooling and standardization run in float32, the result has the weights' dtype.
    """

    def __init__(self, config: Gemma4VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = VisionPatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config.standardize:
            self.std_bias = mx.zeros((config.hidden_size,))
            self.std_scale = mx.ones((config.hidden_size,))

    def __call__(self, patches, position_ids) -> mx.array:
        patches, position_ids = mx.array(patches), np.asarray(position_ids)
        rows, cols = self._check_inputs(tuple(patches.shape), position_ids)
        single = patches.ndim == 2
        if single:
            patches = patches[None]
        positions = mx.broadcast_to(mx.array(position_ids.astype(np.int32)), (*patches.shape[:2], 2))

        x = self.patch_embedder(patches, positions)
        rope = axial_rope(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.encoder.layers:
            x = layer(x, rope)

        # transformers averages in float32, rounds the means to the working dtype, then scales in float32.
        pooled = self._pool(x.astype(mx.float32), rows, cols).astype(x.dtype)
        features = pooled.astype(mx.float32) * math.sqrt(self.config.hidden_size)
        if self.config.standardize:
            features = (features - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        features = features.astype(x.dtype)
        return features[0] if single else features

    def _pool(self, x: mx.array, rows: int, cols: int) -> mx.array:
        """Mean over each k x k patch cell; cells in row-major order over the pooled grid."""
        k = self.config.pooling_kernel_size
        batch, _, hidden = x.shape
        cells = x.reshape(batch, rows // k, k, cols // k, k, hidden).mean(axis=(2, 4))
        return cells.reshape(batch, -1, hidden)

    def _check_inputs(self, patch_shape: tuple[int, ...], position_ids: np.ndarray) -> tuple[int, int]:
        """The (rows, cols) patch grid, after checking everything the graph would otherwise get wrong silently."""
        config = self.config
        width = 3 * config.patch_size**2
        if len(patch_shape) not in (2, 3) or patch_shape[-1] != width or patch_shape[-2] == 0:
            raise ValueError(f"vision tower: patches must be [L, {width}] or [B, L, {width}] with L > 0, got {list(patch_shape)}")
        length = patch_shape[-2]
        allowed = [[length, 2]] + ([[*patch_shape[:-1], 2]] if len(patch_shape) == 3 else [])
        if list(position_ids.shape) not in allowed:
            raise ValueError(
                f"vision tower: position_ids must be {' or '.join(map(str, allowed))} for patches "
                f"{list(patch_shape)}, got {list(position_ids.shape)}"
            )
        cols = int(position_ids[..., 0].max()) + 1
        rows = length // cols
        grid = np.stack(np.divmod(np.arange(length), cols)[::-1], axis=-1)
        if rows * cols != length or not (position_ids == grid).all():
            raise ValueError(
                "vision tower: position_ids must be the row-major (x = column, y = row) patch grid that "
                f"models.processing.image_processor emits, without padding; got {length} patches with max x {cols - 1}"
            )
        k = config.pooling_kernel_size
        if rows % k or cols % k:
            raise ValueError(
                f"vision tower: the patch grid {rows}x{cols} does not divide into {k}x{k} pooling cells "
                "(resize images with models.processing.image_processor, which makes both sides multiples of "
                f"{k * config.patch_size} px)"
            )
        if max(rows, cols) > config.position_embedding_size:
            raise ValueError(
                f"vision tower: the patch grid {rows}x{cols} exceeds the position embedding table "
                f"({config.position_embedding_size} positions per axis); use a smaller max_soft_tokens"
            )
        return rows, cols


class Gemma4MultimodalEmbedder(nn.Module):
    """Soft tokens into the text model's space: weightless RMSNorm, then ``Linear(vision -> text)``.

    No ``sqrt(hidden)`` scaling here (text embeddings get it, image features do not).
    """

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(vision_hidden, eps, with_weight=False)
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False)

    def __call__(self, features: mx.array) -> mx.array:
        return self.embedding_projection(self.embedding_pre_projection_norm(features))


def encode_images(
    tower: Gemma4VisionTower,
    embedder: Gemma4MultimodalEmbedder,
    images: Sequence[tuple[np.ndarray, np.ndarray]],
    max_batch: int = 4,
) -> list[mx.array]:
    """Text-space features ``[n_i, text_hidden]`` for each ``(patches, position_ids)``, in input order.

    Images with the same grid run together, at most ``max_batch`` at a time (attention memory grows
    with batch x patches²); images of different sizes never share a padded batch.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (patches, position_ids) in enumerate(images):
        key = (*np.shape(patches), int(np.asarray(position_ids)[..., 0].max()))
        groups.setdefault(key, []).append(index)
    results: list[mx.array | None] = [None] * len(images)
    for indices in groups.values():
        for start in range(0, len(indices), max_batch):
            chunk = indices[start : start + max_batch]
            patches = mx.stack([mx.array(images[i][0]) for i in chunk])
            position_ids = np.stack([np.asarray(images[i][1]) for i in chunk])
            features = embedder(tower(patches, position_ids))
            for row, index in enumerate(chunk):
                results[index] = features[row]
    return results


def image_blocks(is_image: np.ndarray) -> np.ndarray:
    """``[B, L]`` block ids: the index of each maximal run of image tokens in its row, -1 for text
    (transformers' ``get_block_sequence_ids_for_mask``; boi/eoi are text, so one image is one run)."""
    previous = np.concatenate([np.zeros_like(is_image[:, :1]), is_image[:, :-1]], axis=1)
    starts = is_image & ~previous
    return np.where(is_image, np.cumsum(starts, axis=1) - 1, -1).astype(np.int32)


def place_image_features(embedded: mx.array, is_image: np.ndarray, features: mx.array, owner: str) -> mx.array:
    """``embedded [B, L, H]`` with the k-th image position (row-major) replaced by row k of
    ``features [n, H]`` (the reference's ``masked_scatter``); the counts must match."""
    count = int(is_image.sum())
    if count != features.shape[0]:
        raise ValueError(
            f"{owner}: image features and image tokens do not match: the prompt has {count} image "
            f"tokens, the images give {features.shape[0]} soft tokens"
        )
    B, L, H = embedded.shape
    mask = mx.array(is_image)
    rows = mx.maximum(mx.cumsum(mask.reshape(-1).astype(mx.int32)) - 1, 0)
    scattered = features.astype(embedded.dtype)[rows].reshape(B, L, H)
    return mx.where(mask[..., None], scattered, embedded)
