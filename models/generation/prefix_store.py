"""Prefix reuse across requests: cache snapshots keyed by token ids (and image content), LRU within a byte budget.

``PrefixStore.prefill(model, prompt, cache)`` fills a fresh cache list with ``prompt``: it finds the
stored prompt sharing the longest prefix with it, restores the caches at the furthest position ``r``
that can be restored exactly, prefills only ``prompt[r:]``, and stores what this prefill computed.

What is kept and what is recomputed:

- Full-attention layers keep every position, so the caches at any ``r`` are the first ``r`` rows of
  a longer prompt's. An entry keeps its prompt's rows as pieces shared with the entry it was
  restored from (requests behind one long system prompt hold its rows once).
- Sliding layers keep only the window's history: the caches at ``r`` need the ``window - 1``
  positions before ``r``, which a stored prompt whose windows wrapped past ``r`` no longer holds.
  So during a prefill each sliding layer's history is recorded at every chunk boundary
  (``models.generation.prompts.prefill_chunks``, never inside an image), and at the prompt's end
  all it stores (up to ``window - 1 + slack + step`` positions, so that one end serves a range of
  ``r``). A request is restored at the furthest recorded position within its common prefix (never
  inside an image, and never at the last prompt position: its logits are needed) and the rest is
  recomputed: at most one chunk past the common prefix's last boundary, usually less.
- Quantized KV (``kv_quantization``): a cache switches to quantized storage after the first chunk
  ending at or past ``start``; the positions before attended in full precision. A restore is made
  only where a fresh prefill of the new prompt would hold the same storage: after the stored
  prompt's switch if the new prompt switches at the same chunk end (same bits and group size),
  or before any switch at one of the new prompt's own chunk boundaries (so its tail switches
  where a fresh prefill would). Elsewhere the store recomputes from an earlier position.

Images: each image's features are hashed (SHA-256 of their bytes); two prompts share a prefix only
through images with equal hashes at equal positions. KV-shared views follow their donors.

The store keeps what its entries reference (full-layer pieces and sliding checkpoints, compact
copies, each counted once) within ``max_bytes``, evicting the least recently used entries; an
entry whose prompt is a prefix of a newer one that restored everything it held is dropped as
redundant. ``stats`` counts hits, misses, reused tokens, bytes, entries and evictions. One store
serves one model; it is not thread-safe (the batch generator's thread drives it).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from cache import SharedView, cache_from_state, owning_caches

from models.checks import check_token_ids
from models.generation.chat import image_safe_prefix
from models.generation.generate import DEFAULT_PREFILL_STEP, KVQuantization, check_context, check_positive_int, prefill
from models.generation.prompt_cache import array_digest, caches_from_layer_states, layer_states
from models.generation.prompts import Prompt, prefill_chunks
from models.model import Model


class PrefixReuse(NamedTuple):
    """What ``PrefixStore.prefill`` did: the last position's ``logits`` ``[V]`` and how many prompt
    positions were restored (``reused``) rather than computed."""

    logits: mx.array
    reused: int


@dataclass
class PrefixStoreStats:
    """Counters for a server's metrics. ``hits``: prefills that restored at least one position;
    ``too_large``: prompts whose snapshot alone exceeded the byte budget (not stored)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    too_large: int = 0
    entries: int = 0
    bytes: int = 0


class _Image(NamedTuple):
    start: int
    end: int
    digest: str


def _same_digest(old: _Image, new: _Image) -> bool:
    return old.digest == new.digest


class _Piece:
    """Full-layer rows of positions ``[start, end)``: per full layer, its key and value planes."""

    def __init__(self, start: int, end: int, planes: dict[int, tuple]):
        self.start, self.end, self.planes = start, end, planes
        self.nbytes = sum(p.nbytes for keys, values in planes.values() for p in keys + values)


class _Checkpoint:
    """Sliding-layer history at ``position``: per sliding layer, its state holding the stored rows
    ``[position - rows, position)`` (``rows`` at least the window's history)."""

    def __init__(self, position: int, states: dict[int, dict]):
        self.position, self.states = position, states
        self.nbytes = sum(p.nbytes for s in states.values() for p in (s["keys"] or ()) + (s["values"] or ()))

    def lowest(self) -> int:
        """The lowest position this checkpoint restores: every layer must still hold its window's
        history there (a layer that holds everything from position 0 serves any position)."""
        low = 0
        for state in self.states.values():
            first = self.position - _rows(state)
            if first > 0:
                low = max(low, first + state["window"] - 1)
        return low


@dataclass
class _Entry:
    ids: np.ndarray
    images: tuple[_Image, ...]
    pieces: list[tuple[_Piece, int]]  # (piece, stop): rows [piece.start, min(piece.end, stop)), in order
    checkpoints: list[_Checkpoint]  # ascending positions
    templates: dict[int, dict]  # full layer -> its state's settings
    layers: list[tuple[str, object]]  # layer_states with the arrays dropped: kinds and views
    switched_at: int | None  # position after which the caches were quantized (None: never)
    kv: tuple | None  # (bits, group_size) once switched
    objects: list = field(default_factory=list)  # pieces and checkpoints it holds (for the byte count)


class PrefixStore:
    """Cache snapshots of earlier prompts, reused by ``prefill`` (module docstring)."""

    def __init__(self, max_bytes: int = 1 << 30):
        check_positive_int("max_bytes", max_bytes)
        self.max_bytes = int(max_bytes)
        self.stats = PrefixStoreStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._model: weakref.ref | None = None

    def clear(self) -> None:
        self._entries.clear()
        self._count()

    # ---------------------------------------------------------------------------------- prefill
    def prefill(
        self,
        model: Model,
        prompt: Prompt,
        cache: list,
        kv_quantization: KVQuantization | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
    ) -> PrefixReuse:
        """Fill the fresh ``cache`` (``model.make_cache()``) with ``prompt``, reusing a stored prefix
        where that is exact, and store this prompt's snapshot."""
        self._check(model, prompt, cache, prefill_step_size)
        quant = kv_quantization if kv_quantization is not None and kv_quantization.bits is not None else None
        ids = np.asarray(prompt.ids, dtype=np.int64)
        images = tuple(_Image(s.start, s.end, array_digest(s.features)) for s in prompt.images)
        ends = [end for _, end in prefill_chunks(len(ids), prompt.images, prefill_step_size)]
        fresh_switch = None if quant is None else next((e for e in ends if e >= quant.start), None)

        found, r = self._lookup(ids, images, prompt, ends, fresh_switch, quant)
        if found is not None:
            self._entries.move_to_end(self._key_of(found))
            cache[:] = self._restore(found, r)
            self.stats.hits += 1
            self.stats.reused_tokens += r
        else:
            self.stats.misses += 1
        switched_at = found.switched_at if found is not None and _quantized(cache) else None

        # The restored history is recorded too: the next request behind the same prefix restores here.
        checkpoints = [_checkpoint(cache, r, history_only=True)] if r else []
        logits = None
        tail = prompt.suffix(r)
        for start, end in prefill_chunks(len(tail), tail.images, prefill_step_size):
            inside = [s.shifted(-start) for s in tail.images if start <= s.start < end]
            logits = prefill(model.forward, tail.ids[start:end], cache, end - start, inside, kv_quantization)
            if switched_at is None and _quantized(cache):
                switched_at = r + end
            if r + end < len(ids):
                checkpoints.append(_checkpoint(cache, r + end, history_only=True))
        checkpoints.append(_checkpoint(cache, len(ids), history_only=False))
        self._insert(found, r, ids, images, cache, checkpoints, switched_at, quant)
        return PrefixReuse(logits, r)

    def _check(self, model, prompt, cache, step) -> None:
        if not isinstance(model, Model):
            raise TypeError(
                f"PrefixStore: serves autoregressive zoo models (models.Model), got {type(model).__name__}; "
                "DiffusionGemma prefills its prompt with encoder reads inside its own loop"
            )
        if self._model is None or self._model() is None:
            self._entries.clear()
            self._model = weakref.ref(model)
        elif self._model() is not model:
            raise ValueError(f"PrefixStore: this store serves {self._model().path}; make another store for {model.path}")
        if not isinstance(prompt, Prompt):
            raise TypeError(f"PrefixStore.prefill: prompt must be a Prompt (model.prompt(...)), got {type(prompt).__name__}")
        if not prompt.ids:
            raise ValueError("PrefixStore.prefill: the prompt is empty")
        check_positive_int("prefill_step_size", step)
        check_token_ids(prompt.ids, model.vocab_size, "PrefixStore.prefill")
        if check_context(cache, len(prompt.ids), model.max_context) != 0:
            raise ValueError("PrefixStore.prefill: the cache must be fresh (model.make_cache()); it already holds positions")

    # ----------------------------------------------------------------------------------- lookup
    def _lookup(self, ids, images, prompt, ends, fresh_switch, quant) -> tuple[_Entry | None, int]:
        """The entry and position of the furthest exact restore (None, 0 when there is none)."""
        best, best_r = None, 0
        for entry in reversed(self._entries.values()):  # most recent first: it wins ties
            n = min(len(entry.ids), len(ids))
            differ = np.flatnonzero(entry.ids[:n] != ids[:n])
            common = int(differ[0]) if differ.size else n
            common = image_safe_prefix(min(common, len(ids) - 1), entry.images, images, _same_digest)
            for r in self._candidates(entry, common, prompt, ends):
                if r > best_r and self._valid(entry, r, prompt, ends, fresh_switch, quant):
                    best, best_r = entry, r
                    break
        return best, best_r

    @staticmethod
    def _candidates(entry: _Entry, common: int, prompt: Prompt, ends: list[int]) -> list[int]:
        """Positions up to ``common`` that ``entry`` restores, furthest first: the furthest position
        each checkpoint serves, and the new prompt's chunk ends and image starts within its range."""
        found = set()
        for point in entry.checkpoints:
            low, high = max(point.lowest(), 1), min(point.position, common)
            if high < low:
                continue
            found.add(high)
            found.update(e for e in ends if low <= e <= high)
            found.update(s.start for s in prompt.images if low <= s.start <= high)
        return sorted(found, reverse=True)

    @staticmethod
    def _valid(entry: _Entry, r: int, prompt: Prompt, ends: list[int], fresh_switch, quant) -> bool:
        if any(s.start < r < s.end for s in prompt.images):
            return False
        if entry.switched_at is not None and entry.switched_at > r:
            return False  # the full layers' rows before r are stored quantized, a fresh prefill holds them in full precision
        if entry.switched_at is not None:  # quantized at r: the new prompt must switch at the same chunk end
            return quant is not None and entry.kv == (quant.bits, quant.group_size) and fresh_switch == entry.switched_at
        # full precision at r: the tail must switch (if at all) where a fresh prefill would
        return fresh_switch is None or (r < fresh_switch and r in ends)

    def _restore(self, entry: _Entry, r: int) -> list:
        """The cache list at position ``r`` from ``entry``'s pieces and a checkpoint serving ``r``."""
        point = next(p for p in reversed(entry.checkpoints) if p.lowest() <= r <= p.position)
        layers = []
        for i, (kind, value) in enumerate(entry.layers):
            if kind == "view":
                layers.append((kind, value))
            elif i in point.states:
                state = point.states[i]
                first = point.position - _rows(state)
                keep = max(first, r - (state["window"] - 1 + state["slack"]))
                planes = {side: _rows_of(state[side], keep - first, r - first) for side in ("keys", "values")}
                layers.append(("own", {**state, **planes, "offset": r, "ends_in_image": None}))
            else:
                planes = {
                    side: _concat([_rows_of(piece.planes[i][j], 0, min(piece.end, stop, r) - piece.start)
                                   for piece, stop in entry.pieces if piece.start < min(stop, r)])
                    for j, side in enumerate(("keys", "values"))
                }  # fmt: skip
                layers.append(("own", {**entry.templates[i], **planes, "offset": r, "ends_in_image": None}))
        return caches_from_layer_states(layers)

    # ----------------------------------------------------------------------------------- insert
    def _insert(self, found, r, ids, images, cache, checkpoints, switched_at, quant) -> None:
        if found is not None and found.images == images and np.array_equal(found.ids, ids) and found.switched_at == switched_at:
            return  # this very prompt is stored (and was just touched)
        states = layer_states(cache)
        full = {i: v for i, (kind, v) in enumerate(states) if kind == "own" and v.get("window") is None}
        inherit = found is not None and found.switched_at == switched_at
        pieces: list[tuple[_Piece, int]] = []
        start = 0
        if inherit:
            pieces = [(piece, min(stop, r)) for piece, stop in found.pieces if piece.start < min(stop, r)]
            start = r
            checkpoints = [p for p in found.checkpoints if p.position <= r] + checkpoints
        planes = {i: tuple(_copy_rows(v[side], start, len(ids)) for side in ("keys", "values")) for i, v in full.items()}
        pieces.append((_Piece(start, len(ids), planes), len(ids)))
        entry = _Entry(
            ids=ids,
            images=images,
            pieces=pieces,
            checkpoints=checkpoints,
            templates={i: _settings(v) for i, v in full.items()},
            layers=[(kind, v if kind == "view" else None) for kind, v in states],
            switched_at=switched_at,
            kv=None if switched_at is None else (quant.bits, quant.group_size),
        )
        entry.objects = [p for p, _ in pieces] + checkpoints
        if sum(o.nbytes for o in entry.objects) > self.max_bytes:
            self.stats.too_large += 1
            return
        for key, old in list(self._entries.items()):
            if _subsumed(old, entry):
                del self._entries[key]
        self._entries[self._next] = entry
        self._next += 1
        while self._count() > self.max_bytes:
            self._entries.popitem(last=False)
            self.stats.evictions += 1

    def _key_of(self, entry: _Entry) -> int:
        return next(k for k, e in self._entries.items() if e is entry)

    def _count(self) -> int:
        held = {id(o): o.nbytes for e in self._entries.values() for o in e.objects}
        self.stats.entries, self.stats.bytes = len(self._entries), sum(held.values())
        return self.stats.bytes


def _subsumed(old: _Entry, new: _Entry) -> bool:
    """``old``'s prompt is a prefix of ``new``'s and ``new`` restores every position ``old`` restores
    (a checkpoint at each of ``old``'s positions, serving at least the same range)."""
    n = len(old.ids)
    return (
        n <= len(new.ids)
        and np.array_equal(old.ids, new.ids[:n])
        and old.images == tuple(i for i in new.images if i.start < n)
        and old.switched_at == new.switched_at
        and all(any(q.position == p.position and q.lowest() <= p.lowest() for q in new.checkpoints) for p in old.checkpoints)
    )


def _quantized(cache: list) -> bool:
    return any(c.codec.quantized for c in owning_caches(cache))


def _rows(state: dict) -> int:
    return 0 if state["keys"] is None else int(state["keys"][0].shape[2])


def _rows_of(planes, start: int, stop: int):
    return None if planes is None else tuple(p[..., start:stop, :] for p in planes)


def _copy_rows(planes, start: int, stop: int):
    """Rows ``[start, stop)`` as compact arrays of their own (a slice would pin the cache's buffer
    and make its next in-place write copy it)."""
    if planes is None:
        return None
    out = tuple(mx.array(p[..., start:stop, :]) for p in planes)
    mx.eval(out)
    return out


def _concat(parts: list):
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    return tuple(mx.concatenate(group, axis=2) for group in zip(*parts))


def _settings(state: dict) -> dict:
    return {k: v for k, v in state.items() if k not in ("keys", "values", "offset", "geometry", "ends_in_image")}


def _checkpoint(cache: list, position: int, history_only: bool) -> _Checkpoint:
    """The sliding layers' stored rows at ``position`` (only the window's history with ``history_only``)."""
    states = {}
    for i, (kind, state) in enumerate(layer_states(cache)):
        if kind != "own" or state.get("window") is None:
            continue
        rows = _rows(state)
        keep = min(rows, state["window"] - 1) if history_only else rows
        states[i] = {**_settings(state), **{
            side: _copy_rows(state[side], rows - keep, rows) if keep else None for side in ("keys", "values")
        }}  # fmt: skip
    return _Checkpoint(position, states)
