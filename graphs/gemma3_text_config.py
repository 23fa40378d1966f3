"""The Gemma 3 text model's configuration, parsed from a ``config.json`` dict.

Checkpoints spell Gemma 3's RoPE in two ways: the released Hub configs (and what our GGUF import
writes) use ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling``, while transformers 5.24
writes a ``rope_parameters`` dict per layer type. ``Gemma3TextConfig.__post_init__`` and
``convert_rope_params_to_dict`` resolve both into per-type parameters and derive ``layer_types``
from ``sliding_window_pattern`` when the list is absent; this module reproduces those rules and
refuses what the graph does not implement instead of silently running a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import (
    BOOL, POSITIVE_FLOAT, POSITIVE_INT, TEXT, ConfigError, check_value, optional, read_settings, setting, text_section,
)

OWNER = "Gemma3TextConfig"
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

SUPPORTED_ROPE_TYPES = ("default", "linear")
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers' Gemma3TextConfig.default_theta.
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# transformers reads the period from the ``sliding_window_pattern`` kwarg only (default 6).
DEFAULT_SLIDING_WINDOW_PATTERN = 6


# Keys that change the maths in ways the graph does not build; a config that sets them is refused.
_REFUSED = {
    # The cache reads call the fused attention kernel, which has no score softcapping (Gemma 2 had it).
    "attn_logit_softcapping": None,
}


@dataclass(frozen=True)
class Gemma3TextConfig:
    """The fields of transformers' ``Gemma3TextConfig`` that shape the graph, after its derivations.

    ``rope_parameters`` maps each layer type to ``{"rope_type": "default" | "linear", "rope_theta": ...,
    "factor": ...}`` (``factor`` only for linear).
    """

    vocab_size: int = setting(262_208, POSITIVE_INT)
    hidden_size: int = setting(2304, POSITIVE_INT)
    intermediate_size: int = setting(9216, POSITIVE_INT)
    num_hidden_layers: int = setting(26, POSITIVE_INT)
    num_attention_heads: int = setting(8, POSITIVE_INT)
    num_key_value_heads: int = setting(4, POSITIVE_INT)
    head_dim: int = setting(256, POSITIVE_INT)
    hidden_activation: str = setting("gelu_pytorch_tanh", TEXT)
    max_position_embeddings: int = setting(131_072, POSITIVE_INT)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT)
    tie_word_embeddings: bool = setting(True, BOOL)
    attention_bias: bool = setting(False, BOOL)
    query_pre_attn_scalar: float = setting(256, POSITIVE_FLOAT)
    sliding_window: int = setting(4096, optional(POSITIVE_INT))  # null only without sliding layers (checked in _validate)
    final_logit_softcapping: float | None = setting(None, optional(POSITIVE_FLOAT))
    # EmbeddingGemma: an encoder, every position sees every other (sliding layers within the window).
    use_bidirectional_attention: bool = setting(False, optional(BOOL))
    layer_types: tuple[str, ...]
    rope_parameters: Mapping[str, Mapping[str, Any]]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma3TextConfig":
        """Parse a ``config.json`` dict: ``gemma3_text``, or ``gemma3`` with a ``text_config`` inside.

        Every field is type-checked (``graphs.config.read_settings``); a wrong value raises
        ``ConfigError`` naming the key."""
        return cls._from_text_dict(text_section(raw, "gemma3", "gemma3_text", OWNER))

    @classmethod
    def _from_text_dict(cls, text: dict) -> "Gemma3TextConfig":
        for key, inert in _REFUSED.items():
            if text.get(key, inert) not in (inert, None):
                raise ValueError(f"Gemma3TextConfig: {key}={text[key]!r} is not supported by the graph (only {inert!r})")
        fields = read_settings(text, cls, OWNER)
        fields["use_bidirectional_attention"] = bool(fields["use_bidirectional_attention"])  # null means off
        if fields["use_bidirectional_attention"] and fields["sliding_window"] is not None:
            # transformers stores W//2 + 1 (the exclusive half-width of the symmetric window) and writes back (w-1)*2.
            fields["sliding_window"] = fields["sliding_window"] // 2 + 1
        if fields["hidden_activation"] not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"Gemma3TextConfig: unsupported hidden_activation {fields['hidden_activation']!r}; "
                f"supported: {SUPPORTED_ACTIVATIONS}"
            )
        L = fields["num_hidden_layers"]
        pattern = text.get("sliding_window_pattern", DEFAULT_SLIDING_WINDOW_PATTERN)
        config = cls(
            layer_types=_layer_types(text.get("layer_types"), L, pattern),
            rope_parameters=_rope_parameters(text),
            **fields,
        )
        config._validate()
        return config

    def _validate(self) -> None:
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Gemma3TextConfig: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"Gemma3TextConfig: sliding layers need sliding_window >= 1, got {self.sliding_window!r}")

    @property
    def attention_scale(self) -> float:
        """Gemma 3 scales scores by ``query_pre_attn_scalar ** -0.5``, not by ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar) ** -0.5


def _layer_types(given, num_layers: int, pattern) -> tuple[str, ...]:
    """The given list, or transformers' default: every ``pattern``-th layer full, the others sliding."""
    if given is None:
        check_value(pattern, POSITIVE_INT, "sliding_window_pattern", OWNER)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if not isinstance(given, (list, tuple)) or not all(isinstance(t, str) for t in given):
        raise ConfigError(f"Gemma3TextConfig: layer_types must be a list of layer type names, got {given!r}")
    types = tuple(given)
    if len(types) != num_layers:
        raise ValueError(f"Gemma3TextConfig: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"Gemma3TextConfig: unsupported layer types {unknown}; supported: {LAYER_TYPES}")
    return types


def _rope_parameters(text: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-type RoPE as ``convert_rope_params_to_dict`` resolves it.

    ``rope_parameters`` entries win; ``rope_scaling`` (the old key) updates the full-attention entry;
    a missing ``rope_theta`` comes from ``rope_theta`` (full) or ``rope_local_base_freq`` (sliding),
    then from the defaults 1e6 / 1e4.
    """
    given = text.get("rope_parameters") or {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"Gemma3TextConfig: rope_parameters must be a JSON object keyed by layer type, got {given!r}")
    if given and not set(given) <= set(LAYER_TYPES):
        raise ValueError(
            f"Gemma3TextConfig: rope_parameters must be keyed by layer type {LAYER_TYPES}, got keys {sorted(given)}"
        )
    for layer_type, entry in given.items():
        if entry is not None and not isinstance(entry, Mapping):
            raise ConfigError(f"Gemma3TextConfig: rope_parameters[{layer_type!r}] must be a JSON object, got {entry!r}")
    params = {t: dict(given.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    if text.get("rope_scaling"):
        if not isinstance(text["rope_scaling"], Mapping):
            raise ConfigError(f"Gemma3TextConfig: rope_scaling must be a JSON object or null, got {text['rope_scaling']!r}")
        params[FULL].update(text["rope_scaling"])
    fallback_theta = {
        FULL: check_value(text.get("rope_theta"), optional(POSITIVE_FLOAT), "rope_theta", OWNER),
        SLIDING: check_value(text.get("rope_local_base_freq"), optional(POSITIVE_FLOAT), "rope_local_base_freq", OWNER),
    }
    resolved = {}
    for layer_type, entry in params.items():
        rope_type = entry.get("rope_type", entry.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"Gemma3TextConfig: unsupported rope_type {rope_type!r} for {layer_type}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        theta = entry.get("rope_theta")
        if theta is not None:
            check_value(theta, POSITIVE_FLOAT, f"rope_parameters[{layer_type!r}].rope_theta", OWNER)
        theta = theta or fallback_theta[layer_type] or DEFAULT_THETA[layer_type]
        out = {"rope_type": rope_type, "rope_theta": float(theta)}
        if rope_type == "linear":
            factor = entry.get("factor")
            if not isinstance(factor, (int, float)) or factor <= 0:
                raise ValueError(f"Gemma3TextConfig: linear RoPE for {layer_type} needs a positive factor, got {factor!r}")
            out["factor"] = float(factor)
        resolved[layer_type] = out
    return resolved


def mlx_lm_keys(config: Gemma3TextConfig) -> dict[str, Any]:
    """The flat keys mlx-lm's ``gemma3_text`` reads where transformers 5 writes ``layer_types`` and
    ``rope_parameters``: ``rope_theta``, ``rope_local_base_freq``, ``rope_scaling`` (linear RoPE) and
    ``sliding_window_pattern`` (when the full layers have one period)."""
    keys: dict[str, Any] = {
        "rope_theta": config.rope_parameters[FULL]["rope_theta"],
        "rope_local_base_freq": config.rope_parameters[SLIDING]["rope_theta"],
    }
    if config.rope_parameters[FULL]["rope_type"] == "linear":
        keys["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_parameters[FULL]["factor"]}
    pattern = _mlx_lm_pattern(config.layer_types)
    if pattern is not None:
        keys["sliding_window_pattern"] = pattern
    return keys


def _mlx_lm_pattern(layer_types) -> int | None:
    """The period p with layer i full iff ``i % p == p - 1`` (how mlx-lm's gemma3 places full layers), if any."""
    for p in range(1, len(layer_types) + 1):
        if all((t == FULL) == (i % p == p - 1) for i, t in enumerate(layer_types)):
            return p
    return None
