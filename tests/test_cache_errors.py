"""Bad input to a cache raises ValueError naming the argument and both values, and changes nothing."""

from __future__ import annotations

import mlx.core as mx
import pytest

from cache import KVCache, RotatingKVCache, cache_from_state

D = 8


def arrays(B=1, Hq=2, Hkv=1, L=3, Dq=D, Dk=D, Dv=D, dtype=mx.float32):
    return (
        mx.zeros((B, Hq, L, Dq), dtype=dtype),
        mx.zeros((B, Hkv, L, Dk), dtype=dtype),
        mx.zeros((B, Hkv, L, Dv), dtype=dtype),
    )


def primed(kind):
    cache = KVCache(step=4) if kind == "full" else RotatingKVCache(4, slack=2, step=4)
    cache.window(*arrays(L=5), scale=1.0)
    return cache


def snapshot(cache):
    keys, values = cache.temporal()
    return cache.offset, cache.stored, cache.nbytes, mx.array(keys), mx.array(values)


BAD_CALLS = [
    ("rank", lambda c: c.window(mx.zeros((2, 3, D)), *arrays()[1:], scale=1.0), "rank 4"),
    ("kv heads", lambda c: c.window(*arrays(Hq=3, Hkv=2), scale=1.0), "multiple of kv heads"),
    ("v heads", lambda c: c.window(arrays()[0], arrays()[1], mx.zeros((1, 2, 3, D)), scale=1.0), "v has 2 kv heads"),
    ("head dim", lambda c: c.window(*arrays(Dk=4), scale=1.0), "k head dim 4 must equal q head dim 8"),
    ("cache head dim", lambda c: c.window(*arrays(Dq=4, Dk=4), scale=1.0), "k head dim 4 does not match the cache's 8"),
    ("cache kv heads", lambda c: c.window(*arrays(Hq=2, Hkv=2), scale=1.0), "kv heads 2 does not match the cache's 1"),
    ("cache v dim", lambda c: c.window(*arrays(Dv=4), scale=1.0), "v head dim 4 does not match the cache's 8"),
    ("batch", lambda c: c.window(*arrays(B=2), scale=1.0), "batch size 2 does not match the cache's 1"),
    ("length", lambda c: c.window(arrays(L=2)[0], *arrays()[1:], scale=1.0), "L=3"),
    ("decode L", lambda c: c.decode(*arrays(L=3), scale=1.0), "exactly L=1"),
    ("dtype", lambda c: c.window(*arrays(dtype=mx.float16), scale=1.0), "dtype"),
    ("blocks shape", lambda c: c.vision_prefill(*arrays(), mx.zeros((1, 2), dtype=mx.int32), scale=1.0), r"\[B, L\] = \[1, 3\]"),
    ("blocks dtype", lambda c: c.encoder(*arrays(), mx.zeros((1, 3)), scale=1.0), "integer"),
    ("scale", lambda c: c.window(*arrays(), scale=None), "scale"),
    ("trim past stored", lambda c: c.trim(6), "trim"),
    ("trim negative", lambda c: c.trim(-1), "non-negative"),
    ("canvas shape", lambda c: c.canvas(*arrays(Dk=4), scale=1.0), "head dim"),
]


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("name,call,message", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(kind, name, call, message):
    cache = primed(kind)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=message):
        call(cache)
    after = snapshot(cache)
    assert before[:3] == after[:3]
    assert mx.array_equal(before[3], after[3]) and mx.array_equal(before[4], after[4])
    # and it still works
    cache.decode(*arrays(L=1), scale=1.0)
    assert cache.offset == before[0] + 1


def test_sliding_trim_beyond_window_history_raises():
    cache = RotatingKVCache(4, slack=2, step=2)
    for _ in range(30):
        cache.decode(*arrays(L=1), scale=1.0)
    limit = cache.stored - 3  # what is left must cover the window's history of 3 positions
    assert limit >= 2 and cache.can_trim(limit) and not cache.can_trim(limit + 1)
    with pytest.raises(ValueError, match="slack of 2"):
        cache.trim(limit + 1)
    assert cache.offset == 30


def test_state_of_another_kind_is_rejected():
    state = primed("sliding").state
    with pytest.raises(ValueError, match="kind 'sliding', expected 'full'"):
        KVCache.from_state(state)
    with pytest.raises(ValueError, match="unknown cache kind 'paged'"):
        cache_from_state({**state, "kind": "paged"})


def test_constructor_arguments_are_checked():
    with pytest.raises(ValueError, match="window must be >= 1, got 0"):
        RotatingKVCache(0)
    with pytest.raises(ValueError, match="slack must be >= 0"):
        RotatingKVCache(4, slack=-1)
    with pytest.raises(ValueError, match="step must be >= 1"):
        KVCache(step=0)


def test_shared_view_rejects_stale_or_mismatched_reads():
    donor = primed("sliding")
    view = donor.shared_view()
    q = arrays(L=1)[0]
    with pytest.raises(ValueError, match="last read was window of L=5"):
        view.decode(q, scale=1.0)
    donor.trim(1)
    with pytest.raises(ValueError, match="no read in this forward"):
        view.window(arrays(L=5)[0], scale=1.0)
    donor.decode(*arrays(L=1), scale=1.0)
    with pytest.raises(ValueError, match="takes only q"):
        view.decode(*arrays(L=1), scale=1.0)
    with pytest.raises(ValueError, match="owns no storage"):
        view.trim(1)
    assert view.decode(q, scale=1.0).shape == (1, 2, 1, D)
