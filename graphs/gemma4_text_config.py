"""The Gemma 4 text model's configuration, parsed from a ``config.json`` dict.

transformers 5.24 derives much of the graph in ``Gemma4TextConfig.__post_init__`` and hides the
per-layer geometry (full layers have their own head_dim and kv heads) in ``per_layer_config``. This
module reproduces those rules exactly, resolves every layer's geometry once, and refuses what the
graph does not implement instead of silently running a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import (
    BOOL, POSITIVE_FLOAT, POSITIVE_INT, NON_NEGATIVE_INT, TEXT, ConfigError, Kind, check_value, one_of, optional,
    read_settings, setting, settings, text_section,
)

OWNER = "Gemma4TextConfig"
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

_GLOBAL_HEAD_DIM_DEFAULT = 512
# partial_rotary_factor and factor of a proportional RoPE entry: the share of pairs rotated, the period scale.
_ROTARY_FRACTION = Kind("a number in (0, 1]", lambda v: POSITIVE_FLOAT.accepts(v) and v <= 1)


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

    vocab_size: int = setting(262_144, POSITIVE_INT)
    hidden_size: int = setting(2304, POSITIVE_INT)
    intermediate_size: int = setting(9216, POSITIVE_INT)
    num_hidden_layers: int = setting(30, POSITIVE_INT)
    num_attention_heads: int = setting(8, POSITIVE_INT)
    num_key_value_heads: int = setting(4, POSITIVE_INT)
    head_dim: int = setting(256, POSITIVE_INT)
    layer_types: tuple[str, ...]
    layer_head_dims: tuple[int, ...]
    layer_kv_heads: tuple[int, ...]
    rope_parameters: Mapping[str, Mapping[str, Any]]
    hidden_activation: str = setting("gelu_pytorch_tanh", TEXT)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT)
    tie_word_embeddings: bool = setting(True, BOOL)
    attention_bias: bool = setting(False, BOOL)
    sliding_window: int = setting(512, NON_NEGATIVE_INT)  # 0 is what transformers writes for window 1 under "all"; checked after
    final_logit_softcapping: float | None = setting(None, optional(POSITIVE_FLOAT))
    use_bidirectional_attention: str | None = setting(None, one_of(None, "vision", "all"))
    vocab_size_per_layer_input: int = setting(262_144, POSITIVE_INT)
    hidden_size_per_layer_input: int = setting(256, NON_NEGATIVE_INT)  # 0: no per-layer inputs
    attention_k_eq_v: bool = setting(False, BOOL)
    num_kv_shared_layers: int = setting(0, NON_NEGATIVE_INT)
    enable_moe_block: bool = setting(False, BOOL)
    use_double_wide_mlp: bool = setting(False, BOOL)
    num_experts: int | None = setting(None, optional(POSITIVE_INT))
    top_k_experts: int | None = setting(None, optional(POSITIVE_INT))
    moe_intermediate_size: int | None = setting(None, optional(POSITIVE_INT))
    max_position_embeddings: int = setting(131_072, POSITIVE_INT, dataclass_default=True)  # the context a prompt may fill; not used by the maths

    # ------------------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4TextConfig":
        """Parse a ``config.json`` dict: ``gemma4_text``, or ``gemma4`` with a ``text_config`` inside.

        Every field is type-checked (``graphs.config.read_settings``); a wrong value raises
        ``ConfigError`` naming the key."""
        return cls._from_text_dict(text_section(raw, "gemma4", "gemma4_text", OWNER))

    @classmethod
    def _from_text_dict(cls, text: dict) -> "Gemma4TextConfig":
        fields = read_settings(text, cls, OWNER)
        L = fields["num_hidden_layers"]

        if fields["use_bidirectional_attention"] == "all":
            # transformers stores W//2 + 1 (the half-width of the symmetric window) and writes back (w-1)*2.
            fields["sliding_window"] = fields["sliding_window"] // 2 + 1
        elif fields["sliding_window"] < 1:
            raise ConfigError(f"Gemma4TextConfig: sliding_window must be a positive int, got {fields['sliding_window']!r}")

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
        out.update({name: getattr(self, name) for name in settings(type(self))})
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
        if not isinstance(given, (list, tuple)) or not all(isinstance(t, str) for t in given):
            raise ConfigError(f"Gemma4TextConfig: layer_types must be a list of layer type names, got {given!r}")
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
        per_layer = text["per_layer_config"] or {}
        if not isinstance(per_layer, Mapping):
            raise ConfigError(f"Gemma4TextConfig: per_layer_config must be a JSON object, got {per_layer!r}")
        overrides = {}
        for key, layer_overrides in per_layer.items():
            layer = int(key) if str(key).isdigit() else -1
            if not 0 <= layer < L:
                raise ConfigError(f"Gemma4TextConfig: per_layer_config names layer {key!r}, outside [0, {L})")
            if not isinstance(layer_overrides, Mapping):
                raise ConfigError(f"Gemma4TextConfig: per_layer_config[{key!r}] must be a JSON object, got {layer_overrides!r}")
            extra = sorted(set(layer_overrides) - set(PER_LAYER_ATTRIBUTES))
            if extra:
                raise ConfigError(
                    f"Gemma4TextConfig: per_layer_config[{key!r}] overrides {extra}; only {PER_LAYER_ATTRIBUTES} are supported"
                )
            for name, value in layer_overrides.items():
                check_value(value, POSITIVE_INT, f"per_layer_config[{key!r}].{name}", OWNER)
            overrides[layer] = layer_overrides
    else:
        global_head_dim = text.get("global_head_dim", _GLOBAL_HEAD_DIM_DEFAULT)
        full_overrides = {"head_dim": check_value(global_head_dim, POSITIVE_INT, "global_head_dim", OWNER)}
        global_kv = check_value(text.get("num_global_key_value_heads"), optional(POSITIVE_INT), "num_global_key_value_heads", OWNER)
        if fields["attention_k_eq_v"] and global_kv is not None:
            full_overrides["num_key_value_heads"] = global_kv
        overrides = {i: full_overrides for i, t in enumerate(layer_types) if t == FULL}
    head_dims = tuple(overrides.get(i, {}).get("head_dim", fields["head_dim"]) for i in range(L))
    kv_heads = tuple(overrides.get(i, {}).get("num_key_value_heads", fields["num_key_value_heads"]) for i in range(L))
    return head_dims, kv_heads


def _rope_parameters(given, layer_types: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    params = DEFAULT_ROPE_PARAMETERS if given is None else given
    if not isinstance(params, Mapping):
        raise ConfigError(f"Gemma4TextConfig: rope_parameters must be a JSON object keyed by layer type, got {params!r}")
    resolved = {}
    for layer_type in sorted(set(layer_types)):
        if layer_type not in params or not params[layer_type]:
            raise ConfigError(f"Gemma4TextConfig: rope_parameters has no entry for {layer_type!r}")
        if not isinstance(params[layer_type], Mapping):
            raise ConfigError(f"Gemma4TextConfig: rope_parameters[{layer_type!r}] must be a JSON object, got {params[layer_type]!r}")
        entry = dict(params[layer_type])
        rope_type = entry.get("rope_type")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Gemma4TextConfig: unsupported rope_type {rope_type!r} for {layer_type}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        check_value(entry.get("rope_theta"), POSITIVE_FLOAT, f"rope_parameters[{layer_type!r}].rope_theta", OWNER)
        for name, kind in (("partial_rotary_factor", _ROTARY_FRACTION), ("factor", POSITIVE_FLOAT)):
            if name in entry:
                check_value(entry[name], kind, f"rope_parameters[{layer_type!r}].{name}", OWNER)
        resolved[layer_type] = entry
    return resolved


def mlx_lm_keys(config: Gemma4TextConfig) -> dict[str, Any]:
    """The flat keys mlx-lm's ``gemma4_text`` reads where transformers 5 writes ``per_layer_config``:
    ``global_head_dim`` and ``num_global_key_value_heads``, when every full layer shares one value."""
    full = [i for i, t in enumerate(config.layer_types) if t == FULL]
    keys: dict[str, Any] = {}
    if full and len({config.layer_head_dims[i] for i in full}) == 1:
        keys["global_head_dim"] = config.layer_head_dims[full[0]]
    if full and config.attention_k_eq_v and len({config.layer_kv_heads[i] for i in full}) == 1:
        keys["num_global_key_value_heads"] = config.layer_kv_heads[full[0]]
    return keys
