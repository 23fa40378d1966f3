"""The read contract every KV cache implements; storage layouts live in the subclasses.

A read receives the new queries, keys and values of one attention (already normed and rotated),
writes what the read says it writes, builds the mask from absolute positions (``cache.masks``) and
returns the attention output. ``draft`` (a Gemma 4 assistant's queries on its target's cache)
writes nothing and reads the stored positions in place. Subclasses provide only the storage: ``_append`` (write the new rows
and return the contiguous run of positions the new queries may need), ``_canvas_keys`` (the same
for a block that is not written) and the trim/state plumbing.

Reads that write record what they attended (keys, values and mask), so that a KV-shared layer can
make the same read through ``shared_view()`` in the same forward without recomputing or writing
anything. The record is dropped at the donor's next read, trim or restore, so it never pins an old
buffer (which would stop MLX from updating the buffer in place).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from . import masks
from .attention import check_blocks, check_qkv, check_query, check_scale
from .codecs import Dense, Planes
from .spec import CacheSpec


class MediaSplitError(ValueError):
    """A read that starts inside a media span (image, video frame, audio clip) where the stored
    positions end inside one: the span was cut across two reads, which the reference never does
    (an image's or frame's keys depend on the whole span on sliding layers; a clip's features are
    placed whole)."""


class Shaped(NamedTuple):
    """The shape and dtype of new keys or values, all that growing a buffer needs of them (a decode
    step compiled whole makes room before its keys exist)."""

    shape: tuple
    dtype: mx.Dtype


class DecodeRun(NamedTuple):
    """One layer's next decode position, for a step compiled whole: the planes it writes into, the
    row it is written at, and the ``size`` rows from ``start`` its query reads (rows past the new
    one are masked; ``cache.positioned``)."""

    keys: Planes
    values: Planes
    write_row: int
    start: int
    size: int

    @property
    def masked(self) -> bool:
        """The read spans rows past the new position (not yet written)."""
        return self.start + self.size > self.write_row + 1


class Attended(NamedTuple):
    """What one writing read attended: replayed by a shared view with its own queries."""

    read: str
    length: int
    offset: int
    keys: Planes
    values: Planes
    mask: object
    geometry: tuple  # (B, Hkv, D, Dv, dtype) of the keys and values attended
    run: tuple | None = None  # (start, size): keys and values are whole planes, read from row start
    # (key planes, value planes, first row, rows): keys and values as a run of the cache's whole
    # buffers, where they are one (a batch attends its rows' runs in one call: cache.batch)
    buffers: tuple | None = None


class AttentionCache:
    """Base of every cache. ``sliding_window`` is None on full-attention layers."""

    kind: str = ""
    sliding_window: int | None = None

    def __init__(self, codec=None) -> None:
        self.codec = codec or Dense()
        # Planes [B, Hkv, capacity, ...]; rows [0, _rows) hold positions in temporal order.
        self.keys: Planes | None = None
        self.values: Planes | None = None
        self._geometry: tuple | None = None  # (B, Hkv, D, Dv, dtype) of what is stored
        self._rows = 0
        self.offset = 0
        self._ends_in_image: list[bool] | None = None  # per row: the last stored position belongs to an image
        self._last: Attended | None = None

    # ----------------------------------------------------------------------------------------- reads
    def decode(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """One new position per row (L = 1), appended; it sees its row's stored positions within the window."""
        check_qkv("decode", q, k, v)
        if q.shape[2] != 1:
            raise ValueError(f"decode: takes exactly L=1 new position, got L={q.shape[2]} (use window for more)")
        return self._write_and_attend("decode", q, k, v, scale, lambda qs, L, ks, T: masks.causal(qs, L, ks, T, self.sliding_window))

    def window(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """L >= 1 new positions, appended: causal within the block and over the stored history,
        window-limited on sliding layers. For prefill chunks, prefill tails and speculative verify."""
        check_qkv("window", q, k, v)
        return self._write_and_attend("window", q, k, v, scale, lambda qs, L, ks, T: masks.causal(qs, L, ks, T, self.sliding_window))

    def vision_prefill(self, q: mx.array, k: mx.array, v: mx.array, blocks, *, scale: float) -> mx.array:
        """Gemma 4 prefill of a prompt with images, appended.

        ``blocks [B, L]`` is each new position's block: an index >= 0 for a span with the
        bidirectional overlay (an image or video frame), -1 for text, <= -2 for a media span
        attended causally (audio, or any media of a config without vision bidirectionality).
        Sliding layers: ``(causal OR same block >= 0) AND window``; full layers: causal. A media
        span is never split across two reads: the caller must keep every span inside one read, and
        a read that starts inside a span right where the stored positions end inside one raises
        ``MediaSplitError``.
        """
        check_qkv("vision_prefill", q, k, v)
        blocks = self._check_image_blocks("vision_prefill", blocks, q)
        out = self._write_and_attend(
            "vision_prefill", q, k, v, scale, lambda qs, L, ks, T: masks.vision_prefill(qs, L, ks, T, blocks, self.sliding_window)
        )
        self._ends_in_image = [bool(b) for b in np.array(blocks[:, -1] != -1)]
        return out

    def encoder(self, q: mx.array, k: mx.array, v: mx.array, blocks, *, scale: float) -> mx.array:
        """DiffusionGemma's encoder read, appended: full layers ``causal OR same image``; sliding layers
        ``(causal AND window) OR same image``, the image overlay not limited by the window. ``blocks``
        as in ``vision_prefill``, with the same rule that an image is never split across reads."""
        check_qkv("encoder", q, k, v)
        blocks = self._check_image_blocks("encoder", blocks, q)
        out = self._write_and_attend(
            "encoder", q, k, v, scale, lambda qs, L, ks, T: masks.encoder(qs, L, ks, T, blocks, self.sliding_window)
        )
        self._ends_in_image = [bool(b) for b in np.array(blocks[:, -1] != -1)]
        return out

    def bidirectional(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """A whole sequence at once, appended, into an empty cache: every position sees every other;
        on sliding layers only those with ``|q - k| <= window``. For Gemma 4 configs with
        ``use_bidirectional_attention="all"`` (encoders), which have no incremental use."""
        check_qkv("bidirectional", q, k, v)
        if self.offset:
            raise ValueError(f"bidirectional: needs an empty cache, this one holds {self.offset} positions")
        return self._write_and_attend(
            "bidirectional", q, k, v, scale, lambda qs, L, ks, T: masks.bidirectional(qs, L, ks, T, self.sliding_window)
        )

    def canvas(self, q: mx.array, k: mx.array, v: mx.array, *, scale: float) -> mx.array:
        """DiffusionGemma's decoder read; writes nothing. Bidirectional over the stored history
        (sliding: the newest ``min(stored, window - 1)`` positions; full: all) followed by the block."""
        check_qkv("canvas", q, k, v)
        scale = check_scale("canvas", scale)
        self._check_compatible("canvas", k, v)
        self._last = None
        keys, values = self._canvas_keys(self.codec.pack(k), self.codec.pack(v), k, v)
        self._last = Attended("canvas", q.shape[2], self.offset, keys, values, None, _geometry(k, v))
        return self.codec.attend(q, keys, values, scale, None)

    def draft(self, q: mx.array, k=None, v=None, *, scale: float) -> mx.array:
        """A drafter's queries (a Gemma 4 assistant) on this target cache; writes nothing.

        Every query sits at the next position (``offset``, not yet stored) and sees stored keys
        only: all of them on full layers, the newest ``window + 1`` on sliding layers (the
        reference assistant's flipped, inclusive sliding mask; ``masks.draft``). The keys are read
        where they are stored (quantized ones too), never copied. Raises ``ValueError`` when the
        cache is empty, when ``k``/``v`` are given, when ``q`` does not fit the stored keys, or when
        a sliding cache keeps fewer than ``window + 1`` positions (a slack below 2).
        """
        if k is not None or v is not None:
            raise ValueError("draft: takes only q; the keys and values are the ones this cache stores")
        check_query("draft", "q", q)
        scale = check_scale("draft", scale)
        if self.keys is None or not self.offset:
            raise ValueError("draft: the cache holds no positions to read (prefill the target first)")
        B, Hkv, D, _, dtype = self._geometry
        if q.shape[0] != B or q.shape[1] % Hkv or q.shape[3] != D or q.dtype != dtype:
            raise ValueError(
                f"draft: q {tuple(q.shape)} of {q.dtype} does not fit the stored keys [B={B}, Hkv={Hkv}, *, D={D}] "
                f"of {dtype} (q needs the same B, D and dtype, and a multiple of Hkv heads)"
            )
        n = self._rows
        need = n if self.sliding_window is None else min(self.offset, self.sliding_window + 1)
        if n < need:
            raise ValueError(
                f"draft: a drafter reads the newest {need} positions of this sliding cache (window "
                f"{self.sliding_window} + 1), but only {n} are stored; make the cache with slack >= 2"
            )
        keys, values = rows(self.keys, n - need, n), rows(self.values, n - need, n)
        mask = masks.draft(self.offset, q.shape[2], self.offset - need, need, self.sliding_window)
        return self.codec.attend(q, keys, values, scale, mask)

    def write_decode(self, k: mx.array, v: mx.array, *, scale: float) -> Attended:
        """The ``decode`` read without its attention: the new position stored and the read recorded
        (for shared views) as ``decode`` records it; the caller attends the record (a batch
        attends all its rows' records in one call: ``cache.batch``). ``k``/``v`` ``[B, Hkv, 1, D]``."""
        if k.shape[2] != 1:
            raise ValueError(f"decode: takes exactly L=1 new position, got L={k.shape[2]} (use window for more)")
        return self._write("decode", 1, k, v, scale, lambda qs, L, ks, T: masks.causal(qs, L, ks, T, self.sliding_window))

    # ------------------------------------------------------------------------------- shared layers
    def shared_view(self) -> "SharedView":
        """A view for KV-shared layers: the same reads, on what this cache attended in its last read."""
        return SharedView(self)

    def spec(self, index_of: Callable[[object], int | None] | None = None) -> CacheSpec:
        """What this cache is, for ``check_caches``: its kind and window (``index_of`` is used only
        by shared views, to find their donor in a cache list)."""
        return CacheSpec(self.kind, self.sliding_window)

    # ---------------------------------------------------------------------- compiled decode steps
    def decode_run(self) -> DecodeRun | None:
        """Host side of a decode step compiled whole (``cache.positioned``): make room for one more
        position (growing or compacting the buffer here, outside the compiled function) and say
        where it is written and which fixed-length run of rows its query reads. None while the
        cache holds no positions (the first one is never a compiled step's)."""
        if self.keys is None or not self._rows:
            return None
        B, Hkv, D, Dv, dtype = self._geometry
        write_row, size = self._decode_room(Shaped((B, Hkv, 1, D), dtype), Shaped((B, Hkv, 1, Dv), dtype))
        return DecodeRun(self.keys, self.values, write_row, max(0, write_row + 1 - size), size)

    def commit_decode(self, keys: Planes, values: Planes) -> None:
        """Take the planes a compiled decode step wrote (one position more, at ``decode_run``'s row)."""
        self.keys, self.values = tuple(keys), tuple(values)
        self._rows += 1
        self.offset += 1
        self._last = None
        self._ends_in_image = None

    def _decode_room(self, like_k: Shaped, like_v: Shaped) -> tuple[int, int]:
        """Subclass hook: room for one position; ``(row it is written at, rows a decode read spans)``."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------ bookkeeping
    @property
    def stored(self) -> int:
        """Positions held in storage (the newest ones)."""
        return self._rows

    def temporal(self) -> tuple[mx.array, mx.array] | tuple[None, None]:
        """The stored keys and values, oldest first: the newest ``stored`` positions (dequantized
        from a quantized cache)."""
        if self.keys is None:
            return None, None
        n = self._rows
        return self.codec.unpack(rows(self.keys, 0, n)), self.codec.unpack(rows(self.values, 0, n))

    @property
    def nbytes(self) -> int:
        """Bytes of storage allocated now."""
        if self.keys is None:
            return 0
        return sum(p.nbytes for p in self.keys + self.values)

    @property
    def bytes_per_token(self) -> int:
        """Storage one more position costs, or 0 where storage does not grow with the sequence."""
        raise NotImplementedError

    def can_trim(self, n: int) -> bool:
        raise NotImplementedError

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` positions exactly, or raise ``ValueError`` (never a partial trim)."""
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"trim: n must be a non-negative int, got {n!r}")
        if not self.can_trim(int(n)):
            raise ValueError(self._trim_refusal(int(n)))
        self._last = None
        self._rows -= int(n)
        self.offset -= int(n)
        self._ends_in_image = None
        return int(n)

    def _trim_refusal(self, n: int) -> str:
        return f"trim: cannot drop {n} positions; {self.offset} consumed, {self._rows} stored"

    @property
    def state(self) -> dict:
        """Everything needed to continue exactly: the stored planes as stored (no re-quantization),
        their geometry, every position counter and the constructor settings."""
        n = self._rows
        return {
            "kind": self.kind,
            "offset": self.offset,
            "keys": None if self.keys is None else rows(self.keys, 0, n),
            "values": None if self.values is None else rows(self.values, 0, n),
            "geometry": self._geometry,
            "ends_in_image": self._ends_in_image,
            **self._config(),
        }

    @classmethod
    def from_state(cls, state: dict) -> "AttentionCache":
        """Rebuild a cache from its ``state``. Everything is checked before the cache is returned:
        a state that is not a dict, of another kind, missing an entry, with settings or counters of
        the wrong type, planes that disagree in shape or with the settings, a stored geometry that
        does not match the planes, or counters the layout cannot produce raises ``ValueError``."""
        if not isinstance(state, dict):
            raise ValueError(f"from_state: state must be a dict (a cache's .state), got {type(state).__name__}")
        kind = state.get("kind")
        if kind != cls.kind:
            raise ValueError(f"from_state: state is of kind {kind!r}, expected {cls.kind!r}")
        missing = [name for name in ("offset", "keys", "values", *cls._config_names()) if name not in state]
        if missing:
            raise ValueError(f"from_state: the {kind!r} state lacks {missing}")
        where = f"from_state ({kind!r})"
        for name in ("offset", *cls._config_names()):
            value = state[name]
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
        offset = int(state["offset"])
        if offset < 0:
            raise ValueError(f"{where}: offset must be >= 0, got {offset}")
        cache = cls(**{name: int(state[name]) for name in cls._config_names()})  # checks the settings
        keys, values = state["keys"], state["values"]
        geometry = ends = None
        stored = 0
        if (keys is None) != (values is None):
            raise ValueError(f"{where}: keys and values must both be stored or both be None")
        if keys is not None:
            keys, (B, Hkv, stored, D, dtype) = cache.codec.check_planes(where, "keys", keys)
            values, (Bv, Hv, stored_v, Dv, dtype_v) = cache.codec.check_planes(where, "values", values)
            if (Bv, Hv, stored_v, dtype_v) != (B, Hkv, stored, dtype):
                raise ValueError(
                    f"{where}: keys hold [B, Hkv, rows] = {[B, Hkv, stored]} of {dtype}, "
                    f"values {[Bv, Hv, stored_v]} of {dtype_v}"
                )
            geometry = (B, Hkv, D, Dv, dtype)
            given = state.get("geometry")
            if given is not None and (not isinstance(given, (tuple, list)) or tuple(given) != geometry):
                raise ValueError(f"{where}: geometry {given!r} does not match the stored planes' {geometry}")
            ends = state.get("ends_in_image")
            if ends is not None and (
                not isinstance(ends, (list, tuple)) or len(ends) != B or not all(isinstance(e, (bool, np.bool_)) for e in ends)
            ):
                raise ValueError(f"{where}: ends_in_image must be None or {B} bools (one per row), got {ends!r}")
        elif state.get("ends_in_image") is not None:
            raise ValueError(f"{where}: ends_in_image is set on a state with no stored positions")
        problem = cache._count_problem(stored, offset)
        if problem:
            raise ValueError(f"{where}: {problem}")
        cache.keys, cache.values = keys, values
        cache._geometry, cache._rows, cache.offset = geometry, stored, offset
        cache._ends_in_image = None if ends is None else [bool(e) for e in ends]
        return cache

    def _count_problem(self, stored: int, offset: int) -> str | None:
        """Why ``stored`` rows after ``offset`` consumed positions cannot be this layout's, or None."""
        if stored > offset:
            return f"{stored} stored positions exceed the offset {offset}"
        return None

    # ------------------------------------------------------------------------------- internals
    def _write_and_attend(self, read, q, k, v, scale, make_mask) -> mx.array:
        last = self._write(read, q.shape[2], k, v, scale, make_mask)
        return self.codec.attend(q, last.keys, last.values, check_scale(read, scale), last.mask)

    def _write(self, read, L, k, v, scale, make_mask) -> Attended:
        """Store the new positions and record the read of their ``L`` queries over them."""
        check_scale(read, scale)
        self._check_compatible(read, k, v)
        self._last = None
        self._ends_in_image = None
        q_start = self.offset
        if self._geometry is None:
            self._geometry = _geometry(k, v)
        keys, values, k_start, run = self._append(self.codec.pack(k), self.codec.pack(v), k, v)
        self.offset += k.shape[2]
        mask = make_mask(q_start, L, k_start, keys[0].shape[2])
        buffers = None if run is None else (self.keys, self.values, *run)
        self._last = Attended(read, L, self.offset, keys, values, mask, self._geometry, buffers=buffers)
        return self._last

    def _check_compatible(self, read: str, k: mx.array, v: mx.array) -> None:
        self.codec.check(read, k, v)
        if self._geometry is None:
            return
        B, Hkv, D, Dv, dtype = self._geometry
        checks = (
            ("batch size", B, k.shape[0]),
            ("kv heads", Hkv, k.shape[1]),
            ("k head dim", D, k.shape[3]),
            ("v head dim", Dv, v.shape[3]),
        )
        for what, expected, got in checks:
            if expected != got:
                raise ValueError(
                    f"{read}: {what} {got} does not match the cache's {expected}: new k {tuple(k.shape)}, "
                    f"v {tuple(v.shape)}; stored k [{B}, {Hkv}, *, {D}], v [{B}, {Hkv}, *, {Dv}]"
                )
        if k.dtype != dtype:
            raise ValueError(f"{read}: k dtype {k.dtype} does not match the cache's {dtype}")

    def _check_image_blocks(self, read: str, blocks, q: mx.array) -> mx.array:
        blocks = check_blocks(read, blocks, q.shape[0], q.shape[2])
        if self._ends_in_image and self._rows:
            starts_in_image = np.array(blocks[:, 0] != -1)
            for row, (ended, starts) in enumerate(zip(self._ends_in_image, starts_in_image)):
                if ended and starts:
                    raise MediaSplitError(
                        f"{read}: row {row} starts inside an image, video frame or audio clip where the "
                        "stored positions end inside one; a span must be given in a single read"
                    )
        return blocks

    def _new_planes(self, like_k: mx.array, like_v: mx.array, n: int) -> tuple[Planes, Planes]:
        return self.codec.zeros(like_k, n), self.codec.zeros(like_v, n)

    # subclass hooks: storage layout, on planes
    def _append(self, k: Planes, v: Planes, raw_k: mx.array, raw_v: mx.array) -> tuple[Planes, Planes, int, tuple | None]:
        """Store the new positions; return the run of positions their queries may see, its start
        position and, where that run is rows of ``keys``/``values`` as they now are, ``(first row,
        rows)`` (else None)."""
        raise NotImplementedError

    def _canvas_keys(self, k: Planes, v: Planes, raw_k: mx.array, raw_v: mx.array) -> tuple[Planes, Planes]:
        raise NotImplementedError

    def _config(self) -> dict:
        return {name: getattr(self, name) for name in self._config_names()}

    @classmethod
    def _config_names(cls) -> tuple[str, ...]:
        return ()


def same_offset(a, b) -> bool:
    """Whether two offsets are the same positions: ints (and per-row tuples) by value; an array
    offset (one per forward of a compiled decode step) only as the same object."""
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return a is b
    return a == b


def _geometry(k: mx.array, v: mx.array) -> tuple:
    """``(B, Hkv, D, Dv, dtype)`` of new keys and values."""
    return (k.shape[0], k.shape[1], k.shape[3], v.shape[3], k.dtype)


def rows(planes: Planes, start: int, stop: int) -> Planes:
    return tuple(p[..., start:stop, :] for p in planes)


def concat(a: Planes, b: Planes) -> Planes:
    return tuple(mx.concatenate([x, y], axis=2) for x, y in zip(a, b))


def write_rows(planes: Planes, start: int, new: Planes) -> None:
    """In place (MLX updates the buffer without a copy when nothing else holds it)."""
    for p, x in zip(planes, new):
        p[..., start : start + x.shape[2], :] = x


class SharedView:
    """A KV-shared layer's cache: the donor's reads on what the donor attended, writing nothing.

    Gemma 4's last ``num_kv_shared_layers`` layers reuse the keys and values of the last earlier
    layer of the same type, from the same forward, after that layer's write. The view replays the
    donor's last read (same keys, values and mask) with the shared layer's queries. It must be read
    after the donor's read of the same forward; a stale or mismatched read raises ``ValueError``.
    Its queries may be only the newest of the donor's positions (a shared tail that needs only the
    last outputs skips the rest). It owns no storage: trims and persistence go to the donor.
    """

    def __init__(self, donor: AttentionCache):
        if isinstance(donor, SharedView):
            raise ValueError(
                "SharedView: the donor is itself a shared view (it owns no keys and values and records "
                "no reads); make the view from its donor cache instead"
            )
        if not isinstance(donor, AttentionCache):
            raise TypeError(f"SharedView: the donor must be an AttentionCache, got {type(donor).__name__}")
        self.donor = donor

    @property
    def kind(self) -> str:
        return f"shared:{self.donor.kind}"

    @property
    def offset(self) -> int:
        return self.donor.offset

    @property
    def sliding_window(self) -> int | None:
        return self.donor.sliding_window

    nbytes = 0
    bytes_per_token = 0

    def shared_view(self) -> "SharedView":
        """Refused: a view of a view would hide which cache owns the keys (and ``quantize_caches``
        repoints only views of owning caches); make another view of the donor instead."""
        raise ValueError(
            f"shared_view: this is already a shared view (of a {self.donor.kind!r} cache); "
            "call shared_view() on its donor cache instead"
        )

    def spec(self, index_of: Callable[[object], int | None] | None = None) -> CacheSpec:
        """For ``check_caches``: the donor's window and its index given by ``index_of`` (None when
        the donor is not in the list, or without ``index_of``)."""
        return CacheSpec(self.kind, self.sliding_window, None if index_of is None else index_of(self.donor))

    def _replay(self, read: str, q: mx.array, k, v, scale) -> mx.array:
        last = self.recorded(read, q, k, v, scale)
        scale = check_scale(read, scale)
        if last.run is not None:
            return self.donor.codec.attend_run(q, last.keys, last.values, *last.run, scale, last.mask)
        return self.donor.codec.attend(q, last.keys, last.values, scale, last.mask)

    def recorded(self, read: str, q: mx.array, k, v, scale) -> Attended:
        """The donor's record of this forward's ``read`` that ``q`` replays, its mask cut to
        ``q``'s rows; ``ValueError`` when there is none or ``q`` does not fit it (a batch replays
        its rows' records in one call: ``cache.batch``)."""
        if k is not None or v is not None:
            raise ValueError(f"{read}: a shared view takes only q; its keys and values come from the donor")
        check_query(read, "q", q)
        scale = check_scale(read, scale)
        last = self.donor._last
        if last is None or not same_offset(last.offset, self.donor.offset):
            raise ValueError(f"{read}: the donor cache has no read in this forward to share")
        if last.read != read or not 1 <= q.shape[2] <= last.length:
            raise ValueError(
                f"{read}: the donor's last read was {last.read} of L={last.length}; "
                f"this shared read is {read} of L={q.shape[2]}"
            )
        B, Hkv, D, _, dtype = last.geometry
        if q.shape[0] != B or q.shape[1] % Hkv or q.shape[3] != D or q.dtype != dtype:
            raise ValueError(
                f"{read}: q {tuple(q.shape)} of {q.dtype} does not fit the donor's keys [B={B}, Hkv={Hkv}, *, D={D}] "
                f"of {dtype} (q needs the same B, D and dtype, and a multiple of Hkv heads)"
            )
        mask = last.mask
        if q.shape[2] < last.length and isinstance(mask, mx.array):
            # Queries for only the newest positions (a KV-shared tail that needs just the last
            # outputs): their rows of the donor's mask. None and MLX's bottom-right "causal" hold as is.
            mask = mask[..., -q.shape[2] :, :]
        return last._replace(mask=mask)

    def decode(self, q, k=None, v=None, *, scale):
        return self._replay("decode", q, k, v, scale)

    def window(self, q, k=None, v=None, *, scale):
        return self._replay("window", q, k, v, scale)

    def vision_prefill(self, q, k=None, v=None, blocks=None, *, scale):
        return self._replay("vision_prefill", q, k, v, scale)

    def encoder(self, q, k=None, v=None, blocks=None, *, scale):
        return self._replay("encoder", q, k, v, scale)

    def canvas(self, q, k=None, v=None, *, scale):
        return self._replay("canvas", q, k, v, scale)

    def bidirectional(self, q, k=None, v=None, *, scale):
        return self._replay("bidirectional", q, k, v, scale)

    def draft(self, q, k=None, v=None, *, scale):
        """A drafter's read goes to the donor (it reads stored positions, not a replayed forward)."""
        return self.donor.draft(q, k, v, scale=scale)

    def can_trim(self, n: int) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise ValueError("trim: a shared view owns no storage; trim its donor cache instead")
