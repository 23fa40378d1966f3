"""Turning user inputs into what the graphs read: images, audio, video, and the checkpoint's settings."""

from __future__ import annotations

import importlib
from types import ModuleType

# The FFmpeg demuxers PyAV may open: containers that hold their media themselves. Playlists and
# other formats that name further files or URLs (hls, dash, concat, image sequences, ...) are never
# chosen, whatever a file's name or first bytes say, so a decoder reads nothing but the file it was
# given (an m3u8 playlist would make FFmpeg decode the local files it lists).
AUDIO_DEMUXERS = ("wav", "mp3", "flac", "ogg", "mov", "matroska", "aac", "aiff")
VIDEO_DEMUXERS = ("mov", "matroska", "avi", "mpegts", "ogg")


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


def open_container(source, purpose: str, demuxers: tuple[str, ...], demuxer: str | None = None):
    """A PyAV input container for ``source`` (a path or a binary file object) that only one of
    ``demuxers`` may read (FFmpeg's ``format_whitelist``), or exactly ``demuxer`` when given. A file
    that no allowed demuxer reads raises PyAV's error (``av.error.FFmpegError``)."""
    av = media_module("av", purpose)
    allowed = demuxers if demuxer is None else (demuxer,)
    return av.open(source, format=demuxer, container_options={"format_whitelist": ",".join(allowed)})
