"""Checkpoint key mapping for DiffusionGemma (``graphs.diffusion_gemma.DiffusionGemmaModel``).

The text weights are stored once, under the decoder; the encoder contributes only its own
``layer_scalar`` buffers and the vision parts. Accepted layouts (told apart by the expert keys):

| part | transformers ``DiffusionGemmaForBlockDiffusion`` | mlx-vlm ``diffusion_gemma`` conversion |
|---|---|---|
| shared text stack | ``model.decoder.{embed_tokens,norm,layers.*,self_conditioning.*}`` | same |
| experts | ``experts.gate_up_proj [E, 2*Im, H]``, ``experts.down_proj [E, H, Im]`` | same arrays with a ``.weight`` suffix |
| encoder scalars | ``model.encoder.language_model.layers.{l}.layer_scalar`` | same |
| vision | ``model.encoder.vision_tower.*``, ``model.encoder.embed_vision.*`` | same |

Dropped (logged at debug level): ``lm_head.weight`` and any other ``model.encoder.language_model.*``
entry (both tied to the decoder's weights), rotary buffers. Anything else unexpected, anything
missing and any shape mismatch raises ``ValueError`` naming the key. MLX conversions may store any
quantizable weight packed with ``.scales`` / ``.biases`` beside it (the experts too, as
``experts.gate_up_proj.{weight,scales,biases}``, split like the float array); the loader swaps those
modules for quantized ones (``weights.quantize``) before the strict load.
"""

from __future__ import annotations

import logging
import re
from typing import Mapping, Sequence

import mlx.core as mx

from weights.gemma4_vision_keys import map_gemma4_vision_weights
from weights.layouts import Layout
from weights.modules import check_complete, check_entry

logger = logging.getLogger(__name__)

DECODER_PREFIX = "model.decoder."
ENCODER_TEXT_PREFIX = "model.encoder.language_model."
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_ENCODER_SCALAR = re.compile(r"layers\.(\d+)\.layer_scalar")
_EXPERT_SUFFIXES = (".weight", ".scales", ".biases")


def map_diffusion_gemma_weights(
    weights: Mapping[str, mx.array], expected: Mapping[str, Sequence[int]], *, vision_clipped: bool | None
) -> dict[str, mx.array]:
    """``{graph parameter name: array}`` from a checkpoint's ``{key: array}``, shape-checked.

    ``expected`` is the graph's ``{parameter name: shape}``; ``vision_clipped`` is the vision
    config's ``use_clipped_linears``, or None for a graph without a vision tower.
    """
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        for name, array in _text_entries(key, value):
            check_entry("diffusion_gemma keys", key, name, array, expected)
            if name in mapped:
                raise ValueError(f"diffusion_gemma keys: {key!r} maps to {name!r}, which another key already provided")
            mapped[name] = array
    if vision_clipped is not None:
        tower, embedder = map_gemma4_vision_weights(
            weights, _below(expected, "vision_tower."), _below(expected, "embed_vision."), clipped=vision_clipped
        )
        mapped.update({f"vision_tower.{k}": v for k, v in tower.items()})
        mapped.update({f"embed_vision.{k}": v for k, v in embedder.items()})
    elif any(key.startswith(VISION_PREFIXES) for key in weights):
        logger.debug("diffusion_gemma keys: dropping the vision weights (the config has no vision_config)")
    check_complete("diffusion_gemma keys", mapped, expected)
    return mapped


def _below(expected: Mapping[str, Sequence[int]], prefix: str) -> dict[str, Sequence[int]]:
    return {name[len(prefix) :]: shape for name, shape in expected.items() if name.startswith(prefix)}


def _text_entries(key: str, value: mx.array) -> list[tuple[str, mx.array]]:
    """The graph's (name, array) pairs for one key outside the vision parts; [] for dropped keys."""
    if key.startswith(VISION_PREFIXES):
        return []  # mapped by weights.gemma4_vision_keys
    if "rotary_emb." in key or key == "lm_head.weight":
        logger.debug("diffusion_gemma keys: dropping %s (%s)", key, "rotary buffer" if "rotary" in key else "tied")
        return []
    if key.startswith(ENCODER_TEXT_PREFIX):
        name = key[len(ENCODER_TEXT_PREFIX) :]
        scalar = _ENCODER_SCALAR.fullmatch(name)
        if scalar:
            return [(f"layers.{scalar.group(1)}.encoder_layer_scalar", value)]
        logger.debug("diffusion_gemma keys: dropping %s (tied to the decoder's weights)", key)
        return []
    if not key.startswith(DECODER_PREFIX):
        raise ValueError(
            f"diffusion_gemma keys: unexpected key {key!r} (the weights are under {DECODER_PREFIX!r}, "
            f"{ENCODER_TEXT_PREFIX!r} and {VISION_PREFIXES})"
        )
    name = key[len(DECODER_PREFIX) :]
    suffix = ".weight"  # transformers stores the expert arrays bare, mlx-vlm as modules (packed: + scales, biases)
    if ".experts." in name and name.endswith(_EXPERT_SUFFIXES):
        name, suffix = name.rsplit(".", 1)[0], "." + name.rsplit(".", 1)[1]
    if name.endswith(".experts.gate_up_proj"):
        # [gate; up] along the output axis: rows [0, Im) gate, [Im, 2 Im) up (packed rows split alike).
        if value.ndim != 3 or value.shape[1] % 2:
            raise ValueError(f"diffusion_gemma keys: {key!r} must be [experts, 2 * moe_intermediate, hidden], got {list(value.shape)}")
        base = name.removesuffix("gate_up_proj") + "switch_glu."
        gate, up = mx.split(value, 2, axis=1)
        return [(base + "gate_proj" + suffix, mx.contiguous(gate)), (base + "up_proj" + suffix, mx.contiguous(up))]
    if name.endswith(".experts.down_proj"):
        return [(name.removesuffix("down_proj") + "switch_glu.down_proj" + suffix, value)]
    return [(key[len(DECODER_PREFIX) :], value)]


# ---------------------------------------------------------------------------------------- export
_EXPERT = re.compile(r"(layers\.\d+\.experts)\.switch_glu\.(gate|up|down)_proj\.(weight|scales|biases)")
_GRAPH_ENCODER_SCALAR = re.compile(r"layers\.(\d+)\.encoder_layer_scalar")


class DiffusionLayout(Layout):
    """The export mirror of ``map_diffusion_gemma_weights``: transformers' / mlx-vlm's keys for the
    decoder stack, the encoder's scalars and vision parts, and the experts fused back into
    ``gate_up_proj`` ([gate; up] along the rows, which packed weights, scales and biases all split
    the same way)."""

    def __init__(self):
        super().__init__(self._diffusion_key)

    @staticmethod
    def _diffusion_key(name: str) -> str:
        if (m := _GRAPH_ENCODER_SCALAR.fullmatch(name)) is not None:
            return f"{ENCODER_TEXT_PREFIX}layers.{m.group(1)}.layer_scalar"
        if name.startswith(("vision_tower.", "embed_vision.")):
            return "model.encoder." + name
        if (m := _EXPERT.fullmatch(name)) is not None:
            fused = "gate_up" if m.group(2) in ("gate", "up") else "down"
            return f"{DECODER_PREFIX}{m.group(1)}.{fused}_proj.{m.group(3)}"
        return DECODER_PREFIX + name

    def export(self, params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name, value in params.items():
            m = _EXPERT.fullmatch(name)
            if m is None or m.group(2) == "down":
                out[self.key(name)] = value
            elif m.group(2) == "gate":
                up = params[name.replace(".switch_glu.gate_proj.", ".switch_glu.up_proj.")]
                out[self.key(name)] = mx.concatenate([value, up], axis=1)
        return out
