"""The Gemma 4 text model's configuration, parsed from a ``config.json`` dict.

transformers 5.24 derives much of the graph in ``Gemma4TextConfig.__post_init__`` and hides the
per-layer geometry (full layers have their own head_dim and kv heads) in ``per_layer_config``. This
module reproduces those rules exactly, resolves every layer's geometry once, and refuses what the
graph does not implement instead of silently running a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# Per-type RoPE when a config carries none (transformers' default_rope_params).
DEFAULT_ROPE_PARAMETERS = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
SUPPORTED_ROPE_TYPES = ("default", "proportional")
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# What a per_layer_config entry may override; anything else would change the graph in ways we do not build.
PER_LAYER_ATTRIBUTES = ("head_dim", "num_key_value_heads")

# transformers' dataclass defaults for every field the graph reads.
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=30,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    attention_bias=False,
    sliding_window=512,
    final_logit_softcapping=None,
    use_bidirectional_attention=None,
    vocab_size_per_layer_input=262_144,
    hidden_size_per_layer_input=256,
    attention_k_eq_v=False,
    num_kv_shared_layers=0,
    enable_moe_block=False,
    use_double_wide_mlp=False,
    num_experts=None,
    top_k_experts=None,
    moe_intermediate_size=None,
    max_position_embeddings=131_072,
)
_GLOBAL_HEAD_DIM_DEFAULT = 512


@dataclass(frozen=True)
class LayerGeometry:
    """Everything that differs between decoder layers, resolved once."""

    layer_type: str
    head_dim: int
    num_key_value_heads: int
    kv_sharing: str | None  # None, "store" (a later layer reuses its K/V) or "reuse"
    has_v_proj: bool  # False on full layers with attention_k_eq_v: V is the raw k_proj output
    intermediate_size: int  # doubled on reuse layers with use_double_wide_mlp

    @property
    def reuses_kv(self) -> bool:
        return self.kv_sharing == "reuse"


@dataclass(frozen=True)
class Gemma4TextConfig:
    """The fields of transformers' ``Gemma4TextConfig`` that shape the graph, after its derivations.

    ``sliding_window`` is the effective window (already ``W//2 + 1`` when
    ``use_bidirectional_attention == "all"``); ``layer_head_dims`` / ``layer_kv_heads`` hold every
    layer's geometry, which is what ``per_layer_config`` and ``global_head_dim`` describe.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    rope_parameters: Mapping[str, Mapping[str, Any]]
    hidden_activation: str
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int
    final_logit_softcapping: float | None
    use_bidirectional_attention: str | None
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int
    attention_k_eq_v: bool
    num_kv_shared_layers: int
    enable_moe_block: bool
    use_double_wide_mlp: bool
    num_experts: int | None
    top_k_experts: int | None
    moe_intermediate_size: int | None
    max_position_embeddings: int = 131_072  # the context a prompt may fill; not used by the maths

    # ------------------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4TextConfig":
        """Parse a ``config.json`` dict: ``gemma4_text``, or ``gemma4`` with a ``text_config`` inside."""
        model_type = raw.get("model_type")
        if model_type == "gemma4":
            text = dict(raw.get("text_config") or {})
            inner_type = text.get("model_type", "gemma4_text")
            if inner_type != "gemma4_text":
                raise ValueError(f"Gemma4TextConfig: unsupported text_config model_type {inner_type!r} inside gemma4")
        elif model_type == "gemma4_text":
            text = dict(raw)
        else:
            raise ValueError(
                f"Gemma4TextConfig: unsupported model_type {model_type!r}; expected 'gemma4_text' or 'gemma4'"
            )
        return cls._from_text_dict(text)

    @classmethod
    def _from_text_dict(cls, text: dict) -> "Gemma4TextConfig":
        fields = {name: text.get(name, default) for name, default in _DEFAULTS.items()}
        L = int(fields["num_hidden_layers"])

        if fields["use_bidirectional_attention"] not in (None, "vision", "all"):
            raise ValueError(
                f"Gemma4TextConfig: use_bidirectional_attention must be null, 'vision' or 'all', "
                f"got {fields['use_bidirectional_attention']!r}"
            )
        if fields["use_bidirectional_attention"] == "all":
            # transformers stores W//2 + 1 (the half-width of the symmetric window) and writes back (w-1)*2.
            fields["sliding_window"] = fields["sliding_window"] // 2 + 1

        layer_types = _layer_types(text.get("layer_types"), L)
        head_dims, kv_heads = _layer_geometry(text, fields, layer_types)
        rope_parameters = _rope_parameters(text.get("rope_parameters"), layer_types)
        if fields["hidden_activation"] not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"Gemma4TextConfig: unsupported hidden_activation {fields['hidden_activation']!r}; "
                f"supported: {SUPPORTED_ACTIVATIONS}"
            )
        config = cls(
            layer_types=layer_types,
            layer_head_dims=head_dims,
            layer_kv_heads=kv_heads,
            rope_parameters=rope_parameters,
            **fields,
        )
        config._validate()
        return config

    def _validate(self) -> None:
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise ValueError(
                "Gemma4TextConfig: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size, got "
                f"{self.num_experts}, {self.top_k_experts}, {self.moe_intermediate_size}"
            )
        for layer, kv in enumerate(self.layer_kv_heads):
            if kv < 1 or self.num_attention_heads % kv:
                raise ValueError(
                    f"Gemma4TextConfig: layer {layer}: num_attention_heads {self.num_attention_heads} "
                    f"is not a multiple of its kv heads {kv}"
                )
        self.kv_sharing_modes  # raises when a reused layer type has no producer

    # ------------------------------------------------------------------------------ derived
    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def kv_sharing_modes(self) -> tuple[str | None, ...]:
        """Per layer: None, "store" (last non-shared layer of its type) or "reuse" (transformers' rule)."""
        first = self.first_kv_shared_layer
        if first <= 0:
            raise ValueError(
                f"Gemma4TextConfig: num_kv_shared_layers={self.num_kv_shared_layers} leaves no layer that "
                f"computes keys and values (num_hidden_layers={self.num_hidden_layers})"
            )
        producing = self.layer_types[:first]
        missing = set(self.layer_types) - set(producing)
        if missing:
            raise ValueError(
                f"Gemma4TextConfig: layer types {sorted(missing)} are reused by KV-shared layers but no earlier "
                "layer of that type computes keys and values"
            )
        modes: list[str | None] = [None if i < first else "reuse" for i in range(self.num_hidden_layers)]
        for layer in self.kv_donors.values():
            modes[layer] = "store"
        return tuple(modes)

    @property
    def kv_donors(self) -> dict[str, int]:
        """Layer type -> the last non-shared layer of that type, whose K/V the reuse layers of that type read."""
        first = self.first_kv_shared_layer
        return {t: max(i for i in range(first) if self.layer_types[i] == t) for t in set(self.layer_types[:first])}

    @property
    def layers(self) -> tuple[LayerGeometry, ...]:
        modes = self.kv_sharing_modes
        geometry = []
        for i, layer_type in enumerate(self.layer_types):
            reuse = modes[i] == "reuse"
            geometry.append(
                LayerGeometry(
                    layer_type=layer_type,
                    head_dim=self.layer_head_dims[i],
                    num_key_value_heads=self.layer_kv_heads[i],
                    kv_sharing=modes[i],
                    has_v_proj=not (self.attention_k_eq_v and layer_type == FULL),
                    intermediate_size=self.intermediate_size * (2 if self.use_double_wide_mlp and reuse else 1),
                )
            )
        return tuple(geometry)

    def head_dim_of(self, layer_type: str) -> int:
        """The head_dim every layer of ``layer_type`` shares (RoPE frequencies are built per type)."""
        dims = {d for t, d in zip(self.layer_types, self.layer_head_dims) if t == layer_type}
        if len(dims) != 1:
            raise ValueError(f"Gemma4TextConfig: layers of type {layer_type!r} do not share one head_dim: {sorted(dims)}")
        return dims.pop()

    # ------------------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict in the form transformers 5.24 writes (``per_layer_config``, window written back)."""
        out: dict[str, Any] = {"model_type": "gemma4_text"}
        out.update({name: getattr(self, name) for name in _DEFAULTS})
        if self.use_bidirectional_attention == "all":
            out["sliding_window"] = (self.sliding_window - 1) * 2
        out["layer_types"] = list(self.layer_types)
        out["rope_parameters"] = {t: dict(p) for t, p in self.rope_parameters.items()}
        per_layer: dict[str, dict[str, int]] = {}
        for i, (d, kv) in enumerate(zip(self.layer_head_dims, self.layer_kv_heads)):
            overrides = {}
            if d != self.head_dim:
                overrides["head_dim"] = d
            if kv != self.num_key_value_heads:
                overrides["num_key_value_heads"] = kv
            if overrides:
                per_layer[str(i)] = overrides
        out["per_layer_config"] = per_layer
        return out


def _layer_types(given, num_layers: int) -> tuple[str, ...]:
    """transformers' default pattern (5 sliding : 1 full), and the last layer forced to full attention."""
    if given is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    else:
        types = list(given)
    if len(types) != num_layers:
        raise ValueError(f"Gemma4TextConfig: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"Gemma4TextConfig: unsupported layer types {unknown}; supported: {LAYER_TYPES}")
    if types:
        types[-1] = FULL
    return tuple(types)


def _layer_geometry(text: dict, fields: dict, layer_types: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Every layer's (head_dim, kv heads), from ``per_layer_config`` when present, else from the kwargs form.

    In the kwargs form full layers get ``global_head_dim`` (default 512), and
    ``num_global_key_value_heads`` only when ``attention_k_eq_v`` is set. When ``per_layer_config``
    is present (even empty) transformers ignores both kwargs.
    """
    L = len(layer_types)
    if "per_layer_config" in text:
        overrides = {}
        for key, layer_overrides in (text["per_layer_config"] or {}).items():
            layer = int(key)
            if not 0 <= layer < L:
                raise ValueError(f"Gemma4TextConfig: per_layer_config names layer {key!r}, outside [0, {L})")
            extra = sorted(set(layer_overrides) - set(PER_LAYER_ATTRIBUTES))
            if extra:
                raise ValueError(
                    f"Gemma4TextConfig: per_layer_config[{key!r}] overrides {extra}; only {PER_LAYER_ATTRIBUTES} are supported"
                )
            overrides[layer] = layer_overrides
    else:
        full_overrides = {"head_dim": text.get("global_head_dim", _GLOBAL_HEAD_DIM_DEFAULT)}
        global_kv = text.get("num_global_key_value_heads")
        if fields["attention_k_eq_v"] and global_kv is not None:
            full_overrides["num_key_value_heads"] = global_kv
        overrides = {i: full_overrides for i, t in enumerate(layer_types) if t == FULL}
    head_dims = tuple(int(overrides.get(i, {}).get("head_dim", fields["head_dim"])) for i in range(L))
    kv_heads = tuple(
        int(overrides.get(i, {}).get("num_key_value_heads", fields["num_key_value_heads"])) for i in range(L)
    )
    return head_dims, kv_heads


def _rope_parameters(given, layer_types: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    params = DEFAULT_ROPE_PARAMETERS if given is None else given
    resolved = {}
    for layer_type in sorted(set(layer_types)):
        if layer_type not in params or not params[layer_type]:
            raise ValueError(f"Gemma4TextConfig: rope_parameters has no entry for {layer_type!r}")
        entry = dict(params[layer_type])
        rope_type = entry.get("rope_type")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Gemma4TextConfig: unsupported rope_type {rope_type!r} for {layer_type}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        resolved[layer_type] = entry
    return resolved
