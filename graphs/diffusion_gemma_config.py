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
_MODEL_DEFAULTS = dict(canvas_length=256, image_token_id=258_880, boi_token_id=255_999, eoi_token_id=258_882)


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    """What the DiffusionGemma graph and its generation loop need from ``config.json``.

    ``text`` is the shared encoder/decoder stack as a Gemma 4 text config; ``vision`` is None for a
    config without ``vision_config`` (text-only: images are refused).
    """

    text: Gemma4TextConfig
    vision: Gemma4VisionConfig | None
    canvas_length: int
    image_token_id: int
    boi_token_id: int | None
    eoi_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]

    @property
    def vision_overlay(self) -> bool:
        """Whether the encoder lets image tokens see every token of their image (``"vision"``)."""
        return self.text.use_bidirectional_attention == "vision"

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "DiffusionGemmaConfig":
        if raw.get("model_type") != "diffusion_gemma":
            raise ValueError(f"DiffusionGemmaConfig: unsupported model_type {raw.get('model_type')!r}; expected 'diffusion_gemma'")
        if raw.get("tie_word_embeddings", True) is False:
            raise ValueError(
                "DiffusionGemmaConfig: tie_word_embeddings=False unties the encoder from the decoder (two weight "
                "sets); only the released tied layout is implemented"
            )
        text = dict(raw.get("text_config") or {})
        if text.get("model_type", "diffusion_gemma_text") != "diffusion_gemma_text":
            raise ValueError(f"DiffusionGemmaConfig: text_config has model_type {text.get('model_type')!r}, expected 'diffusion_gemma_text'")
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
        softcap = text.pop("final_logit_softcapping", DEFAULT_SOFTCAP)
        if not softcap or softcap <= 0:
            raise ValueError(f"DiffusionGemmaConfig: final_logit_softcapping must be a positive number, got {softcap!r}")
        text_config = Gemma4TextConfig.from_dict(
            {**text, **_HARD_WIRED, "model_type": "gemma4_text", "final_logit_softcapping": float(softcap)}
        )
        model = {name: raw.get(name, default) for name, default in _MODEL_DEFAULTS.items()}
        if not isinstance(model["canvas_length"], int) or model["canvas_length"] < 1:
            raise ValueError(f"DiffusionGemmaConfig: canvas_length must be a positive int, got {model['canvas_length']!r}")
        return cls(
            text=text_config,
            vision=Gemma4VisionConfig.from_dict(raw) if raw.get("vision_config") else None,
            pad_token_id=text.get("pad_token_id", 0),
            bos_token_id=text.get("bos_token_id", 2),
            eos_token_id=token_ids(text.get("eos_token_id", 1)),
            **model,
        )


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)
