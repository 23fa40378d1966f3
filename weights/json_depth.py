"""How deep arrays and objects nest in a JSON text, measured before it is parsed.

Python's ``json`` parser recurses once per level and raises ``RecursionError`` around 1000 levels
(or overflows the C stack where the recursion limit was raised), so every JSON text that comes from
outside (``config.json``, a safetensors header, a server request body) is measured here first and
refused by name past the depth its format needs.
"""

from __future__ import annotations

import re

import numpy as np

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_CHUNK = 1 << 20


def nesting_depth(text: bytes | str, limit: int) -> int:
    """The nesting depth of the JSON ``text`` (string contents skipped), exact when it exceeds
    ``limit`` and at most ``limit`` otherwise (a text with few brackets is not scanned). Works in
    chunks, so a 100 MiB text of brackets costs megabytes, not gigabytes."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return len(brackets)
    codes = np.frombuffer(brackets, dtype=np.uint8)
    deepest = level = 0
    for start in range(0, len(codes), _CHUNK):
        chunk = codes[start : start + _CHUNK]
        levels = level + np.cumsum(np.where((chunk == ord("[")) | (chunk == ord("{")), 1, -1), dtype=np.int64)
        deepest, level = max(deepest, int(levels.max())), int(levels[-1])
    return deepest
