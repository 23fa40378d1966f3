"""Turning user inputs into what the graphs read: images, audio, video, and the checkpoint's settings."""

from __future__ import annotations

import importlib
from types import ModuleType


class MediaLibraryMissingError(ImportError):
    """A decoding library of the ``media`` extra (soundfile, soxr, PyAV) is not installed."""


def media_module(name: str, purpose: str) -> ModuleType:
    """Import ``name`` (a library of the ``media`` extra), or raise ``MediaLibraryMissingError`` saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise MediaLibraryMissingError(
            f"{purpose} needs the Python package {name!r}, which is not installed: "
            f'pip install -e ".[media]" (or pip install soundfile soxr av)'
        ) from err
