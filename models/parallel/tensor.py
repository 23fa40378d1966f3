"""Tensor parallelism: every rank runs every layer on its share of the heads, columns and vocabulary.

As in mlx-lm's ``shard`` methods and Megatron-style splits, per decoder layer:

- attention: rank r holds query heads ``[r Hq/N, (r+1) Hq/N)`` and the key/value heads they read
  (their share when ``Hkv`` divides by N; the one head their group reads, replicated, when N
  divides by ``Hkv``: E2B has one kv head), so its caches hold only those heads. ``o_proj`` holds
  the matching input columns and ends in the layer's first ``all_sum``;
- the dense MLP: ``gate``/``up`` rows and ``down`` columns ``[r I/N, (r+1) I/N)``, then the second
  ``all_sum``;
- the MoE (26B): ``experts="columns"`` cuts every expert's hidden columns like the dense MLP;
  ``experts="rows"`` gives each rank whole experts (expert parallelism). ``"auto"`` takes columns
  unless a quantized checkpoint's groups do not fit the cut (26B's 704 hidden columns in groups of
  64 do not split in two), then rows. The router is replicated; the experts end in a third ``all_sum``;
- the vocabulary: ``embed_tokens`` (and Gemma 4's per-layer table) hold vocabulary rows: a lookup
  is a masked lookup plus ``all_sum``, the tied head gathers every rank's logits (``all_gather``).
  DiffusionGemma keeps its table whole (its self-conditioning multiplies by the whole table); its
  self-conditioning MLP is split like the dense MLP.

Norms, scalars, the router, the per-layer-input projections and the media towers (rank 0) are not split.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Mapping

import mlx.nn as nn

from graphs.layers import Experts
from weights.quantize import read_quantization
from weights.shards import SKIP, Decision, Part

from models.parallel.modules import ShardedExperts, summed, vocabulary_rows
from models.parallel.sharding import LAYER_KEY, Sharding, decoder_of
from models.registry import DecoderShape

EXPERT_MODES = ("auto", "columns", "rows")

_PARAM = r"\.(weight|scales|biases|bias)$"
_PACKED = r"\.(weight|scales|biases)$"  # a bias is added after the sum: whole
_RULES = (  # (pattern of the key inside layer i, which cut)
    (re.compile(r"self_attn\.q_proj" + _PARAM), "q", 0),
    (re.compile(r"self_attn\.[kv]_proj" + _PARAM), "kv", 0),
    (re.compile(r"self_attn\.o_proj" + _PACKED), "q", -1),
    (re.compile(r"mlp\.(gate|up)_proj" + _PARAM), "even", 0),
    (re.compile(r"mlp\.down_proj" + _PACKED), "even", -1),
)
_SHARED_KV = re.compile(r"self_attn\.[kv]_(proj|norm)\.")
# The MoE experts in the layouts the key mappings read (weights.gemma4_keys, weights.diffusion_gemma_keys).
_GATE_UP = re.compile(r"experts\.gate_up_proj(\.(weight|scales|biases))?$")  # [E, 2 Im, H]: gate rows, then up rows
_SWITCH_GATE_UP = re.compile(r"experts\.switch_glu\.(gate|up)_proj" + _PACKED)  # [E, Im, H]
_DOWN = re.compile(r"experts\.(switch_glu\.)?down_proj(\.(weight|scales|biases))?$")  # [E, H, Im]


def _share(r: int, n: int) -> tuple[tuple[Fraction, Fraction], ...]:
    return ((Fraction(r, n), Fraction(r + 1, n)),)


class TensorParallel(Sharding):
    mode = "tensor"

    def __init__(self, group, options: Mapping[str, Any] | None = None, experts: str = "auto"):
        super().__init__(group, options)
        if experts not in EXPERT_MODES:
            raise ValueError(f"TensorParallel: experts must be one of {EXPERT_MODES}, got {experts!r}")
        self.experts = experts

    # ------------------------------------------------------------------------------ plan
    def configure(self, dims: DecoderShape, raw: Mapping[str, Any]) -> None:
        self.dims = dims
        N, r = self.size, self.rank
        Hq = dims.num_attention_heads
        if Hq % N:
            raise self.refuse(f"{Hq} attention heads do not split into {N} equal shares")
        self.heads = []
        for i, (kv, inner) in enumerate(zip(dims.kv_heads, dims.intermediate_sizes)):
            if kv % N and N % kv:
                raise self.refuse(f"layer {i} has {kv} key/value heads: neither a multiple nor a divisor of {N}")
            q0, q1 = r * Hq // N, (r + 1) * Hq // N
            group = Hq // kv
            self.heads.append(((q0, q1), (q0 // group, -(-q1 // group)), kv))
            if inner % N:
                raise self.refuse(f"layer {i}'s MLP has {inner} hidden columns, not a multiple of {N}")
        self.split_vocabulary = dims.split_vocabulary
        sizes = [("vocab_size", dims.vocab_size)] if self.split_vocabulary else []
        if dims.per_layer_input:
            sizes.append(("vocab_size_per_layer_input", dims.vocab_size_per_layer_input))
        for name, size in sizes:
            if size % N:
                raise self.refuse(f"{name} {size} is not a multiple of {N}")
        self.expert_mode = self._expert_mode(read_quantization(raw)) if dims.num_experts else None

    def _expert_mode(self, quantization) -> str:
        N, E, Im = self.size, self.dims.num_experts, self.dims.moe_intermediate_size
        group = quantization.default.group_size if quantization is not None else 1
        columns = Im % N == 0 and (Im // N) % group == 0
        rows = E % N == 0
        mode = self.experts
        if mode == "auto":
            mode = "columns" if columns else "rows"
        if mode == "columns" and not columns:
            raise self.refuse(f"the experts' {Im} hidden columns (quantized in groups of {group}) do not split into {N} shares")
        if mode == "rows" and not rows:
            raise self.refuse(f"{E} experts do not split into {N} equal shares")
        return mode

    def details(self) -> dict[str, Any]:
        return {"experts": self.expert_mode, "vocabulary": self.split_vocabulary}

    # ------------------------------------------------------------------------------ reading
    def part_of(self, key: str, shape: tuple[int, ...]) -> Decision:
        N, r = self.size, self.rank
        layer = LAYER_KEY.search(key)
        if layer is None:
            module = key.split(".")[-2] if "." in key else ""
            if module in ("embed_tokens", "lm_head") and self.split_vocabulary:
                return Part(0, _share(r, N), transposed=True)  # the output head's CPU layout
            if module == "embed_tokens_per_layer":
                return Part(0, _share(r, N))
            if ".self_conditioning." in f".{key}" and module in ("gate_proj", "up_proj", "down_proj"):
                return Part(-1 if module == "down_proj" else 0, _share(r, N))
            return None
        i, inside = int(layer.group(1)), layer.group(2)
        if i >= len(self.heads):
            return None  # not a decoder layer index this plan knows: left to the key mapping to judge
        (q0, q1), (k0, k1), kv = self.heads[i]
        if self.dims.reuses_kv[i] and _SHARED_KV.match(inside):
            return SKIP  # KV-shared layers read their donor's keys and values (the key mapping drops these)
        cuts = {
            "q": ((Fraction(q0, self.dims.num_attention_heads), Fraction(q1, self.dims.num_attention_heads)),),
            "kv": ((Fraction(k0, kv), Fraction(k1, kv)),),
            "even": _share(r, N),
        }
        for pattern, cut, axis in _RULES:
            if pattern.match(inside):
                return Part(axis, cuts[cut])
        if ".experts." not in f".{inside}":
            return None
        if self.expert_mode == "rows":
            return Part(0, _share(r, N))
        if _GATE_UP.match(inside):
            gate = (Fraction(r, 2 * N), Fraction(r + 1, 2 * N))
            return Part(1, (gate, (gate[0] + Fraction(1, 2), gate[1] + Fraction(1, 2))))
        if _SWITCH_GATE_UP.match(inside):
            return Part(1, _share(r, N))
        if _DOWN.match(inside):
            return Part(-1, _share(r, N))
        return None

    # ------------------------------------------------------------------------------ the graph
    def shape(self, graph: nn.Module) -> None:
        decoder, N = decoder_of(graph), self.size
        H = self.dims.hidden_size
        for layer, ((q0, q1), (k0, k1), _) in zip(decoder.layers, self.heads):
            attention = layer.self_attn
            D = attention.head_dim
            attention.num_heads, attention.num_kv_heads = q1 - q0, k1 - k0
            attention.q_proj = nn.Linear(H, (q1 - q0) * D, bias="bias" in attention.q_proj)
            attention.o_proj = nn.Linear((q1 - q0) * D, H, bias="bias" in attention.o_proj)
            for name in ("k_proj", "v_proj"):
                if name in attention:
                    setattr(attention, name, nn.Linear(H, (k1 - k0) * D, bias="bias" in attention[name]))
            _split_mlp(layer.mlp, N)
            if self.dims.num_experts:
                E, Im = self.dims.num_experts, self.dims.moe_intermediate_size
                layer.experts = Experts(H, Im // N, E) if self.expert_mode == "columns" else Experts(H, Im, E // N)
        if self.split_vocabulary:
            decoder.embed_tokens = nn.Embedding(self.dims.vocab_size // N, H)
            if "lm_head" in decoder:
                decoder.lm_head = nn.Linear(H, self.dims.vocab_size // N, bias="bias" in decoder.lm_head)
        if self.dims.per_layer_input:
            width = self.dims.num_hidden_layers * self.dims.per_layer_input
            decoder.embed_tokens_per_layer = nn.Embedding(self.dims.vocab_size_per_layer_input // N, width)
        if "self_conditioning" in graph:
            _split_mlp(graph.self_conditioning, N)

    def join(self, graph: nn.Module) -> nn.Module:
        decoder, group, r = decoder_of(graph), self.group, self.rank
        for layer in decoder.layers:
            layer.self_attn.o_proj = summed(layer.self_attn.o_proj, group)
            layer.mlp.down_proj = summed(layer.mlp.down_proj, group)
            if self.dims.num_experts:
                count = self.dims.num_experts // self.size
                rows = self.expert_mode == "rows"
                layer.experts = ShardedExperts(layer.experts, group, r * count if rows else None, count if rows else None)
        if self.split_vocabulary:
            decoder.embed_tokens = vocabulary_rows(decoder.embed_tokens, r * self.dims.vocab_size // self.size, group)
            if "lm_head" in decoder:
                decoder.lm_head = vocabulary_rows(decoder.lm_head, 0, group)
            decoder.head_blocks = None  # row blocks of the split head would skip the gather (graphs.speedups)
        if self.dims.per_layer_input:
            start = r * self.dims.vocab_size_per_layer_input // self.size
            decoder.embed_tokens_per_layer = vocabulary_rows(decoder.embed_tokens_per_layer, start, group)
        if "self_conditioning" in graph:
            graph.self_conditioning.down_proj = summed(graph.self_conditioning.down_proj, group)
        return graph


def _split_mlp(mlp: nn.Module, N: int) -> None:
    """A GeGLU MLP's ``gate``/``up`` rows and ``down`` columns for one of ``N`` shares."""
    hidden, inner = mlp.gate_proj.weight.shape[1], mlp.gate_proj.weight.shape[0] // N
    mlp.gate_proj = nn.Linear(hidden, inner, bias=False)
    mlp.up_proj = nn.Linear(hidden, inner, bias=False)
    mlp.down_proj = nn.Linear(inner, hidden, bias=False)
