"""The configuration of Gemma 4 12B "unified" (transformers 5.24 ``Gemma4UnifiedConfig``), parsed from ``config.json``.

A ``gemma4_unified`` checkpoint is a Gemma 4 text decoder without per-layer inputs or MoE
(``gemma4_unified_text``), an encoder-free vision embedder (``gemma4_unified_vision``: merged
48x48 pixel patches straight into a linear projection) and an audio embedder over raw waveform
frames (``gemma4_unified_audio``: 640 samples, 40 ms at 16 kHz, per soft token). Either media
part may be absent or ``null``: the reference then has no such part, and neither does the graph. The text section is parsed by
``Gemma4TextConfig`` with ``configuration_gemma4_unified.py``'s own defaults (window 1024,
``use_bidirectional_attention="vision"``, 256K positions); fields the unified text config does not
have (per-layer inputs, MoE) are refused when set, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import POSITIVE_FLOAT, POSITIVE_INT, TOKEN_ID, ConfigError, read_fields, read_settings, section, setting
from graphs.gemma4_audio_config import media_token_ids
from graphs.gemma4_multimodal_config import Gemma4MultimodalConfig, ImageTokenIds
from graphs.gemma4_text_config import Gemma4TextConfig

OWNER = "Gemma4UnifiedConfig"
MODEL_TYPE = "gemma4_unified"
TEXT_MODEL_TYPE = "gemma4_unified_text"

# Where Gemma4UnifiedTextConfig's defaults differ from Gemma4TextConfig's.
_TEXT_DEFAULTS: dict[str, Any] = dict(sliding_window=1024, use_bidirectional_attention="vision", max_position_embeddings=262_144)
# Gemma4TextConfig fields that Gemma4UnifiedTextConfig removes: no per-layer inputs, no MoE.
_ABSENT_TEXT_FIELDS = ("hidden_size_per_layer_input", "enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size")

# transformers 5.24's Gemma4UnifiedConfig defaults (the released tokenizer's ids).
_IMAGE_IDS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}


@dataclass(frozen=True)
class Gemma4UnifiedVisionConfig:
    """The vision embedder: ``patch_size * pooling_kernel_size`` pixel patches (48) of 3 channels
    projected to ``mm_embed_dim``, a factorised ``[mm_posemb_size, 2, mm_embed_dim]`` position table."""

    patch_size: int = setting(16, POSITIVE_INT, dataclass_default=True)
    pooling_kernel_size: int = setting(3, POSITIVE_INT, dataclass_default=True)
    mm_embed_dim: int = setting(3840, POSITIVE_INT, dataclass_default=True)
    mm_posemb_size: int = setting(1120, POSITIVE_INT, dataclass_default=True)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT, dataclass_default=True)
    output_proj_dims: int = setting(3840, POSITIVE_INT, dataclass_default=True)

    @property
    def model_patch_size(self) -> int:
        """The side of one merged patch in pixels (one soft token)."""
        return self.patch_size * self.pooling_kernel_size

    @property
    def patch_dim(self) -> int:
        return self.model_patch_size**2 * 3

    @classmethod
    def from_section(cls, raw: Mapping[str, Any]) -> "Gemma4UnifiedVisionConfig":
        if raw.get("model_type", "gemma4_unified_vision") != "gemma4_unified_vision":
            raise ConfigError(f"{OWNER}: vision_config model_type must be 'gemma4_unified_vision', got {raw.get('model_type')!r}")
        config = cls(**read_settings(raw, cls, OWNER + ".vision_config"))
        if config.output_proj_dims != config.mm_embed_dim:
            # The reference's embedder norms and projects a vector of output_proj_dims, which is the
            # patch embedding of mm_embed_dim: any other value cannot run there either.
            raise ConfigError(
                f"{OWNER}: vision_config.output_proj_dims ({config.output_proj_dims}) must equal "
                f"vision_config.mm_embed_dim ({config.mm_embed_dim})"
            )
        return config


@dataclass(frozen=True)
class Gemma4UnifiedAudioConfig:
    """The audio embedder: raw frames of ``audio_embed_dim`` samples (also the samples per soft token)."""

    audio_embed_dim: int = setting(640, POSITIVE_INT, dataclass_default=True)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT, dataclass_default=True)

    @property
    def audio_samples_per_token(self) -> int:
        return self.audio_embed_dim

    @classmethod
    def from_section(cls, raw: Mapping[str, Any]) -> "Gemma4UnifiedAudioConfig":
        if raw.get("model_type", "gemma4_unified_audio") != "gemma4_unified_audio":
            raise ConfigError(f"{OWNER}: audio_config model_type must be 'gemma4_unified_audio', got {raw.get('model_type')!r}")
        return cls(**read_settings(raw, cls, OWNER + ".audio_config"))


def unified_text_config(raw: Mapping[str, Any]) -> Gemma4TextConfig:
    """The text decoder of a ``gemma4_unified`` config (its ``text_config``) or of a bare
    ``gemma4_unified_text`` one, with the unified defaults."""
    text = section(raw, OWNER, own_type=TEXT_MODEL_TYPE, containers=(MODEL_TYPE,), key="text_config", inner_type=TEXT_MODEL_TYPE)
    for name in _ABSENT_TEXT_FIELDS:
        if text.get(name):
            raise ConfigError(
                f"{OWNER}: text_config.{name}={text[name]!r}, but the unified text decoder has no per-layer "
                "inputs and no MoE (transformers' Gemma4UnifiedTextConfig has no such field)"
            )
    fields = {k: v for k, v in text.items() if k not in _ABSENT_TEXT_FIELDS and k != "vocab_size_per_layer_input"}
    return Gemma4TextConfig.from_dict({**_TEXT_DEFAULTS, **fields, "hidden_size_per_layer_input": 0, "model_type": "gemma4_text"})


@dataclass(frozen=True)
class Gemma4UnifiedConfig(Gemma4MultimodalConfig):
    """Gemma 4's multimodal config with the unified parts: the text decoder, the media embedders
    present (None when the config has no such part) and the ids that place images, video frames
    and audio clips in a prompt. ``vision_bidirectional`` here means every layer (the graph's mask)."""

    vision: Gemma4UnifiedVisionConfig | None
    audio: Gemma4UnifiedAudioConfig | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4UnifiedConfig":
        if not isinstance(raw, Mapping) or raw.get("model_type") != MODEL_TYPE:
            found = raw.get("model_type") if isinstance(raw, Mapping) else type(raw).__name__
            raise ConfigError(f"{OWNER}: expected model_type {MODEL_TYPE!r}, got {found!r}")
        text = unified_text_config(raw)
        vision = _part(raw, "vision_config", Gemma4UnifiedVisionConfig)
        audio = _part(raw, "audio_config", Gemma4UnifiedAudioConfig)
        ids = read_fields(raw, _IMAGE_IDS, dict.fromkeys(_IMAGE_IDS, TOKEN_ID), OWNER)
        image_tokens = ImageTokenIds(image=ids["image_token_id"], boi=ids["boi_token_id"], eoi=ids["eoi_token_id"])
        media_tokens = media_token_ids(raw, OWNER)
        pad = (raw.get("text_config") or {}).get("pad_token_id", 0)
        if not TOKEN_ID.accepts(pad) or pad >= text.vocab_size:
            raise ConfigError(f"{OWNER}: text_config.pad_token_id must be an id below {text.vocab_size}, got {pad!r}")
        outside = {name: value for name, value in ids.items() if value >= text.vocab_size}
        if outside:
            raise ConfigError(f"{OWNER}: {outside} must be ids below the vocabulary size {text.vocab_size}")
        placeholders = {"image_token_id": image_tokens.image, "video_token_id": media_tokens.video, "audio_token_id": media_tokens.audio}
        if len(set(placeholders.values())) != 3 or {image_tokens.boi, image_tokens.eoi} & set(placeholders.values()):
            raise ConfigError(f"{OWNER}: the media placeholders {placeholders} must differ from each other and from boi/eoi")
        return cls(text=text, vision=vision, image_tokens=image_tokens, pad_token_id=pad, media_tokens=media_tokens, audio=audio)


def _part(raw: Mapping[str, Any], key: str, kind):
    """The part's config, or None when the key is absent or null (the reference has no such part then)."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{OWNER}: {key} must be a JSON object or null, got {type(value).__name__}")
    return kind.from_section(value)


ASSISTANT_MODEL_TYPE = "gemma4_unified_assistant"


def unified_assistant_config(raw: Mapping[str, Any]):
    """The 12B's drafter (transformers' ``Gemma4UnifiedAssistantConfig``): a ``gemma4_assistant`` whose
    ``text_config`` is a ``gemma4_unified_text`` one (the unified defaults) and whose
    ``backbone_hidden_size`` defaults to 3840; parsed by ``Gemma4AssistantConfig``, which runs it."""
    from graphs.gemma4_assistant_config import Gemma4AssistantConfig

    if not isinstance(raw, Mapping) or raw.get("model_type") != ASSISTANT_MODEL_TYPE:
        found = raw.get("model_type") if isinstance(raw, Mapping) else type(raw).__name__
        raise ConfigError(f"{OWNER}: expected model_type {ASSISTANT_MODEL_TYPE!r}, got {found!r}")
    text = raw.get("text_config")
    if not isinstance(text, Mapping) or text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise ConfigError(f"{OWNER}: the assistant's text_config must be a {TEXT_MODEL_TYPE} config, got {text!r:.80}")
    text = {**_TEXT_DEFAULTS, **text, "model_type": "gemma4_text"}
    return Gemma4AssistantConfig.from_dict({"backbone_hidden_size": 3840, **raw, "model_type": "gemma4_assistant", "text_config": text})
