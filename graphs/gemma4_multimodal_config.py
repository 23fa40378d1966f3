"""The configuration of a Gemma 4 checkpoint with a vision tower (transformers' ``Gemma4Config``).

It is the text config, the vision config, the audio config when the checkpoint has an audio tower
(E2B/E4B; ``graphs.gemma4_audio_config``) and the ids that place images, video frames and audio
clips in a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import TOKEN_ID, ConfigError, read_fields, text_section
from graphs.gemma4_audio_config import Gemma4AudioConfig, MediaTokenIds, has_audio_config, media_token_ids
from graphs.gemma4_text_config import Gemma4TextConfig
from graphs.gemma4_vision_config import Gemma4VisionConfig

@dataclass(frozen=True)
class ImageTokenIds:
    """The three ids that frame and fill an image in the prompt."""

    image: int  # the placeholder before expansion, and every soft-token position after it
    boi: int
    eoi: int


# transformers 5.24's Gemma4Config / Gemma4TextConfig defaults (the released tokenizer's ids).
_DEFAULT_IDS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}
_DEFAULT_PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class Gemma4MultimodalConfig:
    text: Gemma4TextConfig
    vision: Gemma4VisionConfig
    image_tokens: ImageTokenIds
    pad_token_id: int  # image positions are embedded as this token before their features overwrite them
    media_tokens: MediaTokenIds = media_token_ids({}, "Gemma4MultimodalConfig")  # audio and video ids
    audio: Gemma4AudioConfig | None = None  # None: no audio tower (or its weights were dropped)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Gemma4MultimodalConfig":
        """Parse a ``gemma4`` ``config.json`` that has a ``vision_config``."""
        text = Gemma4TextConfig.from_dict(raw)
        vision = Gemma4VisionConfig.from_dict(raw)
        ids = read_fields(raw, _DEFAULT_IDS, dict.fromkeys(_DEFAULT_IDS, TOKEN_ID), "Gemma4MultimodalConfig")
        pad = text_section(raw, "gemma4", "gemma4_text", "Gemma4MultimodalConfig").get("pad_token_id", _DEFAULT_PAD_TOKEN_ID)
        if not TOKEN_ID.accepts(pad) or pad >= text.vocab_size:
            raise ValueError(f"Gemma4MultimodalConfig: text_config.pad_token_id must be an id below {text.vocab_size}, got {pad!r}")
        outside = {name: value for name, value in ids.items() if value >= text.vocab_size}
        if outside:
            raise ConfigError(f"Gemma4MultimodalConfig: {outside} must be ids below the vocabulary size {text.vocab_size}")
        tokens = ImageTokenIds(image=ids["image_token_id"], boi=ids["boi_token_id"], eoi=ids["eoi_token_id"])
        if tokens.boi == tokens.image or tokens.eoi == tokens.image:
            raise ValueError(f"Gemma4MultimodalConfig: boi/eoi must differ from the image token, got {tokens}")
        audio = Gemma4AudioConfig.from_dict(raw) if has_audio_config(raw) else None
        media = media_token_ids(raw, "Gemma4MultimodalConfig")
        return cls(text=text, vision=vision, image_tokens=tokens, pad_token_id=pad, media_tokens=media, audio=audio)

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def vision_bidirectional(self) -> bool:
        """Sliding layers attend both ways inside an image during prefill (``use_bidirectional_attention == "vision"``)."""
        return self.text.use_bidirectional_attention == "vision"


def has_vision_config(raw: Mapping[str, Any]) -> bool:
    return raw.get("model_type") == "gemma4" and bool(raw.get("vision_config"))
