"""Checkpoint key mapping for the Gemma 4 text graph (``graphs.gemma4_text.Gemma4TextModel``).

Accepted layouts (detected once per checkpoint, from its keys):

| layout | text prefix | experts |
|---|---|---|
| transformers ``Gemma4ForCausalLM`` | ``model.`` | ``experts.gate_up_proj [E, 2*Im, H]``, ``experts.down_proj`` |
| transformers ``Gemma4ForConditionalGeneration`` | ``model.language_model.`` | same |
| mlx-lm / mlx-vlm ``gemma4`` | ``language_model.model.`` | ``experts.switch_glu.{gate,up,down}_proj.*`` |
| mlx-lm ``gemma4_text`` | ``model.`` | same |

MLX layouts may store any quantizable weight packed, with ``.scales`` / ``.biases`` beside it
(``weights.quantize``): those entries pass through under the same names, and the loader swaps the
module for its quantized twin before the strict load checks their exact shapes.

Only keys known to carry nothing the text graph uses are dropped (each logged at debug level): the
k/v projections and norms of KV-shared layers, rotary buffers, a tied ``lm_head``, and the vision
and audio towers and their embedders. Anything else unexpected, anything missing and any shape
mismatch raises ``ValueError`` naming the key, so a wrong or partial checkpoint never loads silently.
"""

from __future__ import annotations

import logging
import re
from typing import Collection, Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry

OWNER = "gemma4 keys"

logger = logging.getLogger(__name__)

# Checked in this order: "model." is a prefix of "model.language_model.".
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
MULTIMODAL_PARTS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
LM_HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")

_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_SHARED_LAYER_KV = ("self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm.")


def map_gemma4_text_weights(
    weights: Mapping[str, mx.array],
    expected: Mapping[str, Sequence[int]],
    *,
    tied: bool,
    reused_layers: Collection[int] = (),
) -> dict[str, mx.array]:
    """Map a checkpoint's ``{key: array}`` onto the graph's parameter names.

    ``expected`` is ``{parameter name: shape}`` of the graph that will receive the result (see
    ``parameter_shapes``); it is what makes missing keys and shape mismatches detectable here.
    ``tied``: the head is the embedding (an ``lm_head`` key is dropped); ``reused_layers``: layers
    that read an earlier layer's keys and values (their own k/v projections are dropped).
    Arrays keep their dtype. Raises ``ValueError`` on an unexpected, missing or misshapen key.
    """
    prefix = _text_prefix(weights)
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.startswith(prefix):
            name = key[len(prefix) :]
            reason = _dropped_inside(name, reused_layers)
        else:
            name, reason = _outside_text(key, prefix, tied)
        if reason:
            logger.debug("gemma4 keys: dropping %s (%s)", key, reason)
            continue
        for target, array in _rename(key, name, value, expected):
            if target in mapped:
                raise ValueError(f"gemma4 keys: {key!r} maps to {target!r}, which another key already provided")
            mapped[target] = array
    check_complete(OWNER, mapped, expected)
    return mapped


def _text_prefix(weights: Mapping[str, mx.array]) -> str:
    for prefix in TEXT_PREFIXES:
        if any(key.startswith(prefix) for key in weights):
            return prefix
    sample = sorted(weights)[:5]
    raise ValueError(f"gemma4 keys: no Gemma 4 text weights found (looked for {TEXT_PREFIXES}); first keys: {sample}")


def _dropped_inside(name: str, reused_layers: Collection[int]) -> str | None:
    """Why a key under the text prefix carries nothing for the graph, or None when it must be loaded."""
    if name.startswith("rotary_emb.") or ".rotary_emb." in name:
        return "rotary buffer, recomputed"
    layer_key = _LAYER_KEY.fullmatch(name)
    if layer_key and layer_key.group(2).startswith(_SHARED_LAYER_KV):
        layer = int(layer_key.group(1))
        if layer in reused_layers:
            return f"layer {layer} reuses the keys and values of an earlier layer"
    return None


def _outside_text(key: str, prefix: str, tied: bool) -> tuple[str, str | None]:
    """A key outside the text prefix: an LM head (its graph name), a multimodal part (dropped), or an error."""
    for head_prefix in LM_HEAD_PREFIXES:
        if key.startswith(head_prefix):
            name = "lm_head." + key[len(head_prefix) :]
            return name, ("tied to embed_tokens" if tied else None)
    first_part = key.removeprefix("model.").split(".", 1)[0]
    if first_part in MULTIMODAL_PARTS:
        return key, f"{first_part} is not part of the text model"
    raise ValueError(f"gemma4 keys: unexpected key {key!r} (the text weights are under {prefix!r})")


def _rename(key: str, name: str, value: mx.array, expected: Mapping[str, Sequence[int]]):
    """The graph's (name, array) pairs for one checkpoint entry, shape-checked."""
    if name.endswith(".experts.gate_up_proj"):
        # transformers packs [gate; up] along the output axis: rows [0, Im) gate, [Im, 2 Im) up.
        base = name.removesuffix("gate_up_proj") + "switch_glu."
        gate_name, up_name = base + "gate_proj.weight", base + "up_proj.weight"
        if gate_name not in expected:
            check_entry(OWNER, key, gate_name, value, expected)  # raises: no such parameter
        want = tuple(expected[gate_name])
        packed = (*want[:-2], 2 * want[-2], want[-1])
        if tuple(value.shape) != packed:
            raise ValueError(f"{OWNER}: {key!r} has shape {list(value.shape)} in the checkpoint, the graph expects {list(packed)}")
        gate, up = mx.split(value, 2, axis=-2)
        return [(gate_name, mx.contiguous(gate)), (up_name, mx.contiguous(up))]
    if name.endswith(".experts.down_proj"):
        name = name.removesuffix("down_proj") + "switch_glu.down_proj.weight"
    check_entry(OWNER, key, name, value, expected)
    return [(name, value)]
