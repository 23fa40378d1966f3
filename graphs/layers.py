"""Building blocks shared by the Gemma-family graphs: RMSNorm, RoPE kinds, GeGLU MLP, MoE router and experts.

Parameter names follow transformers' module names (and mlx-lm's ``switch_glu`` for experts), so
a checkpoint maps onto them with renames only where the storage layout differs.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from cache import cpu_math

from .speedups import cpu_streams, few_rows


def scaled(x: mx.array, factor: float) -> mx.array:
    """``x * factor`` with the factor at float32 precision and one rounding, as torch does.

    MLX casts a Python scalar to the array's dtype first, so in bf16 ``x * hidden_size**-0.5``
    would use a rounded factor; the reference (transformers) keeps these factors exact.
    """
    return (x.astype(mx.float32) * factor).astype(x.dtype)


class RMSNorm(nn.Module):
    """``x * (mean(x²) + eps)^-0.5``, times ``weight`` when it has one.

    Gemma 4 multiplies by ``weight`` itself (initialised to ones), not by ``1 + weight`` as Gemma 2/3
    did; its value norm, router norm and embedder norms have no weight at all. Like the reference,
    the weight is applied in float32 and the result rounded once: MLX's fused kernel on bf16 input
    rounds before the weight multiply, which moves a quarter of the outputs by one bf16 ulp.
    """

    def __init__(self, dims: int, eps: float, with_weight: bool = True):
        super().__init__()
        self.eps = eps
        if with_weight:
            self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.get("weight")
        if weight is not None:
            weight = weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), weight, self.eps).astype(x.dtype)


class RoPE(nn.Module):
    """Rotary embedding over the full head dim, pairing dim i with i + D/2 (``rotate_half``).

    ``default``: frequencies ``theta^(-2j/D)`` for every pair. ``proportional`` (Gemma 4 full layers):
    only the first ``int(partial_rotary_factor * D // 2)`` pairs rotate, with frequencies still
    computed over the full D (optionally divided by ``factor``); the remaining pairs get an infinite
    period, i.e. they are left unrotated. That is not "standard partial RoPE on the first dims".

    ``mx.fast.rope`` is a fused kernel on a GPU; on the CPU it expands into scalar cos/sin loops
    over every (position, frequency) in each call. So on the CPU the rotation uses cos/sin tables of
    the reference's frequencies (float64, rounded once), made once per (offset, length) and shared
    by every layer of the same RoPE kind (the graphs make one object per kind). Decode steps use the
    same tables, so cached and uncached forwards rotate identically.
    """

    def __init__(self, head_dim: int, params: Mapping[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        rope_type = params["rope_type"]
        theta = float(params["rope_theta"])
        pairs = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        if rope_type == "default":
            self._base, self._periods = theta, None
            inv_freq = theta**-pairs
        elif rope_type == "proportional":
            rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
            factor = float(params.get("factor", 1.0))
            periods = factor * theta ** (mx.arange(0, 2 * rotated, 2, dtype=mx.float32) / head_dim)
            still = mx.full((head_dim // 2 - rotated,), math.inf, dtype=mx.float32)
            self._base, self._periods = None, mx.concatenate([periods, still])
            inv_freq = np.where(np.arange(head_dim // 2) < rotated, 1.0 / (factor * theta**pairs), 0.0)
        else:
            raise ValueError(f"RoPE: unsupported rope_type {rope_type!r}")
        self._inv_freq = mx.array(inv_freq.astype(np.float32))
        self._table_key, self._cos, self._sin = None, None, None

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        """``x [B, H, L, D]`` at absolute positions ``offset .. offset + L - 1``."""
        if cpu_math.active():
            return cpu_math.rotate(x, *self.tables(offset, x.shape[-2]))
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self._base, scale=1.0, offset=offset, freqs=self._periods
        )

    @property
    def base(self) -> float | None:
        """``mx.fast.rope``'s ``base`` (None when ``periods`` are given)."""
        return self._base

    @property
    def periods(self) -> mx.array | None:
        """``mx.fast.rope``'s ``freqs`` (the period of each pair) for the proportional kind."""
        return self._periods

    def tables(self, offset: int, length: int) -> tuple[mx.array, mx.array]:
        """float32 ``cos`` and ``sin`` ``[length, D/2]`` of positions ``offset ..``, kept for the next
        call with the same positions (the other layers of this kind in the same forward)."""
        if self._table_key != (offset, length):
            angles = mx.arange(offset, offset + length, dtype=mx.float32)[:, None] * self._inv_freq[None]
            self._table_key, self._cos, self._sin = (offset, length), mx.cos(angles), mx.sin(angles)
        return self._cos, self._sin


def float_dtype(module: nn.Module) -> mx.Dtype:
    """The float dtype an embedding or linear computes in: a quantized one keeps it in its scales
    (its weight is packed uint32)."""
    return module["scales"].dtype if "scales" in module else module["weight"].dtype


def gelu_gated(up: mx.array, gate: mx.array) -> mx.array:
    """GeGLU's gating with the tanh GELU (``gelu_pytorch_tanh``), in SwitchGLU's (up, gate) order:
    MLX's ``nn.gelu_approx``, on the CPU a vectorised equivalent (``cache.cpu_math``)."""
    return cpu_math.gelu_gated(up, gate)


def softcap(x: mx.array, cap: float) -> mx.array:
    """Gemma's logit softcapping ``cap * tanh(x / cap)`` (vectorised tanh on the CPU, ``cache.cpu_math``)."""
    return cap * cpu_math.tanh(x / cap)


class GeGLUMLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))``, no biases.

    ``use_streams(2)`` (chosen by ``models.precision``) runs the up and gate products of a few rows
    (decode) on two CPU streams, one core streaming each weight; wider inputs are GEMMs the BLAS
    threads itself. Same parameters, same ops, same numbers.
    """

    two_streams: bool = False

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def use_streams(self, n: int) -> None:
        if n not in (1, 2):
            raise ValueError(f"GeGLUMLP.use_streams: 1 or 2 streams, got {n}")
        self.two_streams = n == 2

    def __call__(self, x: mx.array) -> mx.array:
        if self.two_streams and few_rows(x):
            with mx.stream(cpu_streams(2)[1]):
                up = self.up_proj(x)
            return self.down_proj(gelu_gated(up, self.gate_proj(x)))
        return self.down_proj(gelu_gated(self.up_proj(x), self.gate_proj(x)))


class Router(nn.Module):
    """Gemma 4's expert router: top-k of a float32 softmax, renormalised, times a per-expert scale.

    Its input is the raw residual stream; it is normalised here without a learned weight and scaled
    by ``scale * hidden_size^-0.5`` before the projection.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k = top_k
        self.norm = RMSNorm(hidden_size, eps, with_weight=False)
        self.proj = nn.Linear(hidden_size, num_experts, bias=False)
        self.scale = mx.ones((hidden_size,))
        self.per_expert_scale = mx.ones((num_experts,))
        self.input_scale = hidden_size**-0.5

    def __call__(self, residual: mx.array) -> tuple[mx.array, mx.array]:
        """Returns ``(weights [..., k] float32, expert indices [..., k])``."""
        scores = self.proj(scaled(self.norm(residual) * self.scale, self.input_scale))
        probs = mx.softmax(scores.astype(mx.float32), axis=-1)
        indices = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        weights = mx.take_along_axis(probs, indices, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True)
        return weights * self.per_expert_scale[indices], indices


class Experts(nn.Module):
    """The routed GeGLU experts, computed with mlx-lm's ``SwitchGLU`` gather kernels (no per-expert loop)."""

    def __init__(self, hidden_size: int, moe_intermediate_size: int, num_experts: int):
        super().__init__()
        self.switch_glu = SwitchGLU(hidden_size, moe_intermediate_size, num_experts, activation=gelu_gated, bias=False)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        """``x [..., H]``; each token's chosen experts' outputs, summed with the routing weights."""
        per_expert = self.switch_glu(x, indices)  # [..., k, H]
        return (per_expert * weights[..., None]).sum(axis=-2).astype(x.dtype)
