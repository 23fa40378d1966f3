"""Tiny random DiffusionGemma checkpoints written by transformers, and transformers' side of the tests.

The configs are T7 (every DiffusionGemma branch: MoE, K=V full layers, vision) and variants. Each builder seeds torch, builds
``DiffusionGemmaForBlockDiffusion``, gives every norm, scalar and vision weight seeded random values
(the default init leaves them at constants, which would hide mistakes; the encoder's and the
decoder's ``layer_scalar`` get different values, so mixing them up shows), ``save_pretrained``s it
and returns it in eval mode. ``record_torch_draws`` captures transformers' random canvases and
samples during ``generate``; ``ReplayNoise`` feeds them to our loop, so both runs make the same
random choices. Import this module only from tests that have already done
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

S, F = "sliding_attention", "full_attention"
T7_TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    global_head_dim=64,
    num_global_key_value_heads=1,
    sliding_window=4,
    layer_types=[S, S, S, F],
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    use_bidirectional_attention="vision",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    initializer_range=0.15,
)
T7_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, patch_size=16, pooling_kernel_size=3, position_embedding_size=64)  # fmt: skip
T7_TOKENS = dict(canvas_length=8, boi_token_id=250, eoi_token_id=252, image_token_id=251)

CONFIGS = {
    "T7": T7_TEXT,
    # the window rarely binds: prompts shorter and longer than it
    "T7_wide": dict(T7_TEXT, sliding_window=16),
    # GQA on sliding layers (4 heads over 2), global kv heads 2 -> 1 on the K=V full layers
    "T7_gqa": dict(T7_TEXT, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1),
    # no image overlay: the encoder is plain causal over image tokens too
    "T7_no_overlay": dict(T7_TEXT, use_bidirectional_attention=None),
    # the default layer pattern (5 sliding : 1 full), two full layers
    "T7_pattern": dict(T7_TEXT, num_hidden_layers=7, layer_types=None),
}


def save_diffusion(name: str, directory: Path, *, seed: int = 0, sharpness: float = 1.0, residual: float = 1.0,
                   canvas_length: int = 8):  # fmt: skip
    """``DiffusionGemmaForBlockDiffusion`` for ``CONFIGS[name]`` with random norms, scalars and vision weights.

    Random tiny models predict nearly uniform tokens (entropy about log V), so only the
    lowest-entropy position is ever accepted, and their argmax follows the noisy canvas, so no
    draft is ever stable. ``sharpness`` multiplies the final norm's weight (peaked predictions:
    several positions accepted per step); ``residual`` scales what each layer adds to the residual
    stream, so that a canvas of accepted tokens tends to predict itself and denoising converges
    (early stops happen).
    """
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    torch.manual_seed(seed)
    config = DiffusionGemmaConfig(text_config=CONFIGS[name], vision_config=T7_VISION, **dict(T7_TOKENS, canvas_length=canvas_length))
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    _randomize_text(model.model, generator, sharpness, residual)
    _randomize_vision(model.model.encoder.vision_tower, generator)
    _randomize_vision(model.model.encoder.embed_vision, generator)
    model.save_pretrained(directory)
    return model


def _randomize_text(model, generator, sharpness: float, residual: float) -> None:
    def rand(t, low, high):
        return low + (high - low) * torch.rand(t.shape, generator=generator)

    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "vision" in name or "inv_freq" in name or name.endswith("embed_scale"):
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "layer_scalar":  # encoder and decoder buffers are separate: each its own values
                tensor.copy_(rand(tensor, 0.6, 1.4))
            elif leaf == "per_expert_scale":
                tensor.copy_(rand(tensor, 0.5, 1.5))
            elif "norm" in name or leaf == "scale":
                tensor.copy_(1.0 + 0.3 * torch.randn(tensor.shape, generator=generator))
        model.decoder.norm.weight.mul_(sharpness)
        for layer in model.decoder.layers:  # tied: the encoder's layers are the same parameters
            layer.post_attention_layernorm.weight.mul_(residual)
            layer.post_feedforward_layernorm.weight.mul_(residual)


def _randomize_vision(module, generator) -> None:
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if "inv_freq" in name:
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if "norm" in name:
                tensor.copy_(0.7 + 0.2 * noise)
            elif "position_embedding_table" in name:
                tensor.copy_(0.3 * noise)
            else:
                tensor.copy_(noise / math.sqrt(tensor.shape[-1]))


def read_config(directory: Path) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def load_ours(directory: Path):
    """Our ``DiffusionGemmaModel`` from ``directory``'s config.json and safetensors."""
    from graphs.diffusion_gemma import DiffusionGemmaModel
    from graphs.diffusion_gemma_config import DiffusionGemmaConfig
    from tests.hf_tiny import read_safetensors
    from models.registry import load_diffusion_gemma_weights

    model = DiffusionGemmaModel(DiffusionGemmaConfig.from_dict(read_config(directory)))
    load_diffusion_gemma_weights(model, read_safetensors(directory))
    return model


# ------------------------------------------------------------------------------ transformers' side
def hf_image_inputs(images, budget: int = 70) -> dict:
    """transformers' processor output for ``images`` (padded batch)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    batch = Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=images, return_tensors="pt")
    return {"pixel_values": batch["pixel_values"], "image_position_ids": batch["image_position_ids"]}


def hf_encode(hf, ids: np.ndarray, cache, *, start: int = 0, image_inputs: dict | None = None):
    """What ``generate`` does at step 1.a: the encoder over ``ids`` at positions ``start ..``, with the
    vision overlay when images are given. Returns the (updated) ``DynamicCache``."""
    from transformers import DynamicCache

    cache = cache if cache is not None else DynamicCache(config=hf.config.get_text_config(decoder=True))
    ids_t = torch.as_tensor(ids)
    B, L = ids_t.shape
    positions = torch.arange(start, start + L)[None]
    extra = {}
    if image_inputs:
        extra = dict(image_inputs, mm_token_type_ids=(ids_t == hf.config.image_token_id).long())
    with torch.no_grad():
        masks = hf.model.encoder.create_masks_for_generate(
            config=hf.config, inputs_embeds=torch.empty(B, L, 0), attention_mask=torch.ones(B, start + L, dtype=torch.bool),
            cache=cache, position_ids=positions, mm_token_type_ids=extra.get("mm_token_type_ids"),
        )  # fmt: skip
        hf.model.encoder(input_ids=ids_t, attention_mask=masks, cache=cache, position_ids=positions,
                         **{k: v for k, v in extra.items() if k != "mm_token_type_ids"})  # fmt: skip
    return cache


def hf_decode(hf, canvas: np.ndarray, cache, start: int, self_conditioning: np.ndarray | None = None) -> np.ndarray:
    """The decoder's float32 logits for ``canvas`` at positions ``start ..`` over ``cache``."""
    sc = None if self_conditioning is None else torch.as_tensor(self_conditioning)
    with torch.no_grad():
        out = hf(decoder_input_ids=torch.as_tensor(canvas), cache=cache, self_conditioning_logits=sc,
                 decoder_position_ids=torch.arange(start, start + canvas.shape[1])[None])  # fmt: skip
    return out.logits.numpy()


@contextmanager
def one_torch_thread():
    """transformers on these tiny models is about ten times faster on one thread (tiny matmuls)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def record_torch_draws():
    """Capture every ``torch.randint`` (canvases, re-noising) and ``torch.multinomial`` (samples) result."""
    record = {"canvas": [], "sample": []}
    randint, multinomial = torch.randint, torch.multinomial

    def recording_randint(*args, **kwargs):
        out = randint(*args, **kwargs)
        record["canvas"].append(out.numpy().copy())
        return out

    def recording_multinomial(*args, **kwargs):
        out = multinomial(*args, **kwargs)
        record["sample"].append(out.numpy().copy())
        return out

    torch.randint, torch.multinomial = recording_randint, recording_multinomial
    try:
        yield record
    finally:
        torch.randint, torch.multinomial = randint, multinomial


class ReplayNoise:
    """Our loop's ``Noise``, answering with transformers' recorded draws in order."""

    seed = None

    def __init__(self, record: dict):
        self.canvases = list(record["canvas"])
        self.samples = list(record["sample"])

    def canvas(self, shape, vocab_size):
        drawn = self.canvases.pop(0)
        assert drawn.shape == tuple(shape), (drawn.shape, shape)
        return mx.array(drawn.astype(np.int32))

    def sample(self, logits):
        B, C, _ = logits.shape
        return mx.array(self.samples.pop(0).reshape(B, C).astype(np.int32))

    @property
    def exhausted(self) -> bool:
        return not self.canvases and not self.samples
