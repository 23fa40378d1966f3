"""KV caches and the attention reads every graph calls; masks are built here and nowhere else.

``KVCache`` serves full-attention layers and ``RotatingKVCache`` sliding-window layers. Each offers
the five per-graph reads (``decode``, ``window``, ``vision_prefill``, ``encoder``, ``canvas``),
``shared_view()`` for KV-shared layers, trims, and ``state`` / ``from_state``.
"""

from .base import AttentionCache, SharedView
from .full import KVCache
from .rotating import RotatingKVCache

KINDS = {cls.kind: cls for cls in (KVCache, RotatingKVCache)}


def cache_from_state(state: dict) -> AttentionCache:
    """Rebuild a cache from its ``state``; an unknown kind is an error, never a fallback."""
    kind = state.get("kind")
    if kind not in KINDS:
        raise ValueError(f"cache_from_state: unknown cache kind {kind!r}; known kinds: {sorted(KINDS)}")
    return KINDS[kind].from_state(state)


__all__ = ["AttentionCache", "KVCache", "RotatingKVCache", "SharedView", "KINDS", "cache_from_state"]
