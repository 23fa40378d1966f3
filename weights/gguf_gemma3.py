"""llama.cpp's Gemma 3 GGUF layout mapped back to transformers' ``Gemma3ForCausalLM``.

Three things are undone here: llama.cpp's tensor names (``blk.N.attn_q`` ...), the ``+ 1`` its
converter folds into every Gemma norm weight (``convert_hf_to_gguf.py`` Gemma3Model.modify_tensors:
``if name.endswith("norm.weight"): data_torch = data_torch + 1``; transformers' GGUF loader takes it
off again in ``Gemma2TensorProcessor``, also used for gemma3), and the hyper-parameters the file
does not record, which llama.cpp hard-codes for the architecture. Q and K are *not* permuted for
Gemma (llama.cpp runs it with NEOX-style RoPE, the same ``rotate_half`` pairing as transformers),
so they pass through unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

ARCHITECTURE = "gemma3"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent from Gemma 3 files: the head is tied
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# What llama.cpp assumes for gemma3 when the file says nothing (llama-model.cpp, LLM_ARCH_GEMMA3).
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE_FREQ = 10_000.0
END_OF_TURN = "<end_of_turn>"
_27B_LAYERS = 62  # llama.cpp's LLM_TYPE_27B, the one size whose query scale is not head_dim ** -0.5


def hf_tensor_name(gguf_name: str, num_layers: int) -> str:
    """The transformers name of a Gemma 3 GGUF tensor; ``ValueError`` naming it when unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES and int(match.group(1)) < num_layers:
        return f"model.layers.{int(match.group(1))}.{_BLOCK_NAMES[match.group(2)]}.weight"
    raise ValueError(
        f"GGUF import: unknown tensor {gguf_name!r} for architecture {ARCHITECTURE!r} ({num_layers} blocks)"
    )


def from_gguf_values(hf_name: str, array: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's storage of Gemma norms as ``1 + w`` (every ``*norm.weight``, q/k norms included)."""
    return array if keeps_values(hf_name) else array - np.float32(1.0)


def keeps_values(hf_name: str) -> bool:
    """True when ``from_gguf_values`` leaves the tensor's values as stored (all but the norms), so its
    quantized blocks can be repacked as they are."""
    return not hf_name.endswith("norm.weight")


def gemma3_text_config(metadata: Mapping[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """A transformers ``config.json`` (``gemma3_text``) from the GGUF metadata plus llama.cpp's fixed values.

    Written in the released checkpoints' spelling (``rope_theta``, ``rope_local_base_freq``,
    ``rope_scaling``), which transformers 5, older transformers and mlx-lm all read.
    """
    key = lambda name: f"{ARCHITECTURE}.{name}"  # noqa: E731
    get = lambda name: _required(metadata, key(name))  # noqa: E731
    layers = int(get("block_count"))
    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length"))
    if int(metadata.get(key("attention.value_length"), head_dim)) != head_dim:
        raise ValueError(
            f"GGUF import: {key('attention.value_length')} = {metadata[key('attention.value_length')]} differs from "
            f"{key('attention.key_length')} = {head_dim}; Gemma 3 has one head_dim"
        )
    layer_types, pattern = _layer_types(metadata.get(key("attention.sliding_window_pattern")), layers)
    config: dict[str, Any] = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_value(get("rope.freq_base")),
        "rope_local_base_freq": _f32_value(metadata.get(key("rope.freq_base_swa"), ROPE_LOCAL_BASE_FREQ)),
        "rope_scaling": _rope_scaling(metadata),
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if layers == _27B_LAYERS else head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": _optional_f32(metadata, key("final_logit_softcapping")),
        "attn_logit_softcapping": _optional_f32(metadata, key("attn_logit_softcapping")),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "bos_token_id": int(metadata.get("tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": int(metadata.get("tokenizer.ggml.eos_token_id", 1)),
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", 0)),
    }
    if pattern is not None:
        config["sliding_window_pattern"] = pattern
    return config


def _layer_types(recorded, layers: int) -> tuple[list[str], int | None]:
    """Per-layer attention kinds and, when they follow one, the period (for readers that only know the period).

    Newer llama.cpp files may record ``attention.sliding_window_pattern`` as one bool per layer
    (True = sliding) or as a period; Gemma 3 files made before that use llama.cpp's fixed period 6.
    """
    if isinstance(recorded, list):
        if len(recorded) != layers:
            raise ValueError(
                f"GGUF import: {ARCHITECTURE}.attention.sliding_window_pattern has {len(recorded)} entries for {layers} blocks"
            )
        return ["sliding_attention" if sliding else "full_attention" for sliding in recorded], None
    pattern = SLIDING_WINDOW_PATTERN if recorded is None else int(recorded)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)], pattern


def _rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get(f"{ARCHITECTURE}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(
            f"GGUF import: {ARCHITECTURE}.rope.scaling.type {kind!r} is not supported (Gemma 3 uses 'linear')"
        )
    return {"rope_type": "linear", "factor": _f32_value(_required(metadata, f"{ARCHITECTURE}.rope.scaling.factor"))}


def _required(metadata: Mapping[str, Any], key: str):
    if key not in metadata:
        raise ValueError(f"GGUF import: the file has no {key}")
    return metadata[key]


def _optional_f32(metadata: Mapping[str, Any], key: str) -> float | None:
    return _f32_value(metadata[key]) if key in metadata else None


def _f32_value(value) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores 1e-6 as 9.99999997e-07)."""
    return float(str(np.float32(value)))


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The released Gemma 3 ``generation_config.json``: stop at ``<eos>`` and at ``<end_of_turn>``
    (the chat turn's end), and sample with top-k 64 / top-p 0.95."""
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    eos = int(metadata.get("tokenizer.ggml.eos_token_id", 1))
    stops = [eos] + [i for i, token in enumerate(tokens) if token == END_OF_TURN and i != eos]
    return {
        "bos_token_id": int(metadata.get("tokenizer.ggml.bos_token_id", 2)),
        "eos_token_id": stops,
        "pad_token_id": int(metadata.get("tokenizer.ggml.padding_token_id", 0)),
        "do_sample": True,
        "top_k": 64,
        "top_p": 0.95,
    }
