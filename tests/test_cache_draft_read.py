"""The ``draft`` read (a Gemma 4 assistant's queries on its target's caches) against a dense float64 reference.

Random programs of writes (prefill chunks, decode runs that wrap the sliding storage many times),
trims (speculative rollbacks, after wraps too) and state round trips run on a cache and on
``DenseReference``; after every step a draft read with fresh queries must match explicit float64
attention over the positions the reference assistant attends: every stored position on full
layers, the newest ``window + 1`` on sliding layers. Quantized caches are compared against the
quantize-dequantize round trip of what they stored. The read must write nothing.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import KVCache, Read, RotatingKVCache, masks
from tests.dense_reference import DenseReference
from tests.test_cache_reads import D, Driver


def draft_reference(ref: DenseReference, q: np.ndarray, scale: float) -> np.ndarray:
    """Float64 attention of queries at position ``ref.offset`` over the positions a drafter sees."""
    N = ref.offset
    lo = 0 if ref.window is None else max(0, N - ref.window - 1)
    keys, values = ref.keys[:, :, lo:], ref.values[:, :, lo:]
    mask = np.ones((q.shape[0], q.shape[2], N - lo), dtype=bool)
    return DenseReference._attend(np.array(q, dtype=np.float64), keys, values, scale, mask)


class DraftDriver(Driver):
    def check_draft(self, tol: float) -> None:
        c = self.cache
        if not self.ref.offset:
            with pytest.raises(ValueError, match="no positions"):
                c.draft(self.qkv(1)[0], scale=self.scale)
            return
        L = int(self.rng.integers(1, 4))
        q = self.qkv(L)[0]
        before = (c.offset, c.stored, c._last)
        need = self.ref.offset if self.window is None else min(self.ref.offset, self.window + 1)
        if c.stored < need:
            with pytest.raises(ValueError, match="slack"):
                c.draft(q, scale=self.scale)
        else:
            got = Read.draft()(c, q, scale=self.scale)
            diff = float(np.max(np.abs(np.array(got, dtype=np.float64) - draft_reference(self.ref, q, self.scale))))
            assert diff < tol, f"draft L={L} at offset {self.ref.offset}: max |diff| {diff}"
            # A KV-shared view passes the read to its donor.
            shared = c.shared_view().draft(q, scale=self.scale)
            assert float(mx.max(mx.abs(shared - got))) == 0.0
        assert (c.offset, c.stored, c._last) == before, "draft must write nothing"

    def program(self, ops, tol=1e-5):
        self.check_draft(tol)
        for op, n in ops:
            super().program([(op, n)])
            self.check_draft(tol)


OPS = st.one_of(
    st.tuples(st.just("window"), st.integers(1, 20)),
    st.tuples(st.just("decode"), st.integers(1, 20)),
    st.tuples(st.just("trim"), st.integers(1, 8)),
    st.tuples(st.just("restore"), st.just(0)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.one_of(st.none(), st.integers(1, 9)),
    slack=st.integers(0, 6),
    step=st.integers(1, 8),
    B=st.sampled_from([1, 2]),
    Hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    Dv=st.sampled_from([D, 12]),
    seed=st.integers(0, 2**31 - 1),
    ops=st.lists(OPS, min_size=1, max_size=20),
)
def test_draft_read_matches_dense_reference(window, slack, step, B, Hkv, groups, Dv, seed, ops):
    DraftDriver(window, slack, step, B, Hkv, groups, Dv, 1.0, seed).program(ops)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.one_of(st.none(), st.integers(1, 9)),
    slack=st.integers(2, 6),
    step=st.integers(1, 8),
    quant=st.sampled_from([(4, 32, 32), (8, 64, 64)]),
    seed=st.integers(0, 2**31 - 1),
    ops=st.lists(OPS, min_size=1, max_size=15),
)
def test_draft_read_on_quantized_caches(window, slack, step, quant, seed, ops):
    bits, group_size, dim = quant
    run = DraftDriver(window, slack, step, 1, 2, 2, dim, dim**-0.5, seed, bits=bits, group_size=group_size, D=dim)
    run.program(ops)


@pytest.mark.parametrize("window", [3, 8])
def test_speculative_rounds_after_wraps_keep_the_draft_window(window):
    """Verify writes of k + 1 positions and rollbacks of up to k, for hundreds of positions: with
    a slack >= 2 and verify blocks no longer than the step (the defaults: slack 16, step 256) the
    drafter's ``window + 1`` positions are always stored. (A block longer than the free room keeps
    only ``window - 1 + slack`` positions, so a rollback of k after it needs slack >= k + 2.)"""
    run = DraftDriver(window, slack=2, step=9, B=1, Hkv=1, groups=2, Dv=D, scale=1.0, seed=window)
    run.write_read("window", 11)
    rng = np.random.default_rng(0)
    for _ in range(80):
        k = int(rng.integers(1, 9))
        run.write_read("window", k + 1)
        rejected = int(rng.integers(0, k + 1))
        if rejected:
            assert run.cache.can_trim(rejected)
            run.trim(rejected)
        assert run.cache.stored >= min(run.ref.offset, window + 1)
        run.check_draft(1e-5)


def test_draft_mask_is_the_flipped_inclusive_window():
    """Over a run wider than the drafter's window the mask keeps exactly ``[q - window - 1, q)``."""
    mask = masks.draft(10, 2, 3, 7, window=4)
    assert np.array(mask).tolist() == [[False, False, True, True, True, True, True]] * 2
    assert masks.draft(10, 1, 5, 5, window=4) is None
    assert masks.draft(10, 1, 0, 10, window=None) is None


def test_draft_read_refuses_keys_and_misfit_queries():
    cache = KVCache()
    x = mx.ones((1, 1, 3, D))
    cache.window(mx.ones((1, 2, 3, D)), x, x, scale=1.0)
    with pytest.raises(ValueError, match="takes only q"):
        cache.draft(mx.ones((1, 2, 1, D)), x, x, scale=1.0)
    with pytest.raises(ValueError, match="does not fit"):
        cache.draft(mx.ones((1, 2, 1, D + 1)), scale=1.0)
    with pytest.raises(ValueError, match="no positions"):
        RotatingKVCache(4).draft(mx.ones((1, 2, 1, D)), scale=1.0)
