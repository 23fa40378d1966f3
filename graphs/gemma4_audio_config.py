"""The Gemma 4 audio tower's configuration (transformers 5.24 ``Gemma4AudioConfig``) and the media token ids.

E2B and E4B checkpoints carry an ``audio_config`` inside their ``gemma4`` config; transformers
saves a bare ``Gemma4AudioModel`` as ``gemma4_audio``. Every field is type-checked
(``graphs.config.read_settings``); values the graph does not implement (another activation, a
subsampling stack that is not the reference's two convolutions) are refused here rather than run.

``MediaTokenIds`` are the ids that place audio and video in a prompt (the image ids live in
``graphs.gemma4_multimodal_config.ImageTokenIds``): defaults are transformers' ``Gemma4Config``'s,
which are the released tokenizer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import BOOL, NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, TEXT, TOKEN_ID, ConfigError, Kind, read_fields, read_settings, setting

OWNER = "Gemma4AudioConfig"


def _audio_section(raw: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{OWNER}: the config must be a JSON object, got {type(raw).__name__}")
    if raw.get("model_type") == "gemma4_audio":
        return dict(raw)
    if raw.get("model_type") != "gemma4":
        raise ConfigError(f"{OWNER}: unsupported model_type {raw.get('model_type')!r}; expected 'gemma4_audio' or 'gemma4'")
    inner = raw.get("audio_config")
    if not isinstance(inner, Mapping) or not inner:
        raise ConfigError(f"{OWNER}: this gemma4 config has no audio_config")
    if inner.get("model_type", "gemma4_audio") != "gemma4_audio":
        raise ConfigError(f"{OWNER}: unsupported audio_config model_type {inner.get('model_type')!r}; expected 'gemma4_audio'")
    return dict(inner)
SUPPORTED_ACTIVATIONS = ("silu",)
NUMBER = Kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))

_DEFAULT_CHANNELS = (128, 32)
# The log-mel bins the subsampling convolutions read: the reference sizes its projection as
# ``channels[0] // 4 * channels[1]``, which is the flattened (bins / 4) x channels[1] only when
# channels[0] equals the feature size (128 in every release).
FEATURE_SIZE = 128


@dataclass(frozen=True)
class Gemma4AudioConfig:
    """The fields of transformers' ``Gemma4AudioConfig`` that shape the audio graph."""

    hidden_size: int = setting(1024, POSITIVE_INT, dataclass_default=True)
    num_hidden_layers: int = setting(12, POSITIVE_INT, dataclass_default=True)
    num_attention_heads: int = setting(8, POSITIVE_INT, dataclass_default=True)
    hidden_act: str = setting("silu", TEXT, dataclass_default=True)
    subsampling_conv_channels: tuple[int, int] = _DEFAULT_CHANNELS
    conv_kernel_size: int = setting(5, POSITIVE_INT, dataclass_default=True)
    residual_weight: float = setting(0.5, NUMBER, dataclass_default=True)
    attention_chunk_size: int = setting(12, POSITIVE_INT, dataclass_default=True)
    attention_context_left: int = setting(13, POSITIVE_INT, dataclass_default=True)
    attention_context_right: int = setting(0, NON_NEGATIVE_INT, dataclass_default=True)
    attention_logit_cap: float = setting(50.0, POSITIVE_FLOAT, dataclass_default=True)
    attention_invalid_logits_value: float = setting(-1.0e9, NUMBER, dataclass_default=True)
    use_clipped_linears: bool = setting(True, BOOL, dataclass_default=True)
    rms_norm_eps: float = setting(1e-6, POSITIVE_FLOAT, dataclass_default=True)
    gradient_clipping: float = setting(1e10, POSITIVE_FLOAT, dataclass_default=True)
    output_proj_dims: int = setting(1536, POSITIVE_INT, dataclass_default=True)

    def __post_init__(self) -> None:
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{OWNER}: unsupported hidden_act {self.hidden_act!r}; supported: {SUPPORTED_ACTIVATIONS}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"{OWNER}: hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}")
        first, second = self.subsampling_conv_channels
        if first != FEATURE_SIZE or second < 1:
            raise ValueError(
                f"{OWNER}: subsampling_conv_channels[0] must be {FEATURE_SIZE} (the reference sizes its input "
                f"projection as channels[0] // 4 * channels[1], the flattened 128 / 4 mel bins), got {list(self.subsampling_conv_channels)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def context_size(self) -> int:
        """Keys each chunk of queries reads: the chunk, ``left - 1`` before it and ``right`` after it."""
        return self.attention_chunk_size + self.attention_context_left - 1 + self.attention_context_right

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4AudioConfig":
        """Parse ``gemma4_audio``, or ``gemma4`` with an ``audio_config`` inside (required)."""
        audio = _audio_section(raw)
        fields = read_settings(audio, cls, OWNER)
        channels = audio.get("subsampling_conv_channels", list(_DEFAULT_CHANNELS))
        if not isinstance(channels, (list, tuple)) or len(channels) != 2 or not all(POSITIVE_INT.accepts(c) for c in channels):
            raise ConfigError(f"{OWNER}: subsampling_conv_channels must be two positive ints, got {channels!r}")
        return cls(subsampling_conv_channels=(int(channels[0]), int(channels[1])), **fields)


def has_audio_config(raw: Mapping[str, Any]) -> bool:
    return raw.get("model_type") == "gemma4" and bool(raw.get("audio_config"))


@dataclass(frozen=True)
class MediaTokenIds:
    """The ids that frame audio clips and video frames in a prompt.

    An audio clip is ``boa`` + n ``audio`` + ``eoa``; a video frame is its ``mm:ss`` timestamp text,
    ``boi`` + n ``video`` + ``eoi`` (the image ids frame video frames too).
    """

    audio: int  # the clip placeholder before expansion, and every audio soft-token position after it
    boa: int
    eoa: int
    video: int  # the video placeholder before expansion, and every frame soft-token position after it


# transformers 5.24's Gemma4Config defaults (the released tokenizer's ids). The config spells the
# end-of-audio id ``eoa_token_index``; ``eoa_token_id`` is read too when a conversion renamed it.
_MEDIA_DEFAULTS = {"audio_token_id": 258_881, "boa_token_id": 256_000, "eoa_token_index": 258_883, "video_token_id": 258_884}


def media_token_ids(raw: Mapping[str, Any], owner: str) -> MediaTokenIds:
    """The audio/video ids of a ``gemma4`` config (defaults when absent), each checked to be a token id.

    They are not checked against the vocabulary here: a small test vocabulary keeps the released
    defaults it never uses; ``Model`` refuses audio or video whose ids fall outside it."""
    fields = dict(raw)
    if "eoa_token_index" not in fields and "eoa_token_id" in fields:
        fields["eoa_token_index"] = fields["eoa_token_id"]
    ids = read_fields(fields, _MEDIA_DEFAULTS, dict.fromkeys(_MEDIA_DEFAULTS, TOKEN_ID), owner)
    return MediaTokenIds(audio=ids["audio_token_id"], boa=ids["boa_token_id"], eoa=ids["eoa_token_index"], video=ids["video_token_id"])

