"""The Gemma 4 vision tower's configuration, parsed from a ``config.json`` dict.

The same tower serves Gemma 4 (``gemma4``: ``vision_config`` inside) and DiffusionGemma
(``diffusion_gemma``: same), and transformers saves a bare ``Gemma4VisionModel`` as
``gemma4_vision``. Values the graph does not implement (biases, another activation or RoPE type)
are refused here rather than silently running a different model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import BOOL, POSITIVE_FLOAT, POSITIVE_INT, TEXT, ConfigError, check_value, read_settings, section, setting

OWNER = "Gemma4VisionConfig"
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
# transformers normalises "default" to "axial" for the vision tower.
SUPPORTED_ROPE_TYPES = ("axial", "default")
CONTAINER_MODEL_TYPES = ("gemma4", "diffusion_gemma")

_DEFAULT_ROPE_THETA = 100.0


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """The fields of transformers' ``Gemma4VisionConfig`` that shape the vision graph."""

    hidden_size: int = setting(768, POSITIVE_INT, dataclass_default=True)
    intermediate_size: int = setting(3072, POSITIVE_INT, dataclass_default=True)
    num_hidden_layers: int = setting(16, POSITIVE_INT, dataclass_default=True)
    num_attention_heads: int = setting(12, POSITIVE_INT, dataclass_default=True)
    num_key_value_heads: int = setting(12, POSITIVE_INT, dataclass_default=True)
    head_dim: int = setting(64, POSITIVE_INT, dataclass_default=True)
    hidden_activation: str = setting("gelu_pytorch_tanh", TEXT, dataclass_default=True)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT, dataclass_default=True)
    patch_size: int = setting(16, POSITIVE_INT, dataclass_default=True)
    pooling_kernel_size: int = setting(3, POSITIVE_INT, dataclass_default=True)
    position_embedding_size: int = setting(10 * 1024, POSITIVE_INT, dataclass_default=True)
    use_clipped_linears: bool = setting(False, BOOL, dataclass_default=True)
    standardize: bool = setting(False, BOOL, dataclass_default=True)
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

        Every field is type-checked (``graphs.config.read_settings``); a wrong value raises
        ``ConfigError`` naming the key."""
        vision = section(raw, OWNER, own_type="gemma4_vision", containers=CONTAINER_MODEL_TYPES, key="vision_config", required=True)
        if vision.get("attention_bias"):
            raise ValueError("Gemma4VisionConfig: attention_bias=True is not implemented (Gemma 4 has no biases)")
        fields = read_settings(vision, cls, OWNER)
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
