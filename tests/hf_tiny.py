"""Tiny random Gemma 4 checkpoints written by transformers, for parity tests against the reference.

The configs T1-T5 together cover every branch of transformers' ``Gemma4TextConfig`` (sliding and
full geometry, KV sharing, per-layer inputs, MoE, K=V, bidirectional modes), plus extra variants. Each builder seeds torch, builds the transformers model,
``save_pretrained``s it into a directory and returns the model in eval mode, so a test can load the
files into our graph and compare logits with the model that wrote them. Import this module only
from tests that have already done ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    sliding_window=4,
    max_position_embeddings=512,
    initializer_range=0.15,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
S, F = "sliding_attention", "full_attention"

TEXT_CONFIGS = {
    # sliding + full, head_dim 32/64, default + proportional RoPE
    "T1": dict(BASE, layer_types=[S, S, F, F], hidden_size_per_layer_input=0, final_logit_softcapping=None),
    # PLE, KV sharing (layers 2, 3 reuse 0, 1), double-wide MLP on the reuse layers, softcap
    "T2": dict(
        BASE,
        layer_types=[S, F, S, F],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
    ),
    # MoE beside the dense MLP, K=V on the full layer, global kv heads 2 -> 1
    "T3": dict(
        BASE,
        layer_types=[S, S, S, F],
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        num_key_value_heads=2,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
        final_logit_softcapping=30.0,
    ),
    # every mask bidirectional; the window becomes |q - k| <= 4//2 + 1
    "T4": dict(BASE, num_hidden_layers=2, layer_types=[S, F], hidden_size_per_layer_input=0, use_bidirectional_attention="all"),
}
# The window never binds over the test sequences.
TEXT_CONFIGS["T2_wide_window"] = dict(TEXT_CONFIGS["T2"], sliding_window=64)
# num_global_key_value_heads must be ignored without attention_k_eq_v: full layers keep 2 kv heads.
TEXT_CONFIGS["T3_no_k_eq_v"] = dict(TEXT_CONFIGS["T3"], attention_k_eq_v=False)
# Attention biases and a separate LM head: off in the releases, supported by the reference.
TEXT_CONFIGS["T1_bias_untied"] = dict(TEXT_CONFIGS["T1"], attention_bias=True, tie_word_embeddings=False)
# E2B's shape in small: default layer pattern (S S S S S F S F), the last two layers reuse 4 and 5.
TEXT_CONFIGS["E2B_like"] = dict(
    TEXT_CONFIGS["T2"], num_hidden_layers=8, layer_types=None, num_kv_shared_layers=2, sliding_window=8
)

T5_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    sliding_window=4,
    layer_types=[S, S, S, F],
    hidden_size_per_layer_input=16,
    vocab_size_per_layer_input=512,
    use_bidirectional_attention="vision",
    final_logit_softcapping=30.0,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
T5_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    patch_size=16,
    pooling_kernel_size=3,
    position_embedding_size=64,
    rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
)
T5_TOKENS = dict(
    boi_token_id=300,
    eoi_token_id=302,
    image_token_id=301,
    video_token_id=303,
    audio_token_id=304,
    boa_token_id=305,
    eoa_token_index=306,
)


def save_causal_lm(text_config: dict, directory: Path, *, seed: int = 0, dtype=None, max_shard_size=None):
    """``Gemma4ForCausalLM(Gemma4TextConfig(**text_config))`` with seeded weights, saved to ``directory``.

    ``dtype`` (a torch dtype) converts the model before saving; ``max_shard_size`` produces shards.
    """
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text_config)).eval()
    if dtype is not None:
        model = model.to(dtype)
    _save(model, directory, max_shard_size)
    return model


def load_causal_lm(name: str, directory: Path):
    """The ``TEXT_CONFIGS[name]`` checkpoint saved to ``directory`` by transformers, loaded by the zoo."""
    import models

    save_causal_lm(TEXT_CONFIGS[name], directory)
    return models.load(str(directory), tokenizer=False)


def save_conditional_generation(directory: Path, *, seed: int = 0):
    """T5: ``Gemma4ForConditionalGeneration`` with a vision tower and no audio, saved to ``directory``."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma4Config(text_config=T5_TEXT, vision_config=T5_VISION, audio_config=None, **T5_TOKENS)
    model = Gemma4ForConditionalGeneration(config).eval()
    _save(model, directory, None)
    return model


def reload_causal_lm(directory: Path, dtype):
    """The saved checkpoint as transformers loads it in ``dtype`` (rotary frequencies stay float32,
    unlike a model converted with ``.to(dtype)``)."""
    from transformers import Gemma4ForCausalLM

    return Gemma4ForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def _save(model, directory: Path, max_shard_size) -> None:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def read_safetensors(directory: Path) -> dict[str, mx.array]:
    """Every tensor of every ``*.safetensors`` file in ``directory`` (shards merged), via ``mx.load``."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    weights: dict[str, mx.array] = {}
    for path in files:
        weights.update(mx.load(str(path)))
    return weights


def float64_logits(hf_model, ids) -> np.ndarray:
    """The reference's logits computed in float64 (a copy of the model; eager experts, as grouped_mm has no float64)."""
    import copy

    import torch

    reference = copy.deepcopy(hf_model).double()
    reference.config._experts_implementation = "eager"
    with torch.no_grad():
        return reference(torch.as_tensor(ids)).logits.numpy()


def load_graph(directory: Path):
    """Our ``Gemma4TextModel`` built from ``directory``'s config.json and loaded from its safetensors."""
    from graphs import Gemma4TextModel
    from graphs.gemma4_text_config import Gemma4TextConfig
    from models.registry import load_gemma4_text_weights

    model = Gemma4TextModel(Gemma4TextConfig.from_dict(read_config(directory)))
    load_gemma4_text_weights(model, read_safetensors(directory))
    return model
