"""Checkpoint key mapping for the Gemma 4 vision tower and embedder (``graphs.gemma4_vision``).

Our module names mirror transformers' below the part's prefix, so mapping is stripping the prefix.
Accepted layouts (detected from the keys, first match wins):

| layout | tower prefix | embedder prefix |
|---|---|---|
| transformers ``Gemma4ForConditionalGeneration`` (released Gemma 4) | ``model.vision_tower.`` | ``model.embed_vision.`` |
| transformers ``DiffusionGemmaForBlockDiffusion`` | ``model.encoder.vision_tower.`` | ``model.encoder.embed_vision.`` |
| mlx-vlm ``gemma4`` conversions | ``vision_tower.`` | ``embed_vision.`` |
| transformers ``Gemma4VisionModel`` (a bare tower) | none | (no embedder) |

Keys outside the detected prefixes (text, audio) belong to other graphs and are ignored here.
Inside them: rotary buffers are dropped (recomputed), and so are clip bounds when the config has
``use_clipped_linears`` off (transformers ignores them too; finite ones are logged as a warning,
since they would have changed the output). Anything else unexpected, anything missing and any
shape mismatch raises ``ValueError`` naming the key and both shapes. Quantized vision weights
(an MLX conversion that quantized the tower: packed ``.weight`` with ``.scales``/``.biases``) load
into quantized modules (``weights.quantize``); our own conversions keep the tower in full precision.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry, detect_prefix

logger = logging.getLogger(__name__)

TOWER_PREFIXES = ("model.vision_tower.", "model.encoder.vision_tower.", "vision_tower.", "")
EMBEDDER_PREFIXES = ("model.embed_vision.", "model.encoder.embed_vision.", "embed_vision.")
# The one key every tower / embedder has; it tells which prefix a checkpoint uses.
_TOWER_MARKER = "patch_embedder.input_proj.weight"
_EMBEDDER_MARKER = "embedding_projection.weight"
_CLIP_BOUNDS = (".input_min", ".input_max", ".output_min", ".output_max")


def map_gemma4_vision_weights(
    weights: Mapping[str, mx.array],
    tower_expected: Mapping[str, Sequence[int]],
    embedder_expected: Mapping[str, Sequence[int]] | None = None,
    *,
    clipped: bool,
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """``(tower weights, embedder weights)`` under our parameter names, shape-checked.

    ``*_expected`` are ``{parameter name: shape}`` of the receiving modules (``parameter_shapes``).
    Without ``embedder_expected`` only the tower is mapped (a bare ``Gemma4VisionModel``
    checkpoint has no embedder) and the embedder dict is empty. ``clipped``: the config's
    ``use_clipped_linears`` (without it, clip bounds in the checkpoint are dropped).
    """
    tower_prefix = detect_prefix("gemma4 vision keys", weights, TOWER_PREFIXES, _TOWER_MARKER, "vision tower")
    tower = _map_part(weights, tower_prefix, tower_expected, clipped, "vision tower")
    embedder: dict[str, mx.array] = {}
    if embedder_expected is not None:
        embedder_prefix = detect_prefix("gemma4 vision keys", weights, EMBEDDER_PREFIXES, _EMBEDDER_MARKER, "vision embedder")
        embedder = _map_part(weights, embedder_prefix, embedder_expected, clipped, "vision embedder")
    return tower, embedder


def _map_part(
    weights: Mapping[str, mx.array],
    prefix: str,
    expected: Mapping[str, Sequence[int]],
    clipped: bool,
    part: str,
) -> dict[str, mx.array]:
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if _dropped(key, name, value, clipped):
            continue
        check_entry("gemma4 vision keys", key, name, value, expected, part)
        mapped[name] = value
    check_complete("gemma4 vision keys", mapped, expected, part, prefix)
    return mapped


def _dropped(key: str, name: str, value: mx.array, clipped: bool) -> bool:
    """True for keys that carry nothing the graph uses (each logged)."""
    if name.startswith("rotary_emb.") or ".rotary_emb." in name:
        logger.debug("gemma4 vision keys: dropping %s (rotary buffer, recomputed)", key)
        return True
    if name.endswith(_CLIP_BOUNDS) and not clipped:
        if bool(mx.isfinite(value).any()):
            logger.warning("gemma4 vision keys: ignoring finite clip bound %s, as use_clipped_linears is off", key)
        else:
            logger.debug("gemma4 vision keys: dropping %s (infinite clip bound, use_clipped_linears is off)", key)
        return True
    return False
