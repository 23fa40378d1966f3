"""Tiny random Gemma 4 unified checkpoints saved by transformers, and the reference's inputs for our prompts.

``save_unified_model`` writes a ``Gemma4UnifiedForConditionalGeneration`` whose text part is
T5-shaped (``tests.hf_tiny``, without per-layer inputs, which the unified decoder does not have,
and with K=V on its full layer as the 12B), with a 48-wide vision embedder (the released merged
patch of 6912 values) and the released 640-sample audio embedder. The embedders' weights are
seeded random values, norms about 0.5 (``randomize``). ``hf_inputs`` builds what
transformers' processor would hand the model for a ``Prompt`` of ours: padded patch tensors with
``(-1, -1)`` positions, waveform frames from its own feature extractor, ``mm_token_type_ids``.
``reference_patches`` is the reference image processor's steps on a PIL image. Import only
after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import importlib
import math
import sys
import types

import numpy as np

from tests.hf_tiny import T5_TEXT, T5_TOKENS

UNIFIED_TEXT = {k: v for k, v in T5_TEXT.items() if k not in ("hidden_size_per_layer_input", "vocab_size_per_layer_input")}
UNIFIED_TEXT.update(attention_k_eq_v=True, num_global_key_value_heads=1, num_key_value_heads=2, initializer_range=0.15)
UNIFIED_VISION = dict(patch_size=16, pooling_kernel_size=3, mm_embed_dim=48, mm_posemb_size=64, output_proj_dims=48)
UNIFIED_AUDIO = dict(audio_embed_dim=640)
IMAGE, VIDEO, AUDIO = T5_TOKENS["image_token_id"], T5_TOKENS["video_token_id"], T5_TOKENS["audio_token_id"]


def randomize(model, seed: int) -> None:
    """Seeded values for the decoder's norm weights (about 0.5) and every vision and audio embedder
    parameter: LayerNorm weights about 0.5 and biases about 0.1, projections of unit gain, position
    rows about 0.3."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    parts = [model.model.embed_vision, model.model.embed_audio]
    with torch.no_grad():
        for name, tensor in model.model.language_model.named_parameters():
            if "norm" in name:  # the decoder's RMSNorm weights (ones by default)
                tensor.copy_(0.5 + 0.1 * torch.randn(tensor.shape, generator=generator))
        for part in parts:
            if part is None:
                continue
            for name, tensor in part.named_parameters():
                noise = torch.randn(tensor.shape, generator=generator)
                if "_ln" in name or "pos_norm" in name:
                    tensor.copy_(0.5 + 0.15 * noise if name.endswith("weight") else 0.1 * noise)
                elif name == "pos_embedding":
                    tensor.copy_(0.3 * noise)
                else:
                    tensor.copy_(noise / math.sqrt(tensor.shape[-1]) if tensor.ndim == 2 else 0.1 * noise)


def save_unified_model(directory, text_config: dict = UNIFIED_TEXT, seed: int = 0, vision: bool = True, audio: bool = True):
    """A random ``Gemma4UnifiedForConditionalGeneration``, saved to ``directory``; returns it in eval mode."""
    import torch
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    torch.manual_seed(seed)
    config = Gemma4UnifiedConfig(text_config=text_config, vision_config=UNIFIED_VISION if vision else None,
                                 audio_config=UNIFIED_AUDIO if audio else None, **T5_TOKENS)  # fmt: skip
    reference = Gemma4UnifiedForConditionalGeneration(config).eval()
    randomize(reference, seed + 1)
    reference.save_pretrained(directory)
    return reference


def _padded(patches: list[np.ndarray], positions: list[np.ndarray]):
    import torch

    rows = max(p.shape[0] for p in patches)
    pixels = np.stack([np.pad(p, ((0, rows - p.shape[0]), (0, 0))) for p in patches])
    where = np.stack([np.pad(q, ((0, rows - q.shape[0]), (0, 0)), constant_values=-1) for q in positions])
    return torch.from_numpy(pixels), torch.from_numpy(where.astype(np.int64))


def hf_inputs(prompt_ids, *, images=(), audio=(), videos=(), with_types=True) -> dict:
    """transformers' inputs for our expanded ids: ``images`` are our ``ProcessedImage`` s, ``audio``
    16 kHz float32 clips (the reference's feature extractor frames them), ``videos`` our
    ``ProcessedVideo`` s; ``with_types=False`` leaves ``mm_token_type_ids`` out (no overlay)."""
    import torch
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import Gemma4UnifiedAudioFeatureExtractor

    ids = torch.tensor([list(prompt_ids)])
    out = {"input_ids": ids}
    if with_types:
        kinds = torch.zeros_like(ids)
        kinds[ids == IMAGE], kinds[ids == VIDEO], kinds[ids == AUDIO] = 1, 2, 3
        out["mm_token_type_ids"] = kinds
    if images:
        pixels, positions = _padded([i.patches for i in images], [i.position_ids for i in images])
        out.update(pixel_values=pixels, image_position_ids=positions)
    if audio:
        batch = Gemma4UnifiedAudioFeatureExtractor()(list(audio), return_tensors="pt")
        out.update(input_features=batch["input_features"], input_features_mask=batch["input_features_mask"])
    if videos:
        frames = [(f, v.position_ids) for v in videos for f in v.patches]
        pixels, positions = _padded([f for f, _ in frames], [q for _, q in frames])
        out.update(pixel_values_videos=pixels, video_position_ids=positions, num_frames_per_video=torch.tensor([v.num_frames for v in videos]))
    return out


def unified_image_module():
    """transformers' ``image_processing_gemma4_unified`` for its pure torch functions (``patches_merge``,
    ``convert_image_to_patches``, ``get_aspect_ratio_preserving_size``).

    The module imports torchvision at the top, for the resize of its processor class. torchvision's
    PyPI wheel is built against CUDA torch and does not load beside the CPU torch installed here, so
    a placeholder stands in for that one import and is removed again; nothing of torchvision is run.
    """
    name = "transformers.models.gemma4_unified.image_processing_gemma4_unified"
    if name in sys.modules:
        return sys.modules[name]
    placeholders = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    added = [p for p in placeholders if p not in sys.modules]
    for p in added:
        sys.modules[p] = types.ModuleType(p)
    sys.modules["torchvision.transforms.v2"].functional = sys.modules["torchvision.transforms.v2.functional"]
    sys.modules["torchvision.transforms.v2.functional"].InterpolationMode = None
    try:
        return importlib.import_module(name)
    finally:
        for p in added:
            del sys.modules[p]


def reference_patches(image, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference image processor's steps on a PIL image: (merged patches, positions), unpadded.

    ``convert_to_rgb`` and ``get_aspect_ratio_preserving_size`` and ``patches_merge`` are
    transformers' own; the resize is what torchvision's ``resize`` runs for a CPU uint8 tensor
    (torch's antialiased bicubic ``interpolate``); the rescale is the backend's ``image * (1/255)``.
    """
    import torch
    from transformers.image_transforms import convert_to_rgb

    module = unified_image_module()
    pixels = torch.from_numpy(convert_to_rgb(image, return_numpy=True)).permute(2, 0, 1).contiguous()
    height, width = module.get_aspect_ratio_preserving_size(pixels.shape[-2], pixels.shape[-1], 16, budget * 9, 3)
    if (height, width) != tuple(pixels.shape[-2:]):
        pixels = torch.nn.functional.interpolate(pixels[None], size=[height, width], mode="bicubic", antialias=True, align_corners=False)[0]
    pixels = pixels * (1 / 255)
    teacher = module.convert_image_to_patches(pixels, 16)
    grid = torch.stack(torch.meshgrid(torch.arange(width // 16), torch.arange(height // 16), indexing="xy"), dim=-1).reshape(-1, 2)
    merged, positions = module.patches_merge(teacher[None], grid[None], teacher.shape[0] // 9)
    return merged[0].numpy(), positions[0].numpy()


def save_unified_assistant(directory, target: dict = UNIFIED_TEXT, seed: int = 1):
    """A random ``Gemma4UnifiedAssistantForCausalLM`` for a target of ``target`` (its text config), saved;
    with the centroid head and a random token ordering (``tests.assistant_tiny``), and the kv heads
    of the target's layers (the reference groups its query heads by them)."""
    import torch
    from transformers import Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM

    from tests.assistant_tiny import assistant_text_config

    heads = {k: target[k] for k in ("num_key_value_heads", "attention_k_eq_v", "num_global_key_value_heads") if k in target}
    text = {k: v for k, v in assistant_text_config(target, **heads).items() if "per_layer_input" not in k}
    config = Gemma4UnifiedAssistantConfig(text_config=dict(text, model_type="gemma4_unified_text"), backbone_hidden_size=target["hidden_size"],
                                          use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)  # fmt: skip
    torch.manual_seed(seed)
    model = Gemma4UnifiedAssistantForCausalLM(config).eval()
    with torch.no_grad():
        model.masked_embedding.token_ordering.copy_(torch.randperm(target["vocab_size"]))
    model.save_pretrained(directory)
    return model
