"""Tiny random Gemma 4 checkpoints with an audio tower (and the T5 vision tower), saved by transformers.

For the audio and video parity tests: ``save_media_model`` writes a ``Gemma4ForConditionalGeneration``
whose text part is T5-shaped (``tests.hf_tiny``) and whose audio tower is 2 Conformer blocks of
width 32 (the subsampling keeps the released 128 channels in its first convolution: the
reference sizes its projection from them). Weights are randomized with clip bounds that bite and
norms well below 1 (``randomize_audio``). ``hf_inputs`` builds what transformers' processor would
hand the model for a ``Prompt`` of ours: padded image, video and audio tensors and
``mm_token_type_ids``. Import only after ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import numpy as np

from tests.hf_tiny import T5_TOKENS, T5_VISION

AUDIO_CONFIG = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    subsampling_conv_channels=[128, 8],
    conv_kernel_size=5,
    output_proj_dims=24,
)
IMAGE, VIDEO, AUDIO = T5_TOKENS["image_token_id"], T5_TOKENS["video_token_id"], T5_TOKENS["audio_token_id"]


def randomize_audio(module, seed: int) -> None:
    """Seeded values for every audio parameter and buffer: clip bounds at ±(2..3), norms about 0.5,
    projections of unit gain, ``per_dim_scale`` around 0 (softplus about 0.7)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("inv_timescales", "softcap"):
                continue
            if leaf in ("input_min", "output_min", "input_max", "output_max"):
                magnitude = 2.0 + float(torch.rand((), generator=generator))
                tensor.fill_(-magnitude if leaf.endswith("min") else magnitude)
            elif "norm" in name:
                tensor.copy_(0.5 + 0.15 * torch.randn(tensor.shape, generator=generator))
            elif leaf == "per_dim_scale":
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            else:
                fan = {4: lambda t: t.shape[1] * 9, 3: lambda t: t.shape[-1], 2: lambda t: t.shape[-1]}.get(tensor.ndim, lambda t: 1)(tensor)
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / max(fan, 1) ** 0.5)


def save_media_model(directory, text_config: dict, seed: int = 0, audio: bool = True):
    """A random ``Gemma4ForConditionalGeneration`` with vision and (unless ``audio=False``) audio towers, saved."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from tests.test_gemma4_vision_parity import randomize

    torch.manual_seed(seed)
    config = Gemma4Config(text_config=text_config, vision_config=T5_VISION, audio_config=AUDIO_CONFIG if audio else None,
                          initializer_range=0.15, **T5_TOKENS)  # fmt: skip
    reference = Gemma4ForConditionalGeneration(config).eval()
    randomize(reference.model.vision_tower, seed=seed + 2)
    randomize(reference.model.embed_vision, seed=seed + 3)
    if audio:
        randomize_audio(reference.model.audio_tower, seed=seed + 4)
        randomize_audio(reference.model.embed_audio, seed=seed + 5)
    reference.save_pretrained(directory)
    return reference


def synthetic_clip(seconds: float, rate: int = 16_000, seed: int = 0) -> np.ndarray:
    """A chirp with noise and an envelope, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    chirp = np.sin(2 * np.pi * (200 + 900 * t) * t) * (0.5 + 0.4 * np.sin(2 * np.pi * 1.3 * t))
    return (0.6 * chirp + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def hf_inputs(prompt_ids, *, images=(), image_budget=70, audio=(), videos=(), bidirectional_types=None) -> dict:
    """transformers' model inputs for our expanded ids: padded media tensors and ``mm_token_type_ids``.

    ``images``: PIL images (processed by transformers' PIL image processor); ``audio``: 16 kHz
    float32 clips (its feature extractor); ``videos``: our ``ProcessedVideo`` s, padded to the
    budget's patch count as the reference video processor pads them. ``bidirectional_types``
    overrides the type ids (to show that the audio rule matters).
    """
    import torch
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    ids = torch.tensor([list(prompt_ids)])
    types = torch.zeros_like(ids)
    types[ids == IMAGE] = 1
    types[ids == VIDEO] = 2
    types[ids == AUDIO] = 3 if bidirectional_types is None else bidirectional_types
    out = {"input_ids": ids, "mm_token_type_ids": types}
    if images:
        batch = Gemma4ImageProcessorPil(max_soft_tokens=image_budget)(images=list(images), return_tensors="pt")
        out.update(pixel_values=batch["pixel_values"], image_position_ids=batch["image_position_ids"])
    if audio:
        batch = Gemma4AudioFeatureExtractor()(list(audio), return_tensors="pt")
        out.update(input_features=batch["input_features"], input_features_mask=batch["input_features_mask"])
    if videos:
        pixels, positions, counts = [], [], []
        for video in videos:
            budget_patches = video.num_soft_tokens * 9 if video.num_soft_tokens * 9 >= video.patches.shape[1] else video.patches.shape[1]
            budget_patches = max(budget_patches, 70 * 9)
            pad = budget_patches - video.patches.shape[1]
            pixels.append(np.pad(video.patches, ((0, 0), (0, pad), (0, 0))))
            pos = np.broadcast_to(video.position_ids, (video.num_frames, *video.position_ids.shape))
            positions.append(np.pad(pos, ((0, 0), (0, pad), (0, 0)), constant_values=-1))
            counts.append(video.num_frames)
        out.update(
            pixel_values_videos=torch.from_numpy(np.concatenate(pixels)),
            video_position_ids=torch.from_numpy(np.concatenate(positions)).long(),
            num_frames_per_video=torch.tensor(counts),
        )
    return out
