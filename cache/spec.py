"""What a graph expects of each layer's cache, and the check that a given cache list matches it.

A graph builds its expected list once (``CacheSpec`` per layer) and calls ``check_caches`` at the
start of a forward, so a cache list made for another model, or edited by hand, fails with the layer
at fault named instead of attending with the wrong mask or window. Layer types are compared by kind
family: ``"full"`` and ``"full-quantized"`` serve the same layer, as do ``"sliding"`` and
``"sliding-quantized"`` (``quantize_caches`` switches storage in place); everything else (full vs
sliding, another window, a shared view vs an owning cache, a shared view of another donor) is an
error. The check is plain Python over the list, cheap enough for every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = {"full": "full", "full-quantized": "full", "sliding": "sliding", "sliding-quantized": "sliding"}
SHARED = "shared:"


def kind_family(kind: str) -> str | None:
    """``"full"`` or ``"sliding"`` for an owning kind, ``"shared:full"`` / ``"shared:sliding"`` for a
    shared view's kind, None for a kind this package does not make."""
    if kind.startswith(SHARED):
        family = FAMILIES.get(kind[len(SHARED) :])
        return None if family is None else SHARED + family
    return FAMILIES.get(kind)


@dataclass(frozen=True)
class CacheSpec:
    """One layer's cache: its storage ``kind`` (``"full"``, ``"sliding"``, a quantized kind, or
    ``"shared:<donor kind>"``), its sliding ``window`` (None on full layers) and, for a KV-shared
    layer, ``donor``: the index in the cache list of the cache it reads (None for owning caches)."""

    kind: str
    window: int | None = None
    donor: int | None = None

    def __post_init__(self):
        if not isinstance(self.kind, str) or kind_family(self.kind) is None:
            raise ValueError(f"CacheSpec: unknown kind {self.kind!r}; known kinds: {sorted(FAMILIES)} or 'shared:<kind>'")
        family = kind_family(self.kind).removeprefix(SHARED)
        if family == "sliding":
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
                raise ValueError(f"CacheSpec: a {self.kind!r} cache needs an int window >= 1, got {self.window!r}")
        elif self.window is not None:
            raise ValueError(f"CacheSpec: a {self.kind!r} cache has no window, got {self.window!r}")
        if self.donor is not None and (isinstance(self.donor, bool) or not isinstance(self.donor, int) or self.donor < 0):
            raise ValueError(f"CacheSpec: donor must be None or a layer index >= 0, got {self.donor!r}")

    @property
    def shared(self) -> bool:
        """A KV-shared view: a ``"shared:"`` kind or a donor index (a view whose donor is not in the
        list has the kind and no index)."""
        return self.donor is not None or self.kind.startswith(SHARED)

    def describe(self) -> str:
        family = kind_family(self.kind).removeprefix(SHARED)
        what = f"{family} (window {self.window})" if self.window is not None else family
        if not self.shared:
            return f"a {what} cache"
        donor = "a cache outside the list" if self.donor is None else f"layer {self.donor}"
        return f"a shared view of {donor} ({what})"


def check_caches(caches: list, expected: list, owner: str) -> None:
    """Raise ``ValueError`` naming ``owner``, the layer index, the expected and the given cache when
    ``caches`` does not fit ``expected`` (a ``CacheSpec`` per layer). Full-precision and quantized
    storage of the same layer type are interchangeable; see the module docstring for the rest."""
    if not isinstance(caches, (list, tuple)):
        raise TypeError(f"{owner}: cache must be a list of layer caches, got {type(caches).__name__}")
    if len(caches) != len(expected):
        raise ValueError(f"{owner}: cache has {len(caches)} entries for {len(expected)} layers")
    index = {id(c): i for i, c in enumerate(caches)}

    def index_of(cache) -> int | None:
        return index.get(id(cache))

    for i, (cache, want) in enumerate(zip(caches, expected)):
        if not isinstance(want, CacheSpec):
            raise TypeError(f"{owner}: expected[{i}] must be a CacheSpec, got {type(want).__name__}")
        spec_of = getattr(cache, "spec", None)
        if spec_of is None:
            raise ValueError(f"{owner}: layer {i} expects {want.describe()}, got {type(cache).__name__} (not a cache of this package)")
        got = spec_of(index_of)
        if (
            got.donor != want.donor
            or got.shared != want.shared
            or got.window != want.window
            or kind_family(got.kind).removeprefix(SHARED) != kind_family(want.kind).removeprefix(SHARED)
        ):
            raise ValueError(
                f"{owner}: layer {i} expects {want.describe()} ({want}), "
                f"got {got.describe()}: {type(cache).__name__} ({got})"
            )
