"""The media parts of a chat message: where their bytes may come from, and opening them.

An ``image_url`` (or ``video_url``) is a ``data:`` URL, a local path (``file://`` or bare) that the
server was started to allow (``--allowed-media-dir``: every path is resolved, symlinks included,
and must lie inside one of those folders), or an ``http(s)`` URL when the server allows network
fetches (``--allow-network-media``; off by default, so a request never makes the server reach
out). ``input_audio`` carries base64 data in one of ``AUDIO_FORMATS`` (the schema refuses any
other), decoded with exactly that format's demuxer. Any other source, a file that is missing, and
bytes that are not an image are a 400 naming the part (``messages[i].content[j]``).

Nothing is decoded while a request's media are read: an image's size comes from its header and is
held to Pillow's decompression-bomb limit (``PIL.Image.MAX_IMAGE_PIXELS``, as for image files), and
the request's parts are held to ``MediaPolicy``'s count and byte budget (encoded bytes, plus each
image's decoded pixels at the 4 bytes Pillow stores an RGB pixel in). The server decodes only then.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from PIL import Image, UnidentifiedImageError

from models.processing.audio import AudioBytes
from models.serving.schemas import APIError


@dataclass(frozen=True)
class MediaPolicy:
    """Where media may be read from. Nothing but ``data:`` URLs unless the server's flags say so."""

    allowed_dirs: tuple[Path, ...] = ()
    allow_network: bool = False
    max_bytes: int = 20 * 2**20  # per part
    network_timeout: float = 10.0
    max_parts: int = 32  # media parts in one request
    max_request_bytes: int = 512 * 2**20  # a request's media: encoded bytes plus decoded image pixels
    _resolved: tuple[Path, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        missing = [str(d) for d in self.allowed_dirs if not Path(d).is_dir()]
        if missing:
            raise ValueError(f"{missing[0]}: not an existing folder")
        object.__setattr__(self, "_resolved", tuple(Path(d).resolve() for d in self.allowed_dirs))

    def read(self, url: str, where: str) -> bytes:
        """The bytes behind ``url`` (a data URL, an allowed path or an allowed http(s) URL)."""
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(url, where)
        if scheme in ("http", "https"):
            return self._fetch(url, where)
        if scheme in ("", "file") or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):  # a Windows drive letter
            return self._file(urllib.parse.unquote(urllib.parse.urlsplit(url).path) if scheme == "file" else url, where)
        raise APIError(400, f"{where}: unsupported URL scheme {scheme!r} (use a data: URL)", where)

    def _data_url(self, url: str, where: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma:
            raise APIError(400, f"{where}: a data URL needs a comma before its payload", where)
        if header.endswith(";base64"):
            return decode_base64(payload, where, self.max_bytes)
        data = urllib.parse.unquote_to_bytes(payload)
        return self._sized(data, where)

    def _file(self, path: str, where: str) -> bytes:
        if not self._resolved:
            raise APIError(400, f"{where}: local files are not allowed (start the server with --allowed-media-dir)", where)
        try:
            resolved = Path(path).resolve(strict=True)
        except (OSError, RuntimeError):
            raise APIError(400, f"{where}: no such file {path!r}", where) from None
        if not any(resolved.is_relative_to(folder) for folder in self._resolved):
            raise APIError(400, f"{where}: {path!r} is outside the allowed media folders", where)
        if not resolved.is_file():
            raise APIError(400, f"{where}: {path!r} is not a file", where)
        if resolved.stat().st_size > self.max_bytes:
            raise APIError(400, f"{where}: {path!r} is larger than {self.max_bytes} bytes", where)
        return resolved.read_bytes()

    def _fetch(self, url: str, where: str) -> bytes:
        if not self.allow_network:
            raise APIError(400, f"{where}: network URLs are not allowed (start the server with --allow-network-media)", where)
        try:
            with urllib.request.urlopen(url, timeout=self.network_timeout) as response:
                data = response.read(self.max_bytes + 1)
        except OSError as err:
            raise APIError(400, f"{where}: could not fetch {url!r}: {err}", where) from None
        return self._sized(data, where)

    def _sized(self, data: bytes, where: str) -> bytes:
        if len(data) > self.max_bytes:
            raise APIError(400, f"{where}: larger than {self.max_bytes} bytes", where)
        return data


def decode_base64(payload: str, where: str, max_bytes: int) -> bytes:
    if len(payload) * 3 // 4 > max_bytes:
        raise APIError(400, f"{where}: larger than {max_bytes} bytes", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the base64 payload does not decode", where) from None


def _opened(data: bytes, where: str, load: bool) -> Image.Image:
    """The image of ``data``, its header read (and its pixels too with ``load``); a 400 when it is
    not one or when its size is over Pillow's limit (which Pillow itself only warns about up to twice it)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if load:
                image.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise APIError(
            400, f"{where}: the image is over Pillow's decompression-bomb limit of {Image.MAX_IMAGE_PIXELS} pixels "
            f"(PIL.Image.MAX_IMAGE_PIXELS, as for image files): {err}", where,
        ) from None  # fmt: skip
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise APIError(400, f"{where}: not a readable image ({err})", where) from None
    return image


def open_image(data: bytes, where: str) -> Image.Image:
    """The decoded image (fully loaded, so a truncated file fails here); a 400 when it is not one."""
    return _opened(data, where, load=True)


@dataclass(frozen=True)
class EncodedImage:
    """An image part as read, not decoded: its bytes, its part and its size from the header."""

    data: bytes
    where: str
    width: int
    height: int

    @property
    def decoded_bytes(self) -> int:
        return self.width * self.height * 4  # the RGB image the processor converts it to: Pillow stores 4 bytes a pixel


@dataclass
class Media:
    """A message list's media as read, in order of appearance (as the chat template places their
    placeholders): ``EncodedImage`` s, ``(AudioBytes, part)`` clips and ``(bytes, part)`` videos."""

    images: list = field(default_factory=list)
    audio: list = field(default_factory=list)
    videos: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.images or self.audio or self.videos)


MEDIA_PARTS = ("image_url", "input_audio", "video_url")


def media_counts(messages: Sequence) -> dict[str, int]:
    """How many parts of each media kind (``MEDIA_PARTS``) the messages hold; nothing is read."""
    counts = dict.fromkeys(MEDIA_PARTS, 0)
    for message in messages:
        for part in message.content if isinstance(message.content, list) else ():
            if part.type in counts:
                counts[part.type] += 1
    return counts


def template_messages(messages: Sequence, policy: MediaPolicy) -> tuple[list[dict], Media]:
    """The messages as the chat template reads them (media parts as ``{"type": "image"}`` etc.,
    tool-call arguments as mappings) and the media they carry, read but not decoded: refused past
    ``policy.max_parts`` before any is read, and past ``policy.max_request_bytes`` as soon as the
    part that passes it is read."""
    import json

    count = sum(media_counts(messages).values())
    if count > policy.max_parts:
        raise APIError(400, f"messages: {count} media parts; a request may carry at most {policy.max_parts}", "messages")
    media = Media()
    used = 0

    def spend(amount: int, where: str) -> None:
        nonlocal used
        used += amount
        if used > policy.max_request_bytes:
            raise APIError(
                400, f"{where}: the request's media pass {policy.max_request_bytes} bytes (encoded bytes, plus 4 bytes a "
                f"pixel for each decoded image)", where,
            )  # fmt: skip

    out = []
    for i, message in enumerate(messages):
        entry: dict = {"role": message.role}
        if isinstance(message.content, list):
            parts = []
            for j, part in enumerate(message.content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "text":
                    parts.append({"type": "text", "text": part.text})
                elif part.type == "image_url":
                    data = policy.read(part.image_url.url, where)
                    with _opened(data, where, load=False) as header:
                        image = EncodedImage(data, where, *header.size)
                    spend(len(data) + image.decoded_bytes, where)
                    media.images.append(image)
                    parts.append({"type": "image"})
                elif part.type == "input_audio":
                    data = decode_base64(part.input_audio.data, where, policy.max_bytes)
                    spend(len(data), where)
                    media.audio.append((AudioBytes(data, part.input_audio.format, f"<{part.input_audio.format} data>"), where))
                    parts.append({"type": "audio"})
                else:
                    data = policy.read(part.video_url.url, where)
                    spend(len(data), where)
                    media.videos.append((data, where))
                    parts.append({"type": "video"})
            entry["content"] = parts
        else:
            entry["content"] = message.content if message.content is not None else ""
        if message.tool_calls:
            calls = []
            for k, call in enumerate(message.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError as err:
                    where = f"messages[{i}].tool_calls[{k}].function.arguments"
                    raise APIError(400, f"{where}: not JSON ({err})", where) from None
                calls.append({"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}})
            entry["tool_calls"] = calls
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(message, key) is not None:
                entry[key] = getattr(message, key)
        out.append(entry)
    return out, media
