"""DiffusionGemma's model configuration (``config.json``).

The model: transformers 5.24's ``DiffusionGemmaConfig`` holds a ``DiffusionGemmaTextConfig``
(Gemma 4's text config minus the switches DiffusionGemma hard-wires: MoE on every layer, K=V on
every full layer, no per-layer inputs, no KV sharing, softcap 30) and a Gemma 4 vision config. We
parse the text part with ``Gemma4TextConfig`` with those switches set, so the graph can reuse the
Gemma 4 layers and every derivation (``per_layer_config``, ``global_head_dim``, layer types) is the
one already tested.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

from graphs.config import (
    BOOL, POSITIVE_FLOAT, POSITIVE_INT, TOKEN_ID, ConfigError, Kind, check_value, optional, read_settings, setting, text_section,
)
from graphs.gemma4_text_config import Gemma4TextConfig
from graphs.gemma4_vision_config import Gemma4VisionConfig

logger = logging.getLogger(__name__)

# What DiffusionGemma hard-wires; transformers drops these fields from its text config (a value in
# config.json is ignored), so a contradicting value only earns a warning.
_HARD_WIRED = dict(
    enable_moe_block=True,
    attention_k_eq_v=True,
    hidden_size_per_layer_input=0,
    num_kv_shared_layers=0,
    use_double_wide_mlp=False,
)
_IGNORED_TEXT_FIELDS = (*_HARD_WIRED, "vocab_size_per_layer_input", "use_cache")
DEFAULT_SOFTCAP = 30.0  # a class attribute of DiffusionGemmaTextConfig, not written to config.json
_TOKEN_IDS = Kind(
    "a token id, a list of token ids or null",
    lambda v: v is None or TOKEN_ID.accepts(v) or (isinstance(v, list) and all(TOKEN_ID.accepts(i) for i in v)),
)
# The special ids the text config names (transformers' DiffusionGemmaTextConfig defaults); the other settings are the top level's.
_TEXT_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
OWNER = "DiffusionGemmaConfig"


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """What the DiffusionGemma graph and its generation loop need from ``config.json``.

    ``text`` is the shared encoder/decoder stack as a Gemma 4 text config; ``vision`` is None for a
    config without ``vision_config`` (text-only: images are refused).
    """

    text: Gemma4TextConfig
    vision: Gemma4VisionConfig | None
    canvas_length: int = setting(256, POSITIVE_INT)
    image_token_id: int = setting(258_880, TOKEN_ID)
    boi_token_id: int | None = setting(255_999, optional(TOKEN_ID))
    eoi_token_id: int | None = setting(258_882, optional(TOKEN_ID))
    pad_token_id: int | None = setting(0, optional(TOKEN_ID))
    bos_token_id: int | None = setting(2, optional(TOKEN_ID))
    eos_token_id: tuple[int, ...] = setting(1, _TOKEN_IDS)

    @property
    def vision_overlay(self) -> bool:
        """Whether the encoder lets image tokens see every token of their image (``"vision"``)."""
        return self.text.use_bidirectional_attention == "vision"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DiffusionGemmaConfig":
        """Parse a ``diffusion_gemma`` ``config.json``; every field is type-checked
        (``graphs.config``), the text stack by ``Gemma4TextConfig``."""
        if not isinstance(raw, Mapping) or raw.get("model_type") != "diffusion_gemma":
            found = raw.get("model_type") if isinstance(raw, Mapping) else raw
            raise ConfigError(f"DiffusionGemmaConfig: unsupported model_type {found!r}; expected 'diffusion_gemma'")
        model = read_settings(raw, cls, OWNER, ("canvas_length", "image_token_id", "boi_token_id", "eoi_token_id"))
        if check_value(raw.get("tie_word_embeddings", True), BOOL, "tie_word_embeddings", OWNER) is False:
            raise ValueError(
                "DiffusionGemmaConfig: tie_word_embeddings=False unties the encoder from the decoder (two weight "
                "sets); only the released tied layout is implemented"
            )
        text = text_section(raw, "diffusion_gemma", "diffusion_gemma_text", OWNER)
        ids = read_settings(text, cls, OWNER, _TEXT_IDS)
        if text.get("use_bidirectional_attention") == "all":
            raise ValueError(
                "DiffusionGemmaConfig: use_bidirectional_attention='all' (a bidirectional encoder) is not implemented; "
                "the released models use 'vision'"
            )
        for name in _IGNORED_TEXT_FIELDS:
            value = text.pop(name, None)
            if name in _HARD_WIRED and value is not None and value != _HARD_WIRED[name]:
                logger.warning("DiffusionGemmaConfig: ignoring text_config.%s=%r, as transformers does (DiffusionGemma hard-wires %r)",
                               name, value, _HARD_WIRED[name])  # fmt: skip
        softcap = check_value(text.pop("final_logit_softcapping", DEFAULT_SOFTCAP), POSITIVE_FLOAT, "final_logit_softcapping", OWNER)
        text_config = Gemma4TextConfig.from_dict(
            {**text, **_HARD_WIRED, "model_type": "gemma4_text", "final_logit_softcapping": float(softcap)}
        )
        vision = Gemma4VisionConfig.from_dict(raw) if raw.get("vision_config") else None
        if vision is not None:
            image_ids = {name: model[name] for name in ("image_token_id", "boi_token_id", "eoi_token_id")}
            outside = {name: value for name, value in image_ids.items() if value is not None and value >= text_config.vocab_size}
            if outside:
                raise ConfigError(f"DiffusionGemmaConfig: {outside} must be ids below the vocabulary size {text_config.vocab_size}")
        return cls(
            text=text_config,
            vision=vision,
            pad_token_id=ids["pad_token_id"],
            bos_token_id=ids["bos_token_id"],
            eos_token_id=token_ids(ids["eos_token_id"]),
            **model,
        )


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
