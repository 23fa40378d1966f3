"""KV caches and the attention reads every graph calls; masks are built here and nowhere else.

``KVCache`` serves full-attention layers and ``RotatingKVCache`` sliding-window layers;
``QuantizedKVCache`` and ``RotatingQuantizedKVCache`` are the same on quantized storage. Each offers
the per-graph reads (``decode``, ``window``, ``vision_prefill``, ``encoder``, ``canvas``, and
``bidirectional`` for encoder-only configs), ``shared_view()`` for KV-shared layers, trims, and
``state`` / ``from_state``. ``Read`` names the read a forward makes; ``check_caches`` checks a model's cache list against the
``CacheSpec`` of each layer. ``batch_caches`` groups conversations' caches into one ragged batch;
``PackedCache`` runs an encoder over texts packed end to end in one row.
"""

import zoo_cpu  # noqa: F401  (first: loads a fast BLAS before anything imports MLX; see zoo_cpu/blas.py)

from .base import AttentionCache, MediaSplitError, SharedView, same_offset
from .batch import BatchCache, BatchSharedView, advance, batch_caches
from .full import KVCache, QuantizedKVCache
from .packed import PackedCache
from .quantize import quantize_caches
from .reads import Read
from .rotating import RotatingKVCache, RotatingQuantizedKVCache
from .spec import CacheSpec, check_caches

KINDS = {cls.kind: cls for cls in (KVCache, RotatingKVCache, QuantizedKVCache, RotatingQuantizedKVCache)}


def cache_from_state(state: dict) -> AttentionCache:
    """Rebuild a cache from its ``state``; an unknown kind is an error, never a fallback."""
    if not isinstance(state, dict):
        raise ValueError(f"cache_from_state: state must be a dict (a cache's .state), got {type(state).__name__}")
    kind = state.get("kind")
    if kind not in KINDS:
        raise ValueError(f"cache_from_state: unknown cache kind {kind!r}; known kinds: {sorted(KINDS)}")
    return KINDS[kind].from_state(state)


def owning_caches(cache: list) -> list:
    """The caches of a model's layer list that own storage (KV-shared views follow their donors)."""
    return [c for c in cache if not isinstance(c, SharedView)]


def cache_offset(cache: list) -> int:
    """How many positions a model's layer caches hold (0 for an empty list)."""
    return owning_caches(cache)[0].offset if cache else 0


def trim_cache(cache: list, n: int) -> bool:
    """Drop the newest ``n`` positions from every layer, all or none; False if any layer cannot."""
    layers = owning_caches(cache)
    if not all(c.can_trim(n) for c in layers):
        return False
    for c in layers:
        c.trim(n)
    return True


__all__ = [
    "AttentionCache",
    "MediaSplitError",
    "KVCache",
    "RotatingKVCache",
    "QuantizedKVCache",
    "RotatingQuantizedKVCache",
    "SharedView",
    "BatchCache",
    "BatchSharedView",
    "PackedCache",
    "advance",
    "batch_caches",
    "CacheSpec",
    "Read",
    "check_caches",
    "KINDS",
    "cache_from_state",
    "cache_offset",
    "owning_caches",
    "same_offset",
    "trim_cache",
    "quantize_caches",
]
