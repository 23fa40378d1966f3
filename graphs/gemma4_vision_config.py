"""The Gemma 4 vision tower's configuration, parsed from a ``config.json`` dict.

The same tower serves Gemma 4 (``gemma4``: ``vision_config`` inside) and DiffusionGemma
(``diffusion_gemma``: same), and transformers saves a bare ``Gemma4VisionModel`` as
``gemma4_vision``. Values the graph does not implement (biases, another activation or RoPE type)
are refused here rather than silently running a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import BOOL, POSITIVE_FLOAT, POSITIVE_INT, TEXT, ConfigError, Kind, check_value, read_fields, section

OWNER = "Gemma4VisionConfig"
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers normalises "default" to "axial" for the vision tower.
SUPPORTED_ROPE_TYPES = ("axial", "default")
CONTAINER_MODEL_TYPES = ("gemma4", "diffusion_gemma")

# transformers 5.24's ``Gemma4VisionConfig`` defaults for every field the graph reads.
_DEFAULTS: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=10 * 1024,
    use_clipped_linears=False,
    standardize=False,
)
_DEFAULT_ROPE_THETA = 100.0
# What each field may hold (graphs.config): a wrong kind is refused naming the key, not run.
_KINDS: dict[str, Kind] = dict(
    hidden_size=POSITIVE_INT,
    intermediate_size=POSITIVE_INT,
    num_hidden_layers=POSITIVE_INT,
    num_attention_heads=POSITIVE_INT,
    num_key_value_heads=POSITIVE_INT,
    head_dim=POSITIVE_INT,
    hidden_activation=TEXT,
    rms_norm_eps=POSITIVE_FLOAT,
    patch_size=POSITIVE_INT,
    pooling_kernel_size=POSITIVE_INT,
    position_embedding_size=POSITIVE_INT,
    use_clipped_linears=BOOL,
    standardize=BOOL,
)


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """The fields of transformers' ``Gemma4VisionConfig`` that shape the vision graph."""

    hidden_size: int = _DEFAULTS["hidden_size"]
    intermediate_size: int = _DEFAULTS["intermediate_size"]
    num_hidden_layers: int = _DEFAULTS["num_hidden_layers"]
    num_attention_heads: int = _DEFAULTS["num_attention_heads"]
    num_key_value_heads: int = _DEFAULTS["num_key_value_heads"]
    head_dim: int = _DEFAULTS["head_dim"]
    hidden_activation: str = _DEFAULTS["hidden_activation"]
    rms_norm_eps: float = _DEFAULTS["rms_norm_eps"]
    patch_size: int = _DEFAULTS["patch_size"]
    pooling_kernel_size: int = _DEFAULTS["pooling_kernel_size"]
    position_embedding_size: int = _DEFAULTS["position_embedding_size"]
    use_clipped_linears: bool = _DEFAULTS["use_clipped_linears"]
    standardize: bool = _DEFAULTS["standardize"]
    rope_theta: float = _DEFAULT_ROPE_THETA

    def __post_init__(self) -> None:
        if self.hidden_activation not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"Gemma4VisionConfig: unsupported hidden_activation {self.hidden_activation!r}; "
                f"supported: {SUPPORTED_ACTIVATIONS}"
            )
        if self.head_dim % 4:
            raise ValueError(
                f"Gemma4VisionConfig: head_dim must be a multiple of 4 (2-D RoPE rotates pairs inside each "
                f"half), got {self.head_dim}"
            )
        if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Gemma4VisionConfig: num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        for name in ("patch_size", "pooling_kernel_size", "position_embedding_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"Gemma4VisionConfig: {name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4VisionConfig":
        """Parse ``gemma4_vision``, or ``gemma4`` / ``diffusion_gemma`` with a ``vision_config`` inside.

        Every field is type-checked (``graphs.config.read_fields``); a wrong value raises
        ``ConfigError`` naming the key."""
        vision = section(raw, OWNER, own_type="gemma4_vision", containers=CONTAINER_MODEL_TYPES, key="vision_config", required=True)
        if vision.get("attention_bias"):
            raise ValueError("Gemma4VisionConfig: attention_bias=True is not implemented (Gemma 4 has no biases)")
        fields = read_fields(vision, _DEFAULTS, _KINDS, OWNER)
        return cls(rope_theta=_rope_theta(vision.get("rope_parameters")), **fields)


def _rope_theta(rope_parameters: Mapping[str, Any] | None) -> float:
    if not rope_parameters:
        return _DEFAULT_ROPE_THETA
    if not isinstance(rope_parameters, Mapping):
        raise ConfigError(f"Gemma4VisionConfig: rope_parameters must be a JSON object, got {rope_parameters!r}")
    rope_type = rope_parameters.get("rope_type", "axial")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Gemma4VisionConfig: unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    theta = rope_parameters.get("rope_theta", _DEFAULT_ROPE_THETA)
    return float(check_value(theta, POSITIVE_FLOAT, "rope_parameters.rope_theta", OWNER))
