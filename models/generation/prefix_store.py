"""Prefix reuse across requests: cache snapshots keyed by token ids (and image content), LRU within a byte budget.

``PrefixStore.prefill(model, prompt, cache)`` fills a fresh cache list with ``prompt``: it finds the
stored prompt sharing the longest prefix with it, restores the caches at the furthest position ``r``
that can be restored exactly, prefills only ``prompt[r:]``, and stores what this prefill computed.

What is kept and what is recomputed:

- Kept: every layer's rows that a prefill computed, as compact copies in the storage the cache
  held them (sliding layers too: after each chunk, every row of it the sliding cache stores; a
  chunk up to ``window - 1 + slack`` long is stored whole). An entry shares the rows before its
  restore point with the entry it restored from, so requests behind one long system prompt hold
  its rows once.
- Restored at ``r``: full layers get rows ``[0, r)``; sliding layers the history a cache keeps at
  ``r`` (its newest ``window - 1 + slack`` rows before ``r``), taken from those rows, so a restore
  is exact at any position, however far the stored prompt's windows wrapped past it.
- Recomputed: the prompt from ``r`` on. With ``aligned`` (the default) ``r`` is the furthest of the
  new prompt's own chunk ends (``models.generation.prompts.prefill_chunks`` with its
  ``prefill_step_size``) within the common prefix, so the tail is fed in exactly the chunks a fresh
  prefill feeds it in and the result is a fresh prefill's bit for bit (the tests find a difference
  of 0.0 on the CPU); at most one chunk of the common prefix is recomputed. With
  ``aligned=False`` ``r`` is the common prefix itself (moved to an image's start if it falls inside
  one); the tail's first chunk then starts elsewhere than a fresh prefill's, and the logits differ
  as another chunking's do (rounding: up to 3e-5 on a tiny random E2B-shaped model). Either way
  ``r`` stays below the last prompt position (its logits are the result), and a restore never
  needs a sliding row that the cache dropped before it was recorded (a ``prefill_step_size`` above
  ``window - 1 + slack``: then an earlier ``r``).
- Quantized KV (``kv_quantization``): a cache switches to quantized storage after the first chunk
  ending at or past ``start``; the positions before attended in full precision, and from then on
  every stored row is quantized (the recorded full-precision rows are dropped and the quantized
  ones the caches hold recorded instead). A restore is made only where a fresh prefill of the new
  prompt holds the same storage: after the stored prompt's switch if the new prompt switches at
  the same chunk end (same bits and group size), or before any switch at one of the new prompt's
  own chunk ends (``models.generation.prompts.prefill_chunks``), so that its tail switches where a
  fresh prefill would. Elsewhere nothing is restored.

Images: each image's features are hashed (SHA-256 of their bytes); two prompts share a prefix only
through images with equal hashes at equal positions. KV-shared views follow their donors.

The store keeps the rows its entries reference (each counted once) within ``max_bytes``, evicting
the least recently used entries; an entry whose prompt is a prefix of a newer one that restores
every position it restores is dropped as redundant. ``stats`` counts hits, misses, reused tokens, bytes, entries and evictions. One store
serves one model; it is not thread-safe (the batch generator's thread drives it).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from cache import owning_caches

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


class _Rows:
    """One layer's stored rows of positions ``[start, end)``: compact copies of its key and value
    planes as the cache stored them (quantized planes for quantized storage)."""

    def __init__(self, start: int, end: int, keys: tuple, values: tuple):
        self.start, self.end, self.keys, self.values = start, end, keys, values
        self.nbytes = sum(p.nbytes for p in keys + values)


@dataclass
class _Entry:
    ids: np.ndarray
    images: tuple[_Image, ...]
    layers: list[tuple[str, object]]  # per layer ("own", its state's settings) or ("view", donor index)
    rows: dict[int, list[tuple[_Rows, int]]]  # owning layer -> (rows, stop): positions [rows.start, min(rows.end, stop))
    switched_at: int | None  # position after which the caches were quantized (None: never)
    kv: tuple | None  # (bits, group_size) once switched
    reach: list[tuple[int, int]] = field(default_factory=list)  # the positions it restores: [low, high] runs

    def objects(self) -> dict[int, _Rows]:
        return {id(rows): rows for runs in self.rows.values() for rows, _ in runs}


class PrefixStore:
    """Cache snapshots of earlier prompts, reused by ``prefill`` (module docstring)."""

    def __init__(self, max_bytes: int = 1 << 30, aligned: bool = True):
        check_positive_int("max_bytes", max_bytes)
        self.max_bytes, self.aligned = int(max_bytes), bool(aligned)
        self.stats = PrefixStoreStats()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next = 0
        self._model: weakref.ref | None = None

    def clear(self) -> None:
        self._entries.clear()
        self._count()

    # ---------------------------------------------------------------------------------- prefill
    def prefill(self, model: Model, prompt: Prompt, cache: list, kv_quantization: KVQuantization | None = None,
                prefill_step_size: int = DEFAULT_PREFILL_STEP) -> PrefixReuse:  # fmt: skip
        """Fill the fresh ``cache`` (``model.make_cache()``) with ``prompt``, reusing a stored prefix
        where that is exact, and store this prompt's snapshot."""
        fill = self.begin(model, prompt, cache, kv_quantization, prefill_step_size)
        logits = None
        for start, end in fill.chunks:
            inside = [s.shifted(-start) for s in prompt.images if start <= s.start < end]
            logits = prefill(model.forward, prompt.ids[start:end], cache, end - start, inside, kv_quantization)
            fill.fed(end)
        fill.done()
        return PrefixReuse(logits, fill.reused)

    def begin(
        self,
        model: Model,
        prompt: Prompt,
        cache: list,
        kv_quantization: KVQuantization | None = None,
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
    ) -> "PrefixFill":
        """Restore into the fresh ``cache`` the furthest exact prefix of ``prompt``; the caller feeds
        the returned fill's ``chunks`` (whose chunk ends are the ones a restore may use), calls
        ``fed`` after each and ``done`` at the end (``prefill`` does all three; the batch generator
        feeds many prompts' chunks in one forward)."""
        self._check(model, prompt, cache, prefill_step_size)
        quant = kv_quantization if kv_quantization is not None and kv_quantization.bits is not None else None
        ids = np.asarray(prompt.ids, dtype=np.int64)
        images = tuple(_Image(s.start, s.end, array_digest(s.features)) for s in prompt.images)
        ends = [end for _, end in prefill_chunks(len(ids), prompt.images, prefill_step_size)]
        fresh_switch = None if quant is None else next((e for e in ends if e >= quant.start), None)

        found, r = self._lookup(ids, images, prompt, ends, fresh_switch, quant)
        fill = PrefixFill(self, cache, found, r, ids, images, quant)
        if found is not None:
            self._entries.move_to_end(self._key_of(found))
            cache[:] = self._restore(found, r)
            self.stats.hits += 1
            self.stats.reused_tokens += r
            fill.rows = {i: [(run, min(stop, r)) for run, stop in runs if run.start < min(stop, r)] for i, runs in found.rows.items()}
            fill.switched_at = found.switched_at if _quantized(cache) else None
        else:
            self.stats.misses += 1
        tail = prompt.suffix(r)
        fill.chunks = [(r + start, r + end) for start, end in prefill_chunks(len(tail), tail.images, prefill_step_size)]
        return fill

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
            for r in self._candidates(entry, common, prompt, ends, self.aligned):
                if r > best_r and self._valid(entry, r, prompt, ends, fresh_switch, quant):
                    best, best_r = entry, r
                    break
        return best, best_r

    @staticmethod
    def _candidates(entry: _Entry, common: int, prompt: Prompt, ends: list[int], aligned: bool) -> list[int]:
        """Positions up to ``common`` that ``entry`` restores, furthest first: the new prompt's chunk
        ends within each run of restorable positions, and unless ``aligned`` the furthest position
        of each run and the image starts within it."""
        found = set()
        for low, high in entry.reach:
            high = min(high, common)
            if high < low:
                continue
            found.update(e for e in ends if low <= e <= high)
            if not aligned:
                found.add(high)
                found.update(s.start for s in prompt.images if low <= s.start <= high)
        return sorted(found, reverse=True)

    @staticmethod
    def _valid(entry: _Entry, r: int, prompt: Prompt, ends: list[int], fresh_switch, quant) -> bool:
        if any(s.start < r < s.end for s in prompt.images):
            return False
        if entry.switched_at is not None and entry.switched_at > r:
            return False  # the rows before r are stored quantized, a fresh prefill holds them in full precision
        if entry.switched_at is not None:  # quantized at r: the new prompt must switch at the same chunk end
            return quant is not None and entry.kv == (quant.bits, quant.group_size) and fresh_switch == entry.switched_at
        # full precision at r: the tail must switch (if at all) where a fresh prefill would
        return fresh_switch is None or (r < fresh_switch and r in ends)

    @staticmethod
    def _restore(entry: _Entry, r: int) -> list:
        """The cache list at position ``r``: full layers get rows ``[0, r)``, sliding layers as much
        of the history before ``r`` as they keep (``window - 1 + slack``) and the entry holds."""
        layers = []
        for i, (kind, value) in enumerate(entry.layers):
            if kind == "view":
                layers.append((kind, value))
                continue
            runs = [(run, min(stop, r)) for run, stop in entry.rows[i] if run.start < min(stop, r)]
            first = _covered_from(runs, r)
            if value.get("window") is not None:
                first = max(first, r - (value["window"] - 1 + value["slack"]))
            parts = [(run, max(first, run.start), stop) for run, stop in runs if stop > first]
            planes = {
                side: tuple(
                    mx.concatenate([getattr(run, side)[j][..., a - run.start : b - run.start, :] for run, a, b in parts], axis=2)
                    for j in range(len(getattr(parts[0][0], side)))
                )
                for side in ("keys", "values")
            }
            layers.append(("own", {**value, **planes, "offset": r, "ends_in_image": None}))
        return caches_from_layer_states(layers)

    # ----------------------------------------------------------------------------------- insert
    def _insert(self, found, r, ids, images, cache, rows, switched_at, quant) -> None:
        if found is not None and found.images == images and np.array_equal(found.ids, ids) and found.switched_at == switched_at:
            return  # this very prompt is stored (and was just touched)
        layers = [(kind, v if kind == "view" else _settings(v)) for kind, v in layer_states(cache)]
        entry = _Entry(ids, images, layers, rows, switched_at, None if switched_at is None else (quant.bits, quant.group_size))
        entry.reach = _reach(entry)
        if sum(run.nbytes for run in entry.objects().values()) > self.max_bytes:
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
        held = {k: run.nbytes for e in self._entries.values() for k, run in e.objects().items()}
        self.stats.entries, self.stats.bytes = len(self._entries), sum(held.values())
        return self.stats.bytes


@dataclass(eq=False)
class PrefixFill:
    """One prompt's prefill through the store (``PrefixStore.begin``): ``reused`` positions were
    restored, ``chunks`` are the ``(start, end)`` prompt positions still to feed, in order."""

    store: PrefixStore
    cache: list
    found: _Entry | None
    reused: int
    ids: np.ndarray
    images: tuple
    quant: KVQuantization | None
    rows: dict = field(default_factory=dict)
    switched_at: int | None = None
    chunks: list = field(default_factory=list)
    _at: int | None = None

    def fed(self, end: int) -> None:
        """The chunk ending at prompt position ``end`` is in the cache: record its rows."""
        start = self.reused if self._at is None else self._at
        self._at = end
        if self.switched_at is None and _quantized(self.cache):
            # Every stored row is quantized now: what was recorded in full precision no longer matches.
            self.switched_at, self.rows = end, {}
            _record(self.rows, self.cache, 0)
        else:
            _record(self.rows, self.cache, start)

    def done(self) -> None:
        """The whole prompt is in the cache: store its snapshot."""
        self.store._insert(self.found, self.reused, self.ids, self.images, self.cache, self.rows, self.switched_at, self.quant)


def _record(rows: dict, cache: list, start: int) -> None:
    """Append to ``rows`` each owning layer's stored rows of the positions from ``start`` on (a
    sliding layer may no longer hold the first of them: a chunk longer than it keeps)."""
    for i, (kind, state) in enumerate(layer_states(cache)):
        if kind != "own" or state["keys"] is None:
            continue
        stored = int(state["keys"][0].shape[2])
        first = state["offset"] - stored
        a = max(start, first)
        if a >= state["offset"]:
            continue
        planes = {
            side: tuple(mx.array(p[..., a - first :, :]) for p in state[side]) for side in ("keys", "values")
        }  # compact copies: a slice would pin the cache's buffer, and its next in-place write would copy it
        mx.eval(planes)
        run = _Rows(a, state["offset"], planes["keys"], planes["values"])
        rows.setdefault(i, []).append((run, run.end))


def _intervals(runs) -> list[tuple[int, int]]:
    """The maximal ``[a, b)`` position intervals ``runs`` cover."""
    merged: list[list[int]] = []
    for run, stop in sorted(runs, key=lambda x: x[0].start):
        a, b = run.start, min(run.end, stop)
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered_from(runs, r: int) -> int:
    """The first position of the covered interval that ends at ``r``."""
    return next(a for a, b in _intervals(runs) if a < r <= b)


def _reach(entry: _Entry) -> list[tuple[int, int]]:
    """The positions ``r >= 1`` at which ``entry`` restores every layer, as ``[low, high]`` runs: a
    full layer needs its rows ``[0, r)``, a sliding layer of window W its rows ``[r - W + 1, r)``."""
    reach = [(1, len(entry.ids))]
    for i, (kind, settings) in enumerate(entry.layers):
        if kind == "view":
            continue
        window = settings.get("window")
        layer = []
        for a, b in _intervals(entry.rows.get(i, [])):
            if a == 0:
                layer.append((1, b))
            elif window is not None and a + window - 1 <= b:
                layer.append((a + window - 1, b))
        reach = [(max(lo, x), min(hi, y)) for lo, hi in reach for x, y in layer if max(lo, x) <= min(hi, y)]
    return reach


def _subsumed(old: _Entry, new: _Entry) -> bool:
    """``old``'s prompt is a prefix of ``new``'s and ``new`` restores every position ``old`` restores."""
    n = len(old.ids)
    return (
        n <= len(new.ids)
        and np.array_equal(old.ids, new.ids[:n])
        and old.images == tuple(i for i in new.images if i.start < n)
        and old.switched_at == new.switched_at
        and all(any(x <= lo and hi <= y for x, y in new.reach) for lo, hi in old.reach)
    )


def _quantized(cache: list) -> bool:
    return any(c.codec.quantized for c in owning_caches(cache))


def _settings(state: dict) -> dict:
    return {k: v for k, v in state.items() if k not in ("keys", "values", "offset", "geometry", "ends_in_image")}
