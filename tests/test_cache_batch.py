"""Ragged batches (``cache.batch``) against the dense reference: rows at different positions, of
different storage kinds, joining and leaving between reads, with sliding windows that wrap.

Each row is a conversation with its own cache and its own ``DenseReference``; every batched read
must give each row exactly the answer the reference gives that row alone, and leave each row's
cache as the same read alone would (checked through the row's stored keys and values).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models  # noqa: F401  (loads the fast BLAS before MLX runs)
from cache import BatchCache, KVCache, RotatingKVCache, advance, batch_caches
from cache.batch import BatchSharedView
from zoo_cpu import backend, decode, extension
from tests.test_cache_reads import Driver

HKV, GROUPS, D, DV, SCALE = 2, 2, 32, 32, 0.2


class Batch:
    """Rows (each a one-row ``Driver``: cache + reference) read together through ``BatchCache``."""

    def __init__(self, window, seed):
        self.window = window
        self.rng = np.random.default_rng(seed)
        self.rows: list[Driver] = []

    def join(self, quantized: bool, prefill: int):
        row = Driver(self.window, 4, 8, 1, HKV, GROUPS, DV, SCALE, int(self.rng.integers(1 << 30)),
                     bits=8 if quantized else None, D=D)  # fmt: skip
        if prefill:
            row.write_read("window", prefill)  # alone, as the generator admits a request
        self.rows.append(row)

    def leave(self, index: int):
        if self.rows:
            self.rows.pop(index % len(self.rows))

    def read(self, read: str, L: int):
        rows = [r for r in self.rows if read != "canvas" or r.ref.offset]
        if read == "draft":
            rows = [r for r in rows if r.ref.offset and r.cache.stored >= min(r.ref.offset, (self.window or 0) + 1)]
        if not rows:
            return
        batch = BatchCache([r.cache for r in rows])
        assert batch.offset == tuple(r.ref.offset for r in rows)
        qkv = [r.qkv(L) for r in rows]
        q = mx.concatenate([x[0] for x in qkv])
        k = mx.concatenate([x[1] for x in qkv])
        v = mx.concatenate([x[2] for x in qkv])
        if read == "canvas":
            got = batch.canvas(q, k, v, scale=SCALE)
            for i, (r, (qi, ki, vi)) in enumerate(zip(rows, qkv)):
                r.compare(got[i : i + 1], r.ref.canvas(qi, r.stored(ki), r.stored(vi), SCALE), f"row {i} canvas")
            return
        if read == "draft":
            got = batch.draft(q, scale=SCALE)
            for i, (r, (qi, _, _)) in enumerate(zip(rows, qkv)):
                r.compare(got[i : i + 1], r.cache.draft(qi, scale=SCALE), f"row {i} draft")
            return
        blocks = [r.blocks(L) for r in rows] if read in ("vision_prefill", "encoder") else None
        args = (q, k, v) if blocks is None else (q, k, v, mx.concatenate(blocks))
        got = getattr(batch, read)(*args, scale=SCALE)
        shared = batch.shared_view()
        q2 = mx.concatenate([r.qkv(L)[0] for r in rows])
        got_shared = getattr(shared, read)(q2, scale=SCALE)
        for i, r in enumerate(rows):
            r.ref.write(r.stored(qkv[i][1]), r.stored(qkv[i][2]), None if blocks is None else np.array(blocks[i]))
            r.compare(got[i : i + 1], r.ref.attend_new(read, qkv[i][0], SCALE), f"row {i} {read} L={L}")
            r.compare(got_shared[i : i + 1], r.ref.attend_new(read, q2[i : i + 1], SCALE), f"row {i} shared {read}")
            r.check_invariants(after_write=L)


OPS = st.one_of(
    st.tuples(st.just("join"), st.booleans(), st.integers(0, 20)),
    st.tuples(st.just("leave"), st.integers(0, 7), st.just(0)),
    st.tuples(st.just("decode"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("window"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("vision_prefill"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("encoder"), st.integers(1, 12), st.just(0)),
    st.tuples(st.just("canvas"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("draft"), st.integers(1, 4), st.just(0)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.sampled_from([None, 3, 5]), seed=st.integers(0, 2**16), ops=st.lists(OPS, min_size=1, max_size=14))
def test_ragged_programs_match_each_row_alone(window, seed, ops):
    batch = Batch(window, seed)
    batch.join(False, 3)
    for op, a, b in ops:
        if op == "join":
            batch.join(a, b)
        elif op == "leave":
            batch.leave(a)
        elif op == "decode":
            for _ in range(a):
                batch.read("decode", 1)
        else:
            batch.read(op, a)


BACKENDS = {
    "decode kernels": backend.for_cpu(),
    "decode kernels off": replace(backend.for_cpu(), decode=False),  # GEMMA_ZOO_DECODE_KERNELS=0
    "accelerator plan": backend.MLX,
}


@pytest.mark.parametrize("plan", BACKENDS)
def test_rows_wrap_their_windows_on_their_own_schedule(plan):
    """Rows far apart (one past several wraps, one fresh) decode together, 40 steps."""
    with backend.using(BACKENDS[plan]):
        batch = Batch(4, 0)
        batch.join(False, 30)
        batch.join(True, 1)
        batch.join(False, 9)
        for _ in range(40):
            batch.read("decode", 1)
    assert [r.ref.offset for r in batch.rows] == [70, 41, 49]


@pytest.mark.skipif(not extension.available(), reason="the C++ extension is not built here")
@pytest.mark.parametrize("window", [None, 5])
def test_a_decode_read_attends_its_rows_in_one_call_per_storage(window, monkeypatch):
    """With the decode kernels, a batch's decode read (and its shared view's) attends every row
    of one storage layout in one kernel call, each row at its own offset (sliding rows past their
    window, quantized rows beside float ones, rows joining and leaving), each row exactly as alone."""
    calls = []
    rows_call = decode.attention_rows
    monkeypatch.setattr(decode, "attention_rows", lambda q, *args: calls.append(q.shape[0]) or rows_call(q, *args))
    with backend.using(backend.for_cpu()):
        batch = Batch(window, 1)
        for quantized, prefill in ((False, 3), (False, 17), (True, 9), (False, 1)):
            batch.join(quantized, prefill)
        for step in range(12):
            if step == 4:
                batch.leave(1)
            if step == 7:
                batch.join(True, 12)
            calls.clear()
            batch.read("decode", 1)
            layouts = Counter(r.cache.codec.layout for r in batch.rows)
            assert sorted(calls) == sorted(2 * list(layouts.values()))  # the owning read's and its shared view's


def test_batch_caches_groups_layers_and_shared_views():
    def conversation():
        full, sliding = KVCache(), RotatingKVCache(4)
        return [full, sliding, full.shared_view(), sliding.shared_view()]

    rows = [conversation(), conversation()]
    batch = batch_caches(rows)
    assert [type(c).__name__ for c in batch] == ["BatchCache", "BatchCache", "BatchSharedView", "BatchSharedView"]
    assert batch[2].donor is batch[0] and batch[3].donor is batch[1]
    assert batch[0].rows == [rows[0][0], rows[1][0]]
    specs = [c.spec(lambda d: next((i for i, x in enumerate(batch) if x is d), None)) for c in batch]
    assert [s.donor for s in specs] == [None, None, 0, 1]


def test_mismatched_rows_are_named():
    with pytest.raises(ValueError, match="share its type and window"):
        BatchCache([KVCache(), RotatingKVCache(4)])
    with pytest.raises(ValueError, match="share its type and window"):
        BatchCache([RotatingKVCache(4), RotatingKVCache(8)])
    with pytest.raises(ValueError, match="row 1 has 1 layer caches"):
        batch_caches([[KVCache(), KVCache()], [KVCache()]])
    with pytest.raises(ValueError, match="BatchCache: a batch needs at least one row"):
        BatchCache([])
    with pytest.raises(TypeError, match="BatchCache: row 1 must be an owning AttentionCache, got SharedView"):
        BatchCache([KVCache(), KVCache().shared_view()])
    with pytest.raises(TypeError, match="BatchSharedView: the donor must be a BatchCache, got KVCache"):
        BatchSharedView(KVCache())
    with pytest.raises(ValueError, match="batch_caches: no rows"):
        batch_caches([])
    full = KVCache()
    with pytest.raises(ValueError, match="layer 1 is a shared view in some rows and not in others"):
        batch_caches([[full, full.shared_view()], [KVCache(), KVCache()]])
    other, own = KVCache(), KVCache()
    with pytest.raises(ValueError, match="layer 1's shared views do not all read the same earlier layer of their row"):
        batch_caches([[own, own.shared_view()], [KVCache(), other.shared_view()]])
    batch = BatchCache([KVCache(), KVCache()])
    q = mx.zeros((3, 2, 1, 8))
    with pytest.raises(ValueError, match="batch's 2 rows"):
        batch.decode(q, q[:, :1], q[:, :1], scale=1.0)


def test_advance_moves_every_row():
    assert advance(5, 3) == 8
    assert advance((0, 7, 2), 1) == (1, 8, 3)
