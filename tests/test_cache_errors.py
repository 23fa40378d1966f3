"""Bad input to a cache raises ValueError (TypeError for a non-floating dtype) naming the argument
and both values, and changes nothing; forged states are refused before a cache is built."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    SharedView,
    cache_from_state,
)
from cache.base import rows
from cache.codecs import Dense, Quantized

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
    ("q batch", lambda c: c.window(arrays(B=2)[0], *arrays()[1:], scale=1.0), "batch size of k 1 / v 1 must equal q's 2"),
    ("no position", lambda c: c.window(*arrays(L=0), scale=1.0), "at least 1 new position, got L=0"),
    ("mixed dtypes", lambda c: c.window(arrays(dtype=mx.float16)[0], *arrays()[1:], scale=1.0), "share one dtype, got mlx.core.float16, mlx.core.float32"),
    ("not an array", lambda c: c.window(np.zeros((1, 2, 3, D), np.float32), *arrays()[1:], scale=1.0), "q must be an mx.array, got ndarray"),
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


# ------------------------------------------------------------------------------ shared views of views
def test_shared_view_of_a_shared_view_is_refused():
    donor = primed("sliding")
    view = donor.shared_view()
    with pytest.raises(ValueError, match="already a shared view"):
        view.shared_view()
    with pytest.raises(ValueError, match="donor is itself a shared view"):
        SharedView(view)
    with pytest.raises(TypeError, match="donor must be an AttentionCache, got str"):
        SharedView("cache")
    assert donor.shared_view().donor is donor


# ------------------------------------------------------------------------------ scale and dtypes
BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 0, "1.0", True, [1.0], 1j, mx.array(1.0)]


def assert_unchanged_after(cache, call, error, message):
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        call(cache)
    after = snapshot(cache)
    assert before[:3] == after[:3]
    assert mx.array_equal(before[3], after[3]) and mx.array_equal(before[4], after[4])
    cache.decode(*arrays(L=1), scale=1.0)
    assert cache.offset == before[0] + 1


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("read", ["decode", "window", "canvas", "vision_prefill"])
@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_bad_scale_raises_and_changes_nothing(kind, read, scale):
    L = 1 if read == "decode" else 3
    extra = (mx.full((1, L), -1, dtype=mx.int32),) if read == "vision_prefill" else ()
    assert_unchanged_after(
        primed(kind), lambda c: getattr(c, read)(*arrays(L=L), *extra, scale=scale), ValueError, r"scale must be"
    )


@pytest.mark.parametrize("scale", BAD_SCALES, ids=repr)
def test_shared_view_rejects_a_bad_scale(scale):
    donor = primed("full")
    with pytest.raises(ValueError, match="scale must be"):
        donor.shared_view().window(arrays(L=5)[0], scale=scale)


def test_good_scales_are_accepted():
    for scale in (1, 0.125, np.float32(0.5), np.int64(2)):
        primed("full").window(*arrays(), scale=scale)


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("dtype", [mx.int32, mx.int8, mx.uint32, mx.bool_], ids=str)
@pytest.mark.parametrize("which", ["q", "k", "v", "qkv"])
def test_non_floating_inputs_raise_type_error_naming_the_dtype(kind, dtype, which):
    def call(cache):
        q, k, v = arrays()
        bad = {name: (x.astype(dtype) if name in which else x) for name, x in zip("qkv", (q, k, v))}
        return cache.window(bad["q"], bad["k"], bad["v"], scale=1.0)

    assert_unchanged_after(primed(kind), call, TypeError, rf"{which[0]} must have a floating dtype .*got {dtype}")


def test_non_floating_inputs_into_an_empty_or_quantized_cache_or_a_view():
    for cache in (KVCache(), RotatingKVCache(4), QuantizedKVCache(bits=8, group_size=32)):
        x = mx.ones((1, 1, 2, 32), dtype=mx.int32)
        with pytest.raises(TypeError, match="int32"):
            cache.window(x, x, x, scale=1.0)
        assert cache.offset == 0 and cache.keys is None
    view = primed("full").shared_view()
    with pytest.raises(TypeError, match="q must have a floating dtype .*bool"):
        view.window(mx.zeros((1, 2, 5, D), dtype=mx.bool_), scale=1.0)


# ------------------------------------------------------------------------------ geometry
GEOMETRY = [
    ("kv heads", dict(Hq=2, Hkv=2), r"kv heads 2 does not match the cache's 1: new k \(1, 2, 3, 8\), v \(1, 2, 3, 8\); stored k \[1, 1, \*, 8\], v \[1, 1, \*, 8\]"),
    ("head dim", dict(Dq=16, Dk=16), r"k head dim 16 does not match the cache's 8: new k \(1, 1, 3, 16\), v \(1, 1, 3, 8\); stored k \[1, 1, \*, 8\]"),
    ("v head dim", dict(Dv=16), r"v head dim 16 does not match the cache's 8: new k \(1, 1, 3, 8\), v \(1, 1, 3, 16\); stored k \[1, 1, \*, 8\], v \[1, 1, \*, 8\]"),
    ("batch", dict(B=2), r"batch size 2 does not match the cache's 1: new k \(2, 1, 3, 8\), v \(2, 1, 3, 8\); stored k \[1, 1, \*, 8\]"),
]


@pytest.mark.parametrize("kind", ["full", "sliding"])
@pytest.mark.parametrize("read", ["window", "canvas", "encoder", "vision_prefill"])
@pytest.mark.parametrize("name,shape,message", GEOMETRY, ids=[g[0] for g in GEOMETRY])
def test_new_geometry_raises_naming_both_shapes(kind, read, name, shape, message):
    def call(cache):
        if read in ("encoder", "vision_prefill"):
            return getattr(cache, read)(*arrays(**shape), mx.full((shape.get("B", 1), 3), -1), scale=1.0)
        return getattr(cache, read)(*arrays(**shape), scale=1.0)

    assert_unchanged_after(primed(kind), call, ValueError, message)


def test_geometry_is_checked_after_a_restore_without_a_stored_geometry():
    for kind in ("full", "sliding"):
        state = primed(kind).state
        del state["geometry"]
        restored = cache_from_state(state)
        assert_unchanged_after(restored, lambda c: c.window(*arrays(Hq=2, Hkv=2), scale=1.0), ValueError, "kv heads 2 does not match the cache's 1")


@pytest.mark.parametrize(
    "q,message",
    [
        (mx.zeros((2, 2, 5, D)), "B=1"),
        (mx.zeros((1, 2, 5, 4)), "D=8"),
        (mx.zeros((1, 2, 5, D), dtype=mx.float16), "float16"),
        (mx.zeros((2, 5, D)), "rank 4"),
    ],
)
def test_shared_view_query_must_fit_the_donor(q, message):
    donor = primed("sliding")
    with pytest.raises(ValueError, match=message):
        donor.shared_view().window(q, scale=1.0)


def test_shared_view_query_heads_must_be_a_multiple_of_the_donors_kv_heads():
    donor = KVCache()
    donor.window(*arrays(Hq=4, Hkv=2), scale=1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        donor.shared_view().window(mx.zeros((1, 3, 3, D)), scale=1.0)


# ------------------------------------------------------------------------------ states
def quantized_primed(kind):
    cache = QuantizedKVCache(bits=4, group_size=32, step=4) if kind == "full" else RotatingQuantizedKVCache(4, bits=4, group_size=32, slack=2, step=4)
    cache.window(*arrays(L=5, Dq=32, Dk=32, Dv=32), scale=1.0)
    return cache


def _replace_plane(planes, i, plane):
    return tuple(plane if j == i else p for j, p in enumerate(planes))


FORGED = [
    ("offset str", lambda s: {**s, "offset": "5"}, "offset must be an int, got str"),
    ("offset float", lambda s: {**s, "offset": 5.0}, "offset must be an int, got float"),
    ("offset bool", lambda s: {**s, "offset": True}, "offset must be an int, got bool"),
    ("offset negative", lambda s: {**s, "offset": -1}, "offset must be >= 0, got -1"),
    ("offset below stored", lambda s: {**s, "offset": 4}, "5 stored positions exceed the offset 4"),
    ("step float", lambda s: {**s, "step": 2.5}, "step must be an int, got float"),
    ("step zero", lambda s: {**s, "step": 0}, "step must be >= 1"),
    ("keys array", lambda s: {**s, "keys": s["keys"][0]}, "keys must be a tuple of"),
    ("keys extra plane", lambda s: {**s, "keys": s["keys"] + s["keys"][:1]}, r"keys must be a tuple of \d planes"),
    ("keys plane rank", lambda s: {**s, "keys": _replace_plane(s["keys"], 0, s["keys"][0][0])}, "rank-4"),
    ("keys plane type", lambda s: {**s, "keys": _replace_plane(s["keys"], 0, [1, 2])}, "got list"),
    ("values only", lambda s: {**s, "keys": None}, "both be stored or both be None"),
    ("values rows", lambda s: {**s, "values": tuple(p[..., :4, :] for p in s["values"])}, r"values \[1, 1, 4\]"),
    ("values batch", lambda s: {**s, "values": tuple(mx.concatenate([p, p]) for p in s["values"])}, r"values \[2, 1, 5\]"),
    ("keys rows disagree", lambda s: {**s, "keys": _replace_plane(s["keys"], len(s["keys"]) - 1, s["keys"][-1][..., :4, :])}, r"disagree on \[B, H, rows\]|keys hold \[B, Hkv, rows\] = \[1, 1, 4\]"),
    ("geometry", lambda s: {**s, "geometry": (1, 2) + tuple(s["geometry"][2:])}, "does not match the stored planes"),
    ("geometry type", lambda s: {**s, "geometry": "1x1"}, "does not match the stored planes"),
    ("ends_in_image length", lambda s: {**s, "ends_in_image": [True, False]}, "1 bools"),
    ("ends_in_image type", lambda s: {**s, "ends_in_image": [1]}, "1 bools"),
    ("missing offset", lambda s: {k: v for k, v in s.items() if k != "offset"}, r"lacks \['offset'\]"),
    ("kind", lambda s: {**s, "kind": "shared:full"}, "state is of kind 'shared:full'"),
]


@pytest.mark.parametrize("kind", ["full", "sliding", "full-quantized", "sliding-quantized"])
@pytest.mark.parametrize("name,forge,message", FORGED, ids=[f[0] for f in FORGED])
def test_forged_state_raises(kind, name, forge, message):
    cache = quantized_primed(kind.split("-")[0]) if kind.endswith("quantized") else primed(kind)
    state = cache.state
    forged = forge(state)
    original = dict(forged)
    with pytest.raises(ValueError, match=message):
        type(cache).from_state(forged)
    with pytest.raises(ValueError, match=message if name != "kind" else "unknown cache kind"):
        cache_from_state(forged)
    assert forged == original, "from_state must not change the state it was given"
    restored = type(cache).from_state(state)  # the real state still restores
    assert restored.offset == cache.offset and restored.stored == cache.stored


@pytest.mark.parametrize("state", [None, 5, "full", ["kind", "full"]], ids=repr)
def test_non_dict_state_raises(state):
    for restore in (KVCache.from_state, RotatingKVCache.from_state, QuantizedKVCache.from_state, cache_from_state):
        with pytest.raises(ValueError, match="state must be a dict"):
            restore(state)


def test_state_counters_must_fit_the_layout():
    full = primed("full").state
    with pytest.raises(ValueError, match="stores every position, but holds 5 for the offset 7"):
        KVCache.from_state({**full, "offset": 7})
    with pytest.raises(ValueError, match="stores every position, but holds 0 for the offset 3"):
        KVCache.from_state({**full, "keys": None, "values": None, "geometry": None, "offset": 3})
    sliding = primed("sliding").state  # window 4: 3 positions of history; capacity 9
    with pytest.raises(ValueError, match="do not cover the window's history at offset 40"):
        RotatingKVCache.from_state({**sliding, "keys": rows(sliding["keys"], 0, 2), "values": rows(sliding["values"], 0, 2), "offset": 40})
    ten = tuple(mx.concatenate([p, p], axis=2) for p in sliding["keys"])
    with pytest.raises(ValueError, match="10 stored positions exceed the capacity 9"):
        RotatingKVCache.from_state({**sliding, "keys": ten, "values": ten, "offset": 40})
    assert RotatingKVCache.from_state({**sliding, "offset": 40}).offset == 40  # 5 stored cover the history
    with pytest.raises(ValueError, match="ends_in_image is set on a state with no stored positions"):
        KVCache.from_state({**KVCache().state, "ends_in_image": [True]})


def test_forged_quantized_planes_raise():
    state = quantized_primed("full").state
    packed, scales, biases = state["keys"]
    for planes, message in (
        ((packed.astype(mx.float32), scales, biases), "packed plane must be uint32"),
        ((packed, scales, biases.astype(mx.float16)), "scales and biases must share a floating dtype"),
        ((packed, scales[..., :0], biases[..., :0]), "do not fit 4 bits and group size 32"),
        ((packed[..., :3], scales, biases), "do not fit 4 bits and group size 32"),
    ):
        with pytest.raises(ValueError, match=message):
            QuantizedKVCache.from_state({**state, "keys": planes})
    with pytest.raises(ValueError, match="keys must be a tuple of 3 planes"):
        QuantizedKVCache.from_state({**state, "keys": (packed,)})
    with pytest.raises(ValueError, match="must have a floating dtype, got mlx.core.int32"):
        KVCache.from_state({**primed("full").state, "keys": (mx.zeros((1, 1, 5, D), dtype=mx.int32),)})


# ------------------------------------------------------------------------------ codec names
def test_codecs_pack_and_unpack():
    """Storage (de)quantization is ``pack``/``unpack``; ``decode`` is only ever the read."""
    x = mx.random.normal((1, 2, 3, 32))
    for codec in (Dense(), Quantized(8, 32)):
        assert not hasattr(codec, "encode") and not hasattr(codec, "decode")
        assert mx.allclose(codec.unpack(codec.pack(x)), x, atol=0.05).item()


def test_reads_are_named_and_take_blocks_only_where_they_need_them():
    from cache.reads import Read

    with pytest.raises(ValueError, match="Read: unknown read 'prefill'; the reads are decode, window"):
        Read("prefill")
    with pytest.raises(ValueError, match="Read 'encoder': blocks are required"):
        Read("encoder")
    with pytest.raises(ValueError, match="Read 'window': blocks are not taken"):
        Read("window", mx.zeros((1, 3), dtype=mx.int32))


def test_blocks_may_be_given_as_a_list():
    as_list, as_array = primed("full"), primed("full")
    q, k, v = (mx.random.normal(x.shape, key=mx.random.key(i)) for i, x in enumerate(arrays()))
    got = as_list.vision_prefill(q, k, v, [[0, 0, -1]], scale=1.0)
    want = as_array.vision_prefill(q, k, v, mx.array([[0, 0, -1]]), scale=1.0)
    assert mx.array_equal(got, want).item()
