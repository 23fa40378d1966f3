"""Zoo names: short names for models that install from the package registries, no Hub needed."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Callable

from weights.quantize import QuantizationPolicy


def _gemma3_270m(packed: bool = False) -> Path:
    from models.assets.gemma3_270m import gemma3_270m_folder

    return gemma3_270m_folder(packed=packed)


def _embeddinggemma_300m() -> Path:
    from models.assets.embeddinggemma import embeddinggemma_folder

    return embeddinggemma_folder()


def _gemma3_270m_quantized(bits: int) -> Path:
    """The 270M quantized once by ``models.convert`` under ``QUANTIZED_270M[bits]`` from the float32
    folder into the assets cache (written beside it and renamed into place, so the folder is
    complete or absent). The folder's name spells the whole policy: a changed policy is a new folder."""
    from models.assets.fetch import assets_dir
    from models.assets.gemma3_270m import FORMAT_VERSION, gemma3_270m_folder

    out = assets_dir() / f"gemma-3-270m-{policy_name(QUANTIZED_270M[bits])}-v{FORMAT_VERSION}"
    if (out / "config.json").is_file():
        return out
    from models.convert import convert

    source = gemma3_270m_folder()
    print(f"Quantizing Gemma 3 270M to {bits} bits into {out} (once)...", file=sys.stderr)
    convert(str(source), out, q_policy=QUANTIZED_270M[bits])
    return out


def policy_name(policy: QuantizationPolicy) -> str:
    """``4bit-g32-e8g64-f16``: layer bits and group, embedding bits and group, scale dtype."""
    embed = policy.embed_params
    scales = {None: "", "float32": "-f32", "float16": "-f16", "bfloat16": "-bf16"}[policy.scale_dtype]
    return f"{policy.bits}bit-g{policy.group_size}-e{embed.bits}g{embed.group_size}{scales}"


# The zoo's quantized 270M, chosen by speed and quality (docs/quantization.md): float16 scales (half
# of float32's bytes, the same KL); the 4-bit one keeps an 8-bit embedding and tied head, as
# llama.cpp's Q4_K_M file keeps its Q8_0 one (a 4-bit head reads 73 MB less a token but costs 0.3
# nats of KL on this model).
QUANTIZED_270M = {
    8: QuantizationPolicy(8, 64, scale_dtype="float16"),
    4: QuantizationPolicy(4, 32, embed_bits=8, embed_group_size=64, scale_dtype="float16"),
}

# name -> a function returning the model's local folder (fetched, assembled or converted on first use)
ZOO: dict[str, Callable[[], Path]] = {
    "gemma-3-270m": _gemma3_270m,
    # Quantized from it (docs/quantization.md has their quality, docs/speed.md their speed).
    "gemma-3-270m-8bit": partial(_gemma3_270m_quantized, 8),
    "gemma-3-270m-4bit": partial(_gemma3_270m_quantized, 4),
    # The llama.cpp file's own grid, packed: its Q8_0 / Q5_0 / Q4_K blocks as they are, Q6_K at 8 bits.
    "gemma-3-270m-q4km": partial(_gemma3_270m, packed=True),
    # Google's EmbeddingGemma 300M Hub folder, from chunk packages (models.assets.embeddinggemma).
    "embeddinggemma-300m": _embeddinggemma_300m,
}


def zoo_folder(name: str) -> Path | None:
    """The folder of a zoo model, or None when ``name`` is not a zoo name."""
    make = ZOO.get(name)
    return None if make is None else make()
