"""Checkpoint keys of Gemma 3 text models (transformers, mlx-lm and mlx-vlm layouts) onto ``graphs.gemma3_text``."""

from __future__ import annotations

from typing import Mapping, Sequence

import mlx.core as mx

from weights.modules import check_complete, check_entry

# Where the text weights sit in each checkpoint layout, checked in this order ("model." is a prefix
# of "model.language_model."): transformers Gemma3ForConditionalGeneration, mlx-vlm / older
# transformers multimodal, Gemma3ForCausalLM (and mlx-lm), Gemma3TextModel (EmbeddingGemma-style).
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "")
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
MULTIMODAL_PARTS = ("vision_tower", "multi_modal_projector")


def map_gemma3_text_weights(
    weights: Mapping[str, mx.array], expected: Mapping[str, Sequence[int]], *, tied: bool
) -> dict[str, mx.array]:
    """Map a checkpoint's ``{key: array}`` onto the graph's parameter names (``expected``: name -> shape), strictly.

    The text weights are found under one of ``TEXT_PREFIXES``; a tied (``tied``) ``lm_head``, rotary buffers
    and the vision tower / projector of a multimodal checkpoint are dropped. Any other unexpected
    key, a missing parameter or a shape mismatch raises ``ValueError`` naming the key. Packed
    weights with ``.scales``/``.biases`` (MLX layouts) pass through; the loader quantizes those modules.
    """
    prefix = next((p for p in TEXT_PREFIXES if f"{p}embed_tokens.weight" in weights), None)
    if prefix is None:
        raise ValueError(
            f"gemma3 keys: no embed_tokens.weight under any of {TEXT_PREFIXES}; first keys: {sorted(weights)[:5]}"
        )
    mapped: dict[str, mx.array] = {}
    for key, value in weights.items():
        head = next((key[len(k) - len("weight") :] for k in LM_HEAD_KEYS if key.startswith(k.removesuffix("weight"))), None)
        if head is not None:  # lm_head.weight (and, packed, lm_head.scales / .biases)
            if tied:
                continue
            name = "lm_head." + head
        elif key.startswith(prefix):
            name = key[len(prefix) :]
            if "rotary_emb." in name:
                continue
        elif key.removeprefix("model.").split(".", 1)[0] in MULTIMODAL_PARTS:
            continue
        else:
            raise ValueError(f"gemma3 keys: unexpected key {key!r} (the text weights are under {prefix!r})")
        check_entry("gemma3 keys", key, name, value, expected)
        mapped[name] = value
    check_complete("gemma3 keys", mapped, expected)
    return mapped
