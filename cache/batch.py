"""Ragged batches: one forward over rows that sit at different positions, on the shared cache.

A ``BatchCache`` is one layer's cache for a batch whose rows are independent conversations: row
``r`` is an ordinary owning cache (full, sliding, or a quantized twin) holding only that row's
positions, at that row's own offset. Every read splits the new queries, keys and values by row and
makes the same read on each row's cache, so each row's mask, window and storage are exactly those of
the row alone: no padding is ever stored, attended or counted by a window, a sliding row wraps on its
own schedule, and a row can join or leave between forwards without touching the others (its caches
are its own; ``batch_caches`` regroups them). The projections, MLPs and head, which read the weights,
run once for all rows; only the attention, which reads each row's own keys, runs per row. A decode
read (one query a row, the generator's step) writes each row's new position to the row's own cache,
then attends every row in one call where the decode kernels run: the kernel takes each row's run of
its own buffers in place, with no copy, padding or mask (``_attend_records``); elsewhere each row
attends alone.

``offset`` of a batch is a tuple of per-row offsets; RoPE takes it as per-row positions
(``graphs.layers.RoPE``) and ``advance`` moves it along.

Rows may bring different numbers of new positions to one forward (a batched prefill of ragged
prompt chunks): ``batch_caches(rows, new=...)`` makes the block ``max(new)`` wide with row ``r``'s
``new[r]`` positions at its end, after ``max(new) - new[r]`` padding positions. A read hands each
row's cache only that row's real queries, keys and values, so padding is never written, attended or
counted; its outputs are zeros, and the batch's ``offset`` starts each row's block that many
positions early so that its real positions get their own RoPE angles. With the padding in front,
every row's last position is the block's last (``last_only`` forwards need nothing more).
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from .attention import check_qkv, check_scale
from .base import AttentionCache, SharedView
from .spec import CacheSpec, kind_family


def advance(offset: int | tuple[int, ...], n: int) -> int | tuple[int, ...]:
    """``offset`` moved ``n`` positions on: an int for one conversation, a tuple for a batch's rows."""
    if isinstance(offset, tuple):
        return tuple(o + n for o in offset)
    return offset + n


def _split(x: mx.array | None, B: int, read: str, what: str) -> list:
    if x is None:
        return [None] * B
    if x.ndim < 1 or x.shape[0] != B:
        raise ValueError(f"{read}: {what} {tuple(x.shape)} does not have the batch's {B} rows on axis 0")
    return [x[r : r + 1] for r in range(B)]


def _real(x: mx.array | None, n: int) -> mx.array | None:
    """The last ``n`` positions (axis 2) of one row's block: its real ones after the padding."""
    return x if x is None or x.shape[2] == n else x[:, :, x.shape[2] - n :]


class _Rows:
    """The row-by-row reads shared by owning batches and their shared views."""

    rows: list
    new: tuple[int, ...] | None  # per row: new positions at the end of a ragged block (None: all of it)

    def _each(self, read: str, q, k, v, blocks=None, *, scale: float) -> mx.array:
        B = len(self.rows)
        qs, ks, vs = _split(q, B, read, "q"), _split(k, B, read, "k"), _split(v, B, read, "v")
        bs = [None] * B if blocks is None else _split(blocks, B, read, "blocks")
        if self.new is not None and blocks is not None:
            raise ValueError(f"{read}: a ragged batch takes text reads only; media positions are prefilled alone")
        outs = []
        for r, (row, qr, kr, vr, br) in enumerate(zip(self.rows, qs, ks, vs, bs)):
            width = qr.shape[2]
            if self.new is not None:  # a shared view's read may carry fewer queries than the block (the last ones)
                if kr is not None and kr.shape[2] != self.width:
                    raise ValueError(f"{read}: k {tuple(kr.shape)} is not the ragged block's {self.width} positions")
                n = min(width, self.new[r])
                qr, kr, vr = _real(qr, n), _real(kr, self.new[r]), _real(vr, self.new[r])
            args = (qr, kr, vr) if br is None else (qr, kr, vr, br)
            out = getattr(row, read)(*args, scale=scale)
            if out.shape[2] < width:
                pad = mx.zeros((*out.shape[:2], width - out.shape[2], *out.shape[3:]), dtype=out.dtype)
                out = mx.concatenate([pad, out], axis=2)
            outs.append(out)
        return outs[0] if B == 1 else mx.concatenate(outs, axis=0)

    @property
    def width(self) -> int | None:
        """The ragged block's width, ``max(new)`` (None when every row brings the whole block)."""
        return None if self.new is None else max(self.new)

    @property
    def offset(self) -> tuple[int, ...]:
        """Each row's consumed positions, less its padding in a ragged block: where its block starts."""
        if self.new is None:
            return tuple(row.offset for row in self.rows)
        return tuple(row.offset - (self.width - n) for row, n in zip(self.rows, self.new))

    @property
    def sliding_window(self) -> int | None:
        return self.rows[0].sliding_window

    def window(self, q, k=None, v=None, *, scale):
        return self._each("window", q, k, v, scale=scale)

    def vision_prefill(self, q, k=None, v=None, blocks=None, *, scale):
        return self._each("vision_prefill", q, k, v, blocks, scale=scale)

    def encoder(self, q, k=None, v=None, blocks=None, *, scale):
        return self._each("encoder", q, k, v, blocks, scale=scale)

    def canvas(self, q, k=None, v=None, *, scale):
        return self._each("canvas", q, k, v, scale=scale)

    def bidirectional(self, q, k=None, v=None, *, scale):
        return self._each("bidirectional", q, k, v, scale=scale)

    def draft(self, q, k=None, v=None, *, scale):
        return self._each("draft", q, k, v, scale=scale)


class BatchCache(_Rows):
    """One layer's owning cache for a ragged batch: ``rows[r]`` is row ``r``'s own cache."""

    def __init__(self, rows: Sequence[AttentionCache], new: Sequence[int] | None = None):
        rows = list(rows)
        if not rows:
            raise ValueError("BatchCache: a batch needs at least one row")
        for r, row in enumerate(rows):
            if not isinstance(row, AttentionCache):
                raise TypeError(f"BatchCache: row {r} must be an owning AttentionCache, got {type(row).__name__}")
        families = {kind_family(row.kind) for row in rows}
        windows = {row.sliding_window for row in rows}
        if len(families) > 1 or len(windows) > 1:
            raise ValueError(
                f"BatchCache: rows of one layer must share its type and window, got kinds "
                f"{[row.kind for row in rows]} and windows {[row.sliding_window for row in rows]}"
            )
        self.rows = rows
        self.new = _check_new(new, len(rows))

    @property
    def kind(self) -> str:
        return self.rows[0].kind

    def decode(self, q, k=None, v=None, *, scale):
        """Each row's new position written to its own cache, then every row's query attended in
        one call where the decode kernels run (``_attend_records``)."""
        if self.new is not None:
            return self._each("decode", q, k, v, scale=scale)
        check_qkv("decode", q, k, v)
        B = len(self.rows)
        ks, vs = _split(k, B, "decode", "k"), _split(v, B, "decode", "v")
        records = [row.write_decode(kr, vr, scale=scale) for row, kr, vr in zip(self.rows, ks, vs)]
        return _attend_records(q, [row.codec for row in self.rows], records, check_scale("decode", scale))

    def spec(self, index_of: Callable[[object], int | None] | None = None) -> CacheSpec:
        return self.rows[0].spec(index_of)

    def shared_view(self) -> "BatchSharedView":
        return BatchSharedView(self)


class BatchSharedView(_Rows):
    """A KV-shared layer's cache for a batch: each row's view of that row's donor."""

    def __init__(self, donor: BatchCache):
        if not isinstance(donor, BatchCache):
            raise TypeError(f"BatchSharedView: the donor must be a BatchCache, got {type(donor).__name__}")
        self.donor = donor
        self.rows = [SharedView(row) for row in donor.rows]
        self.new = donor.new

    @property
    def kind(self) -> str:
        return f"shared:{self.donor.kind}"

    def decode(self, q, k=None, v=None, *, scale):
        """Each row's donor record of this forward replayed with the row's query, every row in
        one call where the decode kernels run (``_attend_records``)."""
        if self.new is not None:
            return self._each("decode", q, k, v, scale=scale)
        B = len(self.rows)
        qs = _split(q, B, "decode", "q")
        records = [view.recorded("decode", qr, k, v, scale) for view, qr in zip(self.rows, qs)]
        return _attend_records(q, [row.codec for row in self.donor.rows], records, check_scale("decode", scale))

    def spec(self, index_of: Callable[[object], int | None] | None = None) -> CacheSpec:
        return CacheSpec(self.kind, self.sliding_window, None if index_of is None else index_of(self.donor))


def _attend_records(q: mx.array, codecs: list, records: list, scale: float) -> mx.array:
    """Row ``r`` of ``q`` attended over ``records[r]`` (its cache's record of the read: keys,
    values and mask, as its read alone attends them). Rows whose record is a run of their cache's
    buffers, unmasked, go in one call per storage layout (``Codec.attend_rows``: the decode kernels'
    rows form, reading each row's run in place); the others, and every row where that call does
    not run (``GEMMA_ZOO_DECODE_KERNELS=0``, the accelerator plan), attend alone as ``decode`` does."""
    groups: dict = {}
    for r, (codec, record) in enumerate(zip(codecs, records)):
        together = record.buffers is not None and record.mask is None
        groups.setdefault(codec.layout if together else None, []).append(r)
    order, outs = [], []
    for layout, members in groups.items():
        out = None
        if layout is not None:
            rows_q = q if len(members) == len(records) else q[mx.array(members)]
            out = codecs[members[0]].attend_rows(rows_q, [records[r].buffers for r in members], scale)
        if out is None:
            alone = [codecs[r].attend(q[r : r + 1], records[r].keys, records[r].values, scale, records[r].mask) for r in members]
            out = alone[0] if len(alone) == 1 else mx.concatenate(alone, axis=0)
        order += members
        outs.append(out)
    if len(outs) == 1:
        return outs[0]
    out = mx.concatenate(outs, axis=0)
    return out[mx.array(sorted(range(len(order)), key=order.__getitem__))]


def _check_new(new: Sequence[int] | None, B: int) -> tuple[int, ...] | None:
    if new is None:
        return None
    new = tuple(new)
    if len(new) != B or not all(isinstance(n, int) and n >= 1 for n in new):
        raise ValueError(f"batch_caches: new must give each of the {B} rows a count of new positions >= 1, got {new}")
    return None if len(set(new)) == 1 else new


def batch_caches(row_caches: Sequence[list], new: Sequence[int] | None = None) -> list:
    """One layer list for a batch from each row's own layer list (as ``make_cache()`` made it, in
    row order): owning layers become ``BatchCache``, KV-shared layers ``BatchSharedView`` of their
    donor's batch. The rows' caches are used in place, so a forward on the batch advances each
    row's own list, which stays usable alone (to continue alone, to snapshot or to save).
    ``new``: each row's count of new positions in the next forward, for a ragged block (module
    docstring); the list serves that one forward."""
    row_caches = [list(c) for c in row_caches]
    if not row_caches:
        raise ValueError("batch_caches: no rows")
    layers = len(row_caches[0])
    for r, caches in enumerate(row_caches):
        if len(caches) != layers:
            raise ValueError(f"batch_caches: row {r} has {len(caches)} layer caches, row 0 has {layers}")
    batch: list = []
    for i in range(layers):
        column = [caches[i] for caches in row_caches]
        shared = [isinstance(c, SharedView) for c in column]
        if any(shared):
            if not all(shared):
                raise ValueError(f"batch_caches: layer {i} is a shared view in some rows and not in others")
            donors = [next((j for j in range(i) if caches[j] is c.donor), None) for caches, c in zip(row_caches, column)]
            if None in donors or len(set(donors)) != 1:
                raise ValueError(f"batch_caches: layer {i}'s shared views do not all read the same earlier layer of their row")
            batch.append(batch[donors[0]].shared_view())
        else:
            batch.append(BatchCache(column, new))
    return batch
