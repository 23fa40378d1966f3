"""Switching a model's caches to quantized storage once they hold enough positions."""

from __future__ import annotations

from .base import SharedView


def quantize_caches(caches: list, bits: int, group_size: int = 64, start: int = 0) -> list:
    """Replace, in ``caches``, every full-precision cache holding at least ``start`` positions by its
    quantized twin, and point KV-shared views at the new donors. Returns ``caches``.

    Before ``start`` positions a cache stays in full precision (short prompts pay no quantization
    error); from then on new positions are stored quantized. Already quantized caches are left alone.
    """
    replaced = {}
    for i, cache in enumerate(caches):
        if isinstance(cache, SharedView) or cache.codec.quantized or cache.offset < start:
            continue
        caches[i] = replaced[id(cache)] = cache.to_quantized(bits, group_size)
    for cache in caches:
        if isinstance(cache, SharedView) and id(cache.donor) in replaced:
            cache.donor = replaced[id(cache.donor)]
    return caches
