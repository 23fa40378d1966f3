"""Which checkpoints carry a Gemma 4 vision tower (the multimodal graph loads both mappings).

The text and vision mappings each know their layouts (transformers ``model.language_model.*`` /
``model.vision_tower.*`` / ``model.embed_vision.*``, and the MLX converters' ``language_model.model.*``
/ ``vision_tower.*`` / ``embed_vision.*``) and are strict about their own keys: the text mapping
drops exactly the vision and audio parts, the vision mapping reads only its prefixes, the audio
mapping (``weights.gemma4_audio_keys``) its own. Together every key is accounted for once; a
checkpoint whose weights lack the audio tower is built without it (audio is then refused).
"""

from __future__ import annotations

from typing import Collection

from .gemma4_vision_keys import TOWER_PREFIXES
from .layouts import Layout, prefixed

# Where a Gemma 4 (not DiffusionGemma) checkpoint keeps its vision tower; "" (a bare tower) excluded.
_GEMMA4_TOWER_PREFIXES = tuple(p for p in TOWER_PREFIXES if p and not p.startswith("model.encoder."))


def has_vision_weights(names: Collection[str]) -> bool:
    """True when the checkpoint carries a Gemma 4 vision tower (mlx-lm conversions drop it)."""
    return any(name.startswith(_GEMMA4_TOWER_PREFIXES) for name in names)


def multimodal_layout() -> Layout:
    """The export layout of the multimodal graph: mlx-vlm's ``gemma4`` keys (``language_model.model.*``,
    ``language_model.lm_head.*``; the towers' ``vision_tower.*`` / ``embed_vision.*`` / audio parts as named)."""
    return prefixed("language_model.model.", "language_model.lm_head.", "language_model.")
