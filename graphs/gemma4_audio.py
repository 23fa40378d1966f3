"""The Gemma 4 audio tower (E2B/E4B) in MLX: log-mel frames in, soft-token features out.

Reference: transformers 5.24 ``Gemma4AudioModel`` (``modeling_gemma4.py``), a Conformer after the
Universal Speech Model: two stride-2 3x3 convolutions (``subsample_conv_projection``: 10 ms mel
frames become 40 ms steps, the 128 bins become 32 x channels), then ``num_hidden_layers`` blocks of
half-step feed-forward, chunked local self-attention with a relative position bias, a causal
depthwise "light" convolution and a second half-step feed-forward, then ``output_proj``. The audio
embedder is the vision one (``Gemma4MultimodalEmbedder``) on ``output_proj_dims``.

Module and parameter names mirror transformers' below ``audio_tower.`` / ``embed_audio.``; the
convolution weights are held in MLX's layout (``weights.gemma4_audio_keys`` transposes torch's).

One clip per call and **unpadded**: transformers pads a batch to its longest clip (and the feature
extractor pads every clip to a multiple of 128 samples) and masks the padding; the valid frames'
outputs do not depend on the padding (the convolutions see zeros there either way, the attention
masks padded keys, the light convolution is causal), so each clip runs with exactly its own frames.
Attention follows the reference exactly: queries in chunks of ``attention_chunk_size``, each
seeing keys ``(q - (left - 1), q + right)`` (``left - 1`` past positions and itself, ``right``
future ones) inside a context of ``chunk + left - 1 + right`` keys, logits soft-capped, masked keys
at ``attention_invalid_logits_value`` (not -inf).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from graphs.gemma4_audio_config import FEATURE_SIZE, Gemma4AudioConfig
from graphs.gemma4_vision import ClippableLinear
from graphs.layers import RMSNorm
from zoo_cpu import fast_math


@mx.compile
def _over_one_plus(x: mx.array, e: mx.array) -> mx.array:
    return x / (1.0 + e)


def _sigmoid_times(x: mx.array, y: mx.array) -> mx.array:
    """``y * sigmoid(x)``: on the CPU with ``zoo_cpu.fast_math``'s vectorised ``exp`` (MLX's CPU
    ``sigmoid`` is a scalar loop; the SiLUs and the GLU gate were about a fifth of the 30 s tower's
    time), computed in float32 (within 1e-7 relative of float64); elsewhere MLX's ``sigmoid``."""
    if not fast_math.active():
        return y * mx.sigmoid(x)
    e = fast_math.exp_shifted(-x.astype(mx.float32), mx.zeros((1,), mx.float32))
    return _over_one_plus(y.astype(mx.float32), e).astype(y.dtype)


def _silu(x: mx.array) -> mx.array:
    """``x * sigmoid(x)`` (``nn.silu``), vectorised on the CPU."""
    return _sigmoid_times(x, x)


def _clip(x: mx.array, bound: float) -> mx.array:
    """The reference's ``gradient_clipping`` clamp (1e10: a no-op on finite activations of fp32/bf16)."""
    bound = min(bound, float(np.finfo(np.float32).max))
    return mx.clip(x, -bound, bound)


class SubSampleLayer(nn.Module):
    """Conv2d 3x3 stride 2 (no bias) over (time, bins), LayerNorm over channels (no bias), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float):
        super().__init__()
        self.conv = nn.Module()
        self.conv.weight = mx.zeros((out_channels, 3, 3, in_channels))  # MLX layout [out, kh, kw, in]
        self.norm = nn.Module()
        self.norm.weight = mx.ones((out_channels,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:  # [B, T, F, C]
        x = mx.conv2d(x.astype(self.conv.weight.dtype), self.conv.weight, stride=2, padding=1)
        return nn.relu(mx.fast.layer_norm(x, self.norm.weight, None, self.eps))


class SubSampleConvProjection(nn.Module):
    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        first, second = config.subsampling_conv_channels
        self.layer0 = SubSampleLayer(1, first, config.rms_norm_eps)
        self.layer1 = SubSampleLayer(first, second, config.rms_norm_eps)
        self.input_proj_linear = nn.Linear((first // 4) * second, config.hidden_size, bias=False)

    def __call__(self, features: mx.array) -> mx.array:  # [B, T, 128] -> [B, ceil(ceil(T/2)/2), hidden]
        x = self.layer1(self.layer0(features[..., None]))
        B, T, F, C = x.shape
        return self.input_proj_linear(x.reshape(B, T, F * C))


class AudioFeedForward(nn.Module):
    """``x + residual_weight * post_norm(clip(W2 silu(W1 pre_norm(clip(x)))))``."""

    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        hidden, clip = config.hidden_size, config.use_clipped_linears
        self.ffw_layer_1 = ClippableLinear(hidden, hidden * 4, clip)
        self.ffw_layer_2 = ClippableLinear(hidden * 4, hidden, clip)
        self.pre_layer_norm = RMSNorm(hidden, 1e-6)
        self.post_layer_norm = RMSNorm(hidden, 1e-6)
        self.clipping = config.gradient_clipping
        self.scale = config.residual_weight

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_layer_norm(_clip(x, self.clipping))
        h = self.ffw_layer_2(_silu(self.ffw_layer_1(h)))
        return x + self.post_layer_norm(_clip(h, self.clipping)) * self.scale


class AudioAttention(nn.Module):
    """Chunked local attention with a relative position bias (Transformer-XL style shift)."""

    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        hidden, heads, clip = config.hidden_size, config.num_attention_heads, config.use_clipped_linears
        self.config = config
        self.heads, self.head_dim = heads, config.head_dim
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        self.q_proj = ClippableLinear(hidden, hidden, clip)
        self.k_proj = ClippableLinear(hidden, hidden, clip)
        self.v_proj = ClippableLinear(hidden, hidden, clip)
        self.post = ClippableLinear(hidden, hidden, clip)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))

    def __call__(self, x: mx.array, positions: mx.array, layout: "ChunkLayout") -> mx.array:
        B, T, _ = x.shape
        H, D, C, ctx = self.heads, self.head_dim, layout.chunk, layout.context
        shape = (B, T, H, D)
        q = self.q_proj(x).astype(mx.float32).reshape(shape)
        k = self.k_proj(x).astype(mx.float32).reshape(shape)
        v = self.v_proj(x).astype(mx.float32).reshape(shape)
        q = q * (self.q_scale * nn.softplus(self.per_dim_scale.astype(mx.float32)))
        k = k * self.k_scale

        nb = layout.blocks
        q = mx.pad(q, [(0, 0), (0, nb * C - T), (0, 0), (0, 0)]).reshape(B, nb, C, H, D).transpose(0, 3, 1, 2, 4)
        k = layout.context_windows(k).transpose(0, 3, 1, 4, 2)  # [B, H, nb, D, ctx]
        v = layout.context_windows(v).transpose(0, 3, 1, 2, 4)  # [B, H, nb, ctx, D]

        relative = self.relative_k_proj(positions).astype(mx.float32).reshape(-1, H, D).transpose(1, 2, 0)  # [H, D, P]
        content = q @ k  # [B, H, nb, C, ctx]
        position = (q.reshape(B, H, nb * C, D) @ relative).reshape(B, H, nb, C, -1)
        logits = content + _relative_shift(position, ctx)
        cap = self.config.attention_logit_cap
        logits = mx.tanh(logits / cap) * cap
        logits = mx.where(layout.mask, logits, self.config.attention_invalid_logits_value)
        probs = mx.softmax(logits, axis=-1, precise=True)
        out = (probs @ v).transpose(0, 2, 3, 1, 4).reshape(B, nb * C, H * D)[:, :T]
        return self.post(out.astype(x.dtype))


def _relative_shift(x: mx.array, context: int) -> mx.array:
    """``[B, H, nb, C, P]`` relative-position logits to ``[B, H, nb, C, context]`` key-aligned ones
    (the reference's ``_rel_shift``: pad to ``context + 1``, flatten, drop the tail, fold)."""
    B, H, nb, C, P = x.shape
    x = mx.pad(x, [(0, 0)] * 4 + [(0, context + 1 - P)])
    return x.reshape(B, H, nb, C * (context + 1))[..., : C * context].reshape(B, H, nb, C, context)


class ChunkLayout:
    """Where each chunk of queries looks: context windows of the keys and their validity mask."""

    def __init__(self, length: int, config: Gemma4AudioConfig):
        C, left, right = config.attention_chunk_size, config.attention_context_left - 1, config.attention_context_right
        self.chunk, self.context, self.left, self.right = C, config.context_size, left, right
        self.length = length
        self.blocks = (length + C - 1) // C
        starts = np.arange(self.blocks) * C
        self._index = mx.array((starts[:, None] + np.arange(self.context)[None]).astype(np.int32))  # into the padded keys
        query = starts[:, None, None] + np.arange(C)[None, :, None]  # [nb, C, 1]
        key = starts[:, None, None] - left + np.arange(self.context)[None, None, :]  # [nb, 1, ctx]
        distance = query - key
        visible = ((distance >= 0) & (distance < left)) | ((distance < 0) & (-distance < right))
        self.mask = mx.array(visible & (key >= 0) & (key < length))

    def context_windows(self, x: mx.array) -> mx.array:
        """``[B, T, H, D]`` to ``[B, nb, ctx, H, D]``: for block b the keys ``b*C - left + j``."""
        padded = mx.pad(x, [(0, 0), (self.left, self.right + self.chunk - 1), (0, 0), (0, 0)])
        return padded[:, self._index]


class LightConv1d(nn.Module):
    """``x + W_end silu(norm(clip(causal_depthwise_conv(glu(W_start pre_norm(x))))))``."""

    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        hidden, clip, eps = config.hidden_size, config.use_clipped_linears, config.rms_norm_eps
        self.linear_start = ClippableLinear(hidden, hidden * 2, clip)
        self.linear_end = ClippableLinear(hidden, hidden, clip)
        self.depthwise_conv1d = nn.Module()
        self.depthwise_conv1d.weight = mx.zeros((hidden, config.conv_kernel_size, 1))  # MLX layout [C, K, 1]
        self.pre_layer_norm = RMSNorm(hidden, eps)
        self.conv_norm = RMSNorm(hidden, eps)
        self.clipping = config.gradient_clipping

    def __call__(self, x: mx.array) -> mx.array:
        h = self.linear_start(self.pre_layer_norm(x))
        a, b = mx.split(h, 2, axis=-1)
        h = _sigmoid_times(b, a)
        weight = self.depthwise_conv1d.weight
        K = weight.shape[1]
        padded = mx.pad(h, [(0, 0), (K - 1, 0), (0, 0)])
        T = h.shape[1]
        # Causal depthwise convolution as K shifted products (the kernel is 5 wide).
        h = sum(padded[:, j : j + T] * weight[:, j, 0].astype(h.dtype) for j in range(K))
        h = _silu(self.conv_norm(_clip(h, self.clipping)))
        return x + self.linear_end(h)


class AudioLayer(nn.Module):
    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        hidden = config.hidden_size
        self.feed_forward1 = AudioFeedForward(config)
        self.feed_forward2 = AudioFeedForward(config)
        self.self_attn = AudioAttention(config)
        self.lconv1d = LightConv1d(config)
        self.norm_pre_attn = RMSNorm(hidden, 1e-6)
        self.norm_post_attn = RMSNorm(hidden, 1e-6)
        self.norm_out = RMSNorm(hidden, 1e-6)
        self.clipping = config.gradient_clipping

    def __call__(self, x: mx.array, positions: mx.array, layout: ChunkLayout) -> mx.array:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clip(x, self.clipping)), positions, layout)
        x = x + self.norm_post_attn(_clip(h, self.clipping))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clip(x, self.clipping))


def relative_positions(config: Gemma4AudioConfig) -> np.ndarray:
    """``[context // 2 + 1, hidden]`` sinusoidal embeddings of distances ``context // 2 ... 0``
    (``[sin..., cos...]``, the reference's ``Gemma4AudioRelPositionalEncoding``)."""
    half = config.hidden_size // 2
    increment = math.log(10000.0) / max(half - 1, 1)
    inv = np.exp(np.arange(half, dtype=np.float32) * np.float32(-increment)).astype(np.float32)
    distances = np.arange(config.context_size // 2, -1, -1, dtype=np.float32)[:, None]
    scaled = distances * inv[None]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=-1).astype(np.float32)


class Gemma4AudioTower(nn.Module):
    """Log-mel frames of one clip ``[T, 128]`` (or ``[1, T, 128]``) to ``[ceil(ceil(T/2)/2), output_proj_dims]``."""

    def __init__(self, config: Gemma4AudioConfig):
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubSampleConvProjection(config)
        self.layers = [AudioLayer(config) for _ in range(config.num_hidden_layers)]
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)
        self._positions = mx.array(relative_positions(config))

    def __call__(self, features) -> mx.array:
        features = mx.array(features)
        single = features.ndim == 2
        if single:
            features = features[None]
        if features.ndim != 3 or features.shape[-1] != FEATURE_SIZE or features.shape[1] < 1:
            raise ValueError(f"audio tower: features must be [T, {FEATURE_SIZE}] or [1, T, {FEATURE_SIZE}] with T >= 1, got {list(features.shape)}")
        x = self.subsample_conv_projection(features)
        layout = ChunkLayout(x.shape[1], self.config)
        positions = self._positions.astype(x.dtype)
        for layer in self.layers:
            x = layer(x, positions, layout)
        out = self.output_proj(x)
        return out[0] if single else out


def audio_soft_tokens(frames: int) -> int:
    """Soft tokens the tower makes of ``frames`` mel frames: two stride-2 convolutions (kernel 3, pad 1)."""
    for _ in range(2):
        frames = (frames + 2 - 3) // 2 + 1
    return max(frames, 0)
