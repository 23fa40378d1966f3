"""Building blocks shared by the Gemma-family graphs: RMSNorm, RoPE kinds, GeGLU MLP, MoE router and experts.

Parameter names follow transformers' module names (and mlx-lm's ``switch_glu`` for experts), so
a checkpoint maps onto them with renames only where the storage layout differs.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from cache import Read, check_caches, same_offset
from zoo_cpu import backend, decode, fast_math

from .speedups import cpu_streams, few_rows, norm_rope


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

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """The norm of ``x``, added to ``residual`` when given (one kernel node on the CPU)."""
        weight = self.get("weight")
        if weight is not None:
            weight = weight.astype(mx.float32)
        return fast_math.rms_norm(x, weight, self.eps, residual=residual)  # mx.fast.rms_norm off the CPU


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

    def __call__(self, x: mx.array, offset: int | tuple[int, ...] | mx.array) -> mx.array:
        """``x [B, H, L, D]`` at absolute positions ``offset .. offset + L - 1``; a tuple gives each
        row of a ragged batch its own offset (``cache.batch``), a scalar array is the offset of a
        decode step compiled whole (``graphs.decode_step``)."""
        if fast_math.active():
            return fast_math.rotate(x, *self.tables(offset, x.shape[-2]))
        if isinstance(offset, tuple):
            offset = mx.array(offset, dtype=mx.int32)
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

    def tables(self, offset: int | tuple[int, ...] | mx.array, length: int) -> tuple[mx.array, mx.array]:
        """float32 ``cos`` and ``sin`` ``[length, D/2]`` of positions ``offset ..`` (``[B, 1, length,
        D/2]`` for per-row offsets: the same values each row gets alone), kept for the next call with
        the same positions (the other layers of this kind in the same forward; an array offset is
        the same positions only as the same object)."""
        if not self._same_positions(offset, length):
            if isinstance(offset, mx.array):
                positions = offset.astype(mx.float32) + mx.arange(length, dtype=mx.float32)
                angles = positions[:, None] * self._inv_freq[None]
            elif isinstance(offset, tuple):
                positions = mx.array(offset, dtype=mx.float32)[:, None] + mx.arange(length, dtype=mx.float32)[None]
                angles = positions[:, None, :, None] * self._inv_freq
            else:
                angles = mx.arange(offset, offset + length, dtype=mx.float32)[:, None] * self._inv_freq[None]
            self._table_key, self._cos, self._sin = (offset, length), mx.cos(angles), mx.sin(angles)
        return self._cos, self._sin

    def _same_positions(self, offset, length: int) -> bool:
        return self._table_key is not None and self._table_key[1] == length and same_offset(self._table_key[0], offset)


def float_dtype(module: nn.Module) -> mx.Dtype:
    """The float dtype an embedding or linear computes in: a quantized one keeps it in its scales
    (its weight is packed uint32)."""
    return module["scales"].dtype if "scales" in module else module["weight"].dtype


def gelu_gated(up: mx.array, gate: mx.array) -> mx.array:
    """GeGLU's gating with the tanh GELU (``gelu_pytorch_tanh``), in SwitchGLU's (up, gate) order:
    MLX's ``nn.gelu_approx``, on the CPU a vectorised equivalent (``zoo_cpu.fast_math``)."""
    return fast_math.gelu_gated(up, gate)


def softcap(x: mx.array, cap: float) -> mx.array:
    """Gemma's logit softcapping ``cap * tanh(x / cap)`` (vectorised tanh on the CPU, ``zoo_cpu.fast_math``)."""
    return cap * fast_math.tanh(x / cap)


class FusedProducts:
    """Several layers that read the same input (``parts``: a layer's query, key and value projections,
    or an MLP's up and gate) as one product whose output is theirs side by side.

    ``of(parts)`` concatenates the parts' parameters once (plain, quantized or packed linear layers
    of one kind, rows after rows) and then stores each part's parameters as a row view of the
    concatenation: no extra memory, and the graph's parameters (names, shapes, values, saving) are
    unchanged. Calling it gives the parts' outputs, or None once any part holds another weight than
    it was made from (a later load or a split replaced it): the caller then runs the parts. Not a
    module (a plain attribute): parameter walks and ``mx.compile``'s weight checks see the parts only.
    """

    def __init__(self, module: nn.Module, parts: list[nn.Module]):
        self.module, self.parts = module, tuple(parts)
        self.weights = tuple(part["weight"] for part in parts)
        self.splits = np.cumsum([w.shape[0] for w in self.weights[:-1]]).tolist()

    @staticmethod
    def mismatch(parts: list[nn.Module]) -> str | None:
        """Why ``parts`` cannot be one product (kinds, parameters, layouts or dtypes differ), or None."""
        first = parts[0]
        keys = sorted(k for k, v in first.items() if isinstance(v, mx.array))
        for p in parts[1:]:
            if type(p) is not type(first) or sorted(k for k, v in p.items() if isinstance(v, mx.array)) != keys:
                return f"{type(p).__name__} with {sorted(p)} beside {type(first).__name__} with {keys}"
            if any(getattr(p, a, None) != getattr(first, a, None) for a in ("group_size", "bits", "mode")):
                return "different quantization"
            if any(p[k].dtype != first[k].dtype or p[k].shape[1:] != first[k].shape[1:] for k in keys):
                return "different dtypes or input sizes"
        return None

    @classmethod
    def of(cls, parts: list[nn.Module]) -> "FusedProducts":
        why = cls.mismatch(parts)
        if why:
            raise ValueError(f"FusedProducts: these layers cannot be one product: {why}")
        first = parts[0]
        keys = [k for k, v in first.items() if isinstance(v, mx.array)]
        module = copy.copy(first)
        for k in keys:
            module[k] = mx.concatenate([p[k] for p in parts], axis=0)
        mx.eval(module.parameters())
        start = 0
        for p in parts:
            rows = p["weight"].shape[0]
            for k in keys:
                p[k] = module[k][start : start + rows]
            start += rows
        mx.eval([p.parameters() for p in parts])
        return cls(module, parts)

    def joined(self, x: mx.array) -> mx.array | None:
        """The parts' outputs side by side in one array, or None (see the class)."""
        if any(part.get("weight") is not w for part, w in zip(self.parts, self.weights)):
            return None
        return self.module(x)

    def __call__(self, x: mx.array) -> list[mx.array] | None:
        y = self.joined(x)
        return None if y is None else mx.split(y, self.splits, axis=-1)


class GeGLUMLP(nn.Module):
    """``down(gelu(gate(x)) * up(x))``, no biases.

    ``use_streams(2)`` (chosen by ``models.precision``) runs the up and gate products of a few rows
    (decode) on two CPU streams, one core streaming each weight; wider inputs are GEMMs the BLAS
    threads itself. ``fuse()`` (also chosen there) makes up and gate one product
    (``FusedProducts``). Same parameters, same numbers.
    """

    two_streams: bool = False
    fused: FusedProducts | None = None

    def fusable(self) -> list[nn.Module]:
        return [self.up_proj, self.gate_proj]

    def fuse(self) -> None:
        self.fused = FusedProducts.of(self.fusable())

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
        joined = self.fused.joined(x) if self.fused is not None else None
        if joined is not None:
            return self.down_proj(fast_math.gelu_gated_joined(joined))
        if self.two_streams and few_rows(x):
            with mx.stream(cpu_streams(2)[1]):
                up = self.up_proj(x)
            return self.down_proj(gelu_gated(up, self.gate_proj(x)))
        return self.down_proj(gelu_gated(self.up_proj(x), self.gate_proj(x)))


class SelfAttention(nn.Module):
    """One self-attention layer's projections; the ``Read`` on the layer's cache attends (and writes).

    Queries and keys are RMS-normed per head (``norm(D)``; Gemma 2/3 norms scale by ``1 + weight``:
    ``plus_one``) and rotated, compiled for decode (``graphs.speedups.norm_rope``); values are
    normed when ``v_norm`` is given. A layer that reuses an earlier layer's keys and values
    (``owns_kv=False``, Gemma 4 KV sharing) has no key/value projections and passes only queries;
    without ``has_v_proj`` (Gemma 4's ``attention_k_eq_v``) the values are the raw ``k_proj`` output.
    ``fuse()`` (chosen by ``models.precision``) makes the query, key and value projections one
    product (``FusedProducts``); same parameters, same numbers.
    """

    fused: FusedProducts | None = None

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool, rope: "RoPE",
        scale: float, norm, plus_one: bool, owns_kv: bool = True, has_v_proj: bool = True, v_norm=None,
    ):  # fmt: skip
        super().__init__()
        H, D = hidden_size, head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, D
        self.scale, self.rope, self.plus_one, self.owns_kv = scale, rope, plus_one, owns_kv
        self.q_proj = nn.Linear(H, num_heads * D, bias=bias)
        self.q_norm = norm(D)
        if owns_kv:
            self.k_proj = nn.Linear(H, num_kv_heads * D, bias=bias)
            if has_v_proj:
                self.v_proj = nn.Linear(H, num_kv_heads * D, bias=bias)
            self.k_norm = norm(D)
            if v_norm is not None:
                self.v_norm = v_norm(D)
        self.o_proj = nn.Linear(num_heads * D, H, bias=bias)

    def fusable(self) -> list[nn.Module]:
        """The projections ``fuse`` makes one product (a layer without its own keys has just one)."""
        return [self[n] for n in ("q_proj", "k_proj", "v_proj") if n in self] if self.owns_kv else []

    def fuse(self) -> None:
        self.fused = FusedProducts.of(self.fusable())

    def __call__(self, x: mx.array, cache, offset: int | tuple[int, ...], read: Read) -> mx.array:
        B, L, _ = x.shape
        heads = self._decode_heads(x, offset) if L == 1 else None
        out = read(cache, *(heads or self._normed_heads(x, offset)), scale=self.scale)
        # [B, heads, L, D] -> [B, L, heads * D]; one position is already in that order (no copy)
        return self.o_proj(out.reshape(B, 1, -1) if L == 1 else out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _normed_heads(self, x: mx.array, offset) -> list[mx.array]:
        """``[q]`` (a layer without its own keys) or ``[q, k, v]``, ``[B, heads, L, D]``, normed and rotated."""
        projected = self.fused(x) if self.fused is not None else None
        raw_q = projected[0] if projected is not None else self.q_proj(x)
        q = norm_rope(self._heads(raw_q, self.num_heads), self.q_norm, self.rope, offset, self.plus_one)
        if not self.owns_kv:
            return [q]
        raw_k = projected[1] if projected is not None else self.k_proj(x)
        raw_v = (projected[-1] if projected is not None else self.v_proj(x)) if "v_proj" in self else raw_k
        k = norm_rope(self._heads(raw_k, self.num_kv_heads), self.k_norm, self.rope, offset, self.plus_one)
        v = self._heads(raw_v, self.num_kv_heads)
        if "v_norm" in self:
            v = self.v_norm(v)
        return [q, k, v]

    def _decode_heads(self, x: mx.array, offset) -> list[mx.array] | None:
        """``_normed_heads`` of one float32 position per row as one kernel node (``zoo_cpu.decode.heads``),
        or None where the backend does not run it (then the plain path does: same numbers up to summation order)."""
        norms = [self.q_norm] + ([self.k_norm] + ([self.v_norm] if "v_norm" in self else []) if self.owns_kv else [])
        plain_v = "v_norm" not in self or "weight" not in self.v_norm  # the kernel's value norm has no weight
        epsilons = {getattr(n, "eps", None) for n in norms}  # the kernel takes one eps for every norm
        if not backend.active().decode or x.dtype != mx.float32 or isinstance(offset, tuple) or not plain_v:
            return None
        if len(epsilons) != 1 or None in epsilons:
            return None
        if self.fused is not None:
            projected = self.fused.joined(x)
            if projected is None:
                return None
        elif self.owns_kv:
            projected = mx.concatenate([layer(x) for layer in self.fusable()], axis=-1)
        else:
            projected = self.q_proj(x)
        weights = [n.get("weight") for n in norms[:2]] + [None] * (2 - len(norms[:2]))  # q's and k's (none without keys)
        weights = [None if w is None else w.astype(mx.float32) for w in weights]
        return decode.heads(
            projected, self.num_heads, self.num_kv_heads if self.owns_kv else 0, "v_proj" in self, self.head_dim,
            *weights, 1.0 if self.plus_one else 0.0, self.q_norm.eps, "v_norm" in self, *self.rope.tables(offset, 1),
        )  # fmt: skip

    def _heads(self, projected: mx.array, num_heads: int) -> mx.array:
        """``[B, L, heads * D] -> [B, heads, L, D]``."""
        B, L, _ = projected.shape
        return projected.reshape(B, L, num_heads, self.head_dim).transpose(0, 2, 1, 3)


class CheckedCaches:
    """Mixin for graphs with ``make_cache()``: ``check_cache(cache)`` refuses a cache list made for
    another model (other layer types, window or sharing) with a named error, before any read."""

    def check_cache(self, cache: list) -> None:
        specs = self.__dict__.get("_cache_specs")
        if specs is None:
            fresh = self.make_cache()
            index = {id(c): i for i, c in enumerate(fresh)}
            specs = [c.spec(lambda donor: index.get(id(donor))) for c in fresh]
            self.__dict__["_cache_specs"] = specs  # plain attribute: not a parameter
        check_caches(cache, specs, type(self).__name__)


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
