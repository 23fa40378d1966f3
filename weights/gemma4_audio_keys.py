"""Checkpoint key mapping for the Gemma 4 audio tower and its embedder (``graphs.gemma4_audio``).

Our module names mirror transformers' below the part's prefix, so mapping is stripping it.
Accepted layouts (detected from the keys, first match wins):

| layout | tower prefix | embedder prefix |
|---|---|---|
| transformers ``Gemma4ForConditionalGeneration`` (E2B/E4B) | ``model.audio_tower.`` | ``model.embed_audio.`` |
| MLX converters' ``gemma4`` | ``audio_tower.`` | ``embed_audio.`` |
| transformers ``Gemma4AudioModel`` (a bare tower) | none | (no embedder) |

Convolution weights are stored in MLX's layout: torch's ``[out, in, kh, kw]`` (subsampling) and
``[channels, 1, kernel]`` (depthwise) are transposed, MLX-layout ones pass as they are (told apart
by shape). Relative-position buffers are dropped (recomputed); clip bounds are dropped when the
config has ``use_clipped_linears`` off (finite ones with a warning). Anything else unexpected,
missing or misshapen raises ``ValueError`` naming the key, so a partial tower never loads silently.
"""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry, detect_prefix
from weights.quantize import is_quantized_entry

logger = logging.getLogger(__name__)

TOWER_PREFIXES = ("model.audio_tower.", "audio_tower.", "")
EMBEDDER_PREFIXES = ("model.embed_audio.", "embed_audio.")
_TOWER_MARKER = "subsample_conv_projection.input_proj_linear.weight"
_EMBEDDER_MARKER = "embedding_projection.weight"
_CLIP_BOUNDS = (".input_min", ".input_max", ".output_min", ".output_max")


def has_audio_weights(names) -> bool:
    """True when the checkpoint carries a Gemma 4 audio tower (mlx-lm conversions drop it)."""
    return any(name.startswith(p) and name.endswith(_TOWER_MARKER) for name in names for p in TOWER_PREFIXES[:2])


def map_gemma4_audio_weights(
    weights: Mapping[str, mx.array],
    tower_expected: Mapping[str, Sequence[int]],
    embedder_expected: Mapping[str, Sequence[int]] | None = None,
    *,
    clipped: bool,
) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """``(tower weights, embedder weights)`` under our parameter names, shape-checked (as the vision mapping)."""
    tower_prefix = detect_prefix("gemma4 audio keys", weights, TOWER_PREFIXES, _TOWER_MARKER, "audio tower")
    tower = _map_part(weights, tower_prefix, tower_expected, clipped, "audio tower")
    embedder: dict[str, mx.array] = {}
    if embedder_expected is not None:
        prefix = detect_prefix("gemma4 audio keys", weights, EMBEDDER_PREFIXES, _EMBEDDER_MARKER, "audio embedder")
        embedder = _map_part(weights, prefix, embedder_expected, clipped, "audio embedder")
    return tower, embedder


def _to_mlx_layout(name: str, value: mx.array, want: tuple[int, ...]) -> mx.array:
    """A convolution weight in torch's layout moved to MLX's (channels last); others unchanged."""
    if tuple(value.shape) == want:
        return value
    if name.endswith("conv.weight") and value.ndim == 4 and tuple(value.transpose(0, 2, 3, 1).shape) == want:
        return mx.contiguous(value.transpose(0, 2, 3, 1))
    if name.endswith("depthwise_conv1d.weight") and value.ndim == 3 and tuple(value.transpose(0, 2, 1).shape) == want:
        return mx.contiguous(value.transpose(0, 2, 1))
    return value


def _map_part(weights, prefix: str, expected, clipped: bool, part: str) -> dict[str, mx.array]:
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if prefix == "" and (name.startswith(("model.", "language_model.", "vision_tower.", "embed_", "lm_head."))):
            continue  # a bare tower has no prefix: other parts' keys are not its own
        if _dropped(key, name, value, clipped):
            continue
        if name in expected and not is_quantized_entry(name, value, expected):
            value = _to_mlx_layout(name, value, tuple(expected[name]))
        check_entry("gemma4 audio keys", key, name, value, expected, part)
        mapped[name] = value
    check_complete("gemma4 audio keys", mapped, expected, part, prefix)
    return mapped


def _dropped(key: str, name: str, value: mx.array, clipped: bool) -> bool:
    if name.startswith("rel_pos_enc.") or name.endswith(".softcap") or ".rotary_emb." in name:
        logger.debug("gemma4 audio keys: dropping %s (buffer, recomputed)", key)
        return True
    if name.endswith(_CLIP_BOUNDS) and not clipped:
        if bool(mx.isfinite(value).any()):
            logger.warning("gemma4 audio keys: ignoring finite clip bound %s, as use_clipped_linears is off", key)
        return True
    return False
