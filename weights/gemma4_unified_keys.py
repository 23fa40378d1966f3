"""Checkpoint key mapping for Gemma 4 unified's media embedders (``graphs.gemma4_unified``).

The text decoder's keys go to ``weights.gemma4_keys`` (``split_unified_weights`` hands it every
key that is not a media part). The media parts, in each layout this accepts:

| layout | vision embedder | vision projection | audio projection |
|---|---|---|---|
| the Hub checkpoint, and what transformers 5.24 ``save_pretrained`` writes | ``model.vision_embedder.*`` | ``model.embed_vision.embedding_projection.*`` | ``model.embed_audio.embedding_projection.*`` |
| transformers' module names (a ``state_dict`` saved as is) | ``model.embed_vision.{patch_*,pos_*}`` | ``model.embed_vision.multimodal_embedder.embedding_projection.*`` | same |
| mlx-vlm ``gemma4_unified`` (its ``sanitize`` strips ``model.``) | ``vision_embedder.*`` | ``embed_vision.embedding_projection.*`` | ``embed_audio.embedding_projection.*`` |

transformers maps the first to the second on load (``conversion_mapping.py``, ``gemma4_unified``)
and back on save. Our graph uses the Hub names. Packed quantized weights (``.scales``/``.biases``
beside ``.weight``) pass where the graph has a quantizable weight (``weights.quantize``). A media
key the graph has no parameter for (a vision embedder in a checkpoint whose config has no
``vision_config``), a missing parameter or a shape mismatch raises ``ValueError`` naming the key.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry

OWNER = "gemma4_unified keys"
# Checkpoint prefix -> our graph's module path, longest first (the transformers module names
# nest the projection inside embed_vision).
_RENAMES = (
    ("model.embed_vision.multimodal_embedder.", "embed_vision."),
    ("model.embed_vision.embedding_projection.", "embed_vision.embedding_projection."),
    ("model.embed_vision.", "vision_embedder."),
    ("model.vision_embedder.", "vision_embedder."),
    ("model.embed_audio.", "embed_audio."),
    ("vision_embedder.", "vision_embedder."),
    ("embed_vision.", "embed_vision."),
    ("embed_audio.", "embed_audio."),
)
MEDIA_MODULES = ("vision_embedder", "embed_vision", "embed_audio")


def media_name(key: str) -> str | None:
    """Our graph's name for a media key (``vision_embedder.patch_dense.weight`` ...), None for any other key."""
    for prefix, target in _RENAMES:
        if key.startswith(prefix):
            return target + key[len(prefix) :]
    return None


def has_vision_weights(names) -> bool:
    return any((media_name(n) or "").startswith("vision_embedder.") for n in names)


def has_audio_weights(names) -> bool:
    return any((media_name(n) or "").startswith("embed_audio.") for n in names)


def split_unified_weights(weights: Mapping[str, mx.array]) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """``(text keys, media keys)`` of a checkpoint, each under its checkpoint name."""
    text, media = {}, {}
    for key, value in weights.items():
        (text if media_name(key) is None else media)[key] = value
    return text, media


def map_gemma4_unified_media_weights(
    weights: Mapping[str, mx.array], expected: Mapping[str, Mapping[str, Sequence[int]]]
) -> dict[str, dict[str, mx.array]]:
    """``{module: {parameter: array}}`` for each media module of ``expected`` (``{module: parameter
    shapes}``, as ``weights.modules.parameter_shapes`` gives them), shape-checked and complete."""
    mapped: dict[str, dict[str, mx.array]] = {module: {} for module in expected}
    for key, value in weights.items():
        name = media_name(key)
        if name is None:
            raise ValueError(f"{OWNER}: {key!r} is not a media key of a gemma4_unified checkpoint")
        module, parameter = name.split(".", 1)
        if module not in expected:
            raise ValueError(f"{OWNER}: unexpected key {key!r}: the config has no {module} (its vision_config or audio_config is null)")
        check_entry(OWNER, key, parameter, value, expected[module], module)
        if parameter in mapped[module]:
            raise ValueError(f"{OWNER}: {key!r} maps to {name!r}, which another key already provided")
        mapped[module][parameter] = value
    for module, shapes in expected.items():
        check_complete(OWNER, mapped[module], shapes, module, module + ".")
    return mapped
