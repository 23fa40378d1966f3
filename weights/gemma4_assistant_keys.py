"""Checkpoint key mapping for the Gemma 4 assistant graph (``graphs.gemma4_assistant``).

transformers' ``Gemma4AssistantForCausalLM`` layout: the decoder under ``model.`` (no key/value
projections: every layer reuses the target's), ``pre_projection``, ``post_projection``,
``masked_embedding.{centroids.weight, token_ordering}`` and a tied ``lm_head``. Packed MLX entries
(``.scales`` / ``.biases``) pass through under their names. Dropped (logged at debug level):
rotary buffers, a tied ``lm_head``, and key/value projections or norms should a checkpoint carry
them. Anything else unexpected, anything missing and any shape mismatch raises ``ValueError``
naming the key.
"""

from __future__ import annotations

import logging
import re
from typing import Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry

logger = logging.getLogger(__name__)

_OWN = ("pre_projection.", "post_projection.", "masked_embedding.", "lm_head.")
_UNUSED_KV = re.compile(r"layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


def map_gemma4_assistant_weights(
    weights: Mapping[str, mx.array], expected: Mapping[str, Sequence[int]], *, tied: bool
) -> dict[str, mx.array]:
    """Map a checkpoint's ``{key: array}`` onto the graph's parameter names (``expected``: name -> shape)."""
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        name = key.removeprefix("model.") if not key.startswith(_OWN) else key
        reason = None
        if "rotary_emb." in name:
            reason = "rotary buffer, recomputed"
        elif _UNUSED_KV.match(name):
            reason = "an assistant layer reuses the target's keys and values"
        elif name.startswith("lm_head.") and tied:
            reason = "tied to embed_tokens"
        if reason:
            logger.debug("gemma4_assistant keys: dropping %s (%s)", key, reason)
            continue
        if name.endswith("token_ordering"):
            value = value.astype(mx.int32)
        check_entry("gemma4_assistant keys", key, name, value, expected)
        mapped[name] = value
    check_complete("gemma4_assistant keys", mapped, expected)
    return mapped
