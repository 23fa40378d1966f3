"""``check_caches``: a model's cache list against the ``CacheSpec`` of each layer. Full-precision and
quantized storage of one layer type are interchangeable; layer type, window, sharing and donor are not."""

from __future__ import annotations

import timeit

import pytest

from cache import (
    KINDS,
    CacheSpec,
    KVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    SharedView,
    check_caches,
    quantize_caches,
)
from cache.spec import FAMILIES

WINDOW = 8
# A Gemma 4-like stack: sliding, sliding, full, sliding, full, then KV-shared layers reading the last
# earlier owning layer of their type (3 for sliding, 4 for full).
EXPECTED = [
    CacheSpec("sliding", WINDOW),
    CacheSpec("sliding", WINDOW),
    CacheSpec("full"),
    CacheSpec("sliding", WINDOW),
    CacheSpec("full"),
    CacheSpec("sliding", WINDOW, donor=3),
    CacheSpec("full", donor=4),
]


def make_caches():
    caches = [RotatingKVCache(WINDOW), RotatingKVCache(WINDOW), KVCache(), RotatingKVCache(WINDOW), KVCache()]
    return caches + [caches[3].shared_view(), caches[4].shared_view()]


def test_a_matching_list_passes():
    check_caches(make_caches(), EXPECTED, "Model")
    check_caches(tuple(make_caches()), EXPECTED, "Model")
    check_caches([], [], "Model")


def test_a_quantized_version_of_the_right_list_passes():
    caches = make_caches()
    quantize_caches(caches, bits=8, group_size=32)
    assert caches[0].kind == "sliding-quantized" and caches[2].kind == "full-quantized"
    assert caches[5].kind == "shared:sliding-quantized" and caches[5].donor is caches[3]
    check_caches(caches, EXPECTED, "Model")
    # some layers quantized, some not, is fine too
    mixed = make_caches()
    mixed[1] = RotatingQuantizedKVCache(WINDOW, bits=4, group_size=32)
    check_caches(mixed, EXPECTED, "Model")


def test_specs_of_the_caches():
    caches = make_caches()
    where = {id(c): i for i, c in enumerate(caches)}.get
    specs = [c.spec(lambda d: where(id(d))) for c in caches]
    assert specs[0] == CacheSpec("sliding", WINDOW) and specs[2] == CacheSpec("full")
    assert specs[5] == CacheSpec("shared:sliding", WINDOW, 3) and specs[6] == CacheSpec("shared:full", None, 4)
    assert caches[5].spec() == CacheSpec("shared:sliding", WINDOW)  # without index_of: no donor index
    with pytest.raises(AttributeError):
        specs[0].window = 3  # frozen


def test_every_cache_kind_has_a_family():
    assert set(KINDS) == set(FAMILIES)


@pytest.mark.parametrize(
    "layer,replacement,message",
    [
        (0, lambda c: KVCache(), r"layer 0 expects a sliding \(window 8\) cache .*, got a full cache: KVCache"),
        (2, lambda c: RotatingKVCache(WINDOW), r"layer 2 expects a full cache .*, got a sliding \(window 8\) cache"),
        (1, lambda c: RotatingKVCache(WINDOW * 2), r"layer 1 expects a sliding \(window 8\) cache .*, got a sliding \(window 16\) cache"),
        (3, lambda c: RotatingQuantizedKVCache(4, bits=8, group_size=32), r"layer 3 expects a sliding \(window 8\).*window 4"),
        (5, lambda c: RotatingKVCache(WINDOW), r"layer 5 expects a shared view of layer 3 \(sliding \(window 8\)\).*, got a sliding \(window 8\) cache: RotatingKVCache"),
        (3, lambda c: c[0].shared_view(), r"layer 3 expects a sliding \(window 8\) cache .*, got a shared view of layer 0"),
        (5, lambda c: c[1].shared_view(), r"layer 5 expects a shared view of layer 3 .*, got a shared view of layer 1 \(sliding"),
        (6, lambda c: c[2].shared_view(), r"layer 6 expects a shared view of layer 4 \(full\).*, got a shared view of layer 2 \(full\)"),
        (6, lambda c: c[3].shared_view(), r"layer 6 expects a shared view of layer 4 \(full\).*, got a shared view of layer 3 \(sliding"),
        (6, lambda c: KVCache().shared_view(), r"layer 6 expects a shared view of layer 4 .*, got a shared view of a cache outside the list"),
        (4, lambda c: KVCache().shared_view(), r"layer 4 expects a full cache .*, got a shared view of a cache outside the list"),
        (2, lambda c: None, r"layer 2 expects a full cache, got NoneType \(not a cache of this package\)"),
    ],
)
def test_a_mismatched_layer_is_named(layer, replacement, message):
    caches = make_caches()
    caches[layer] = replacement(caches)
    with pytest.raises(ValueError, match="^Model: " + message):
        check_caches(caches, EXPECTED, "Model")


def test_the_same_layer_count_with_other_layer_types_is_an_error():
    gemma3_like = [RotatingKVCache(WINDOW)] * 2 + [KVCache()] + [RotatingKVCache(WINDOW)] * 4
    with pytest.raises(ValueError, match=r"layer 4 expects a full cache"):
        check_caches(gemma3_like, EXPECTED, "Gemma4TextModel")


def test_sharing_that_differs_is_a_value_error_not_a_type_error():
    owning = [RotatingKVCache(WINDOW), RotatingKVCache(WINDOW), KVCache(), RotatingKVCache(WINDOW), KVCache(),
              RotatingKVCache(WINDOW), KVCache()]
    with pytest.raises(ValueError, match=r"layer 5 expects a shared view of layer 3"):
        check_caches(owning, EXPECTED, "Gemma4TextModel")
    shared_everywhere = make_caches()
    with pytest.raises(ValueError, match=r"layer 5 expects a sliding \(window 8\) cache .*got a shared view of layer 3"):
        check_caches(shared_everywhere, EXPECTED[:5] + [CacheSpec("sliding", WINDOW), CacheSpec("full")], "Gemma4TextModel")


def test_a_list_of_another_length_is_an_error():
    with pytest.raises(ValueError, match=r"^Model: cache has 6 entries for 7 layers$"):
        check_caches(make_caches()[:6], EXPECTED, "Model")
    with pytest.raises(TypeError, match="cache must be a list of layer caches, got NoneType"):
        check_caches(None, EXPECTED, "Model")


@pytest.mark.parametrize(
    "args,message",
    [
        (("paged",), "unknown kind 'paged'"),
        (("sliding",), "needs an int window >= 1, got None"),
        (("sliding", 0), "needs an int window >= 1, got 0"),
        (("sliding", True), "needs an int window >= 1, got True"),
        (("full", 8), "has no window, got 8"),
        (("full", None, -1), "donor must be None or a layer index >= 0, got -1"),
        (("full", None, "3"), "donor must be None or a layer index >= 0, got '3'"),
        ((None,), "unknown kind None"),
    ],
)
def test_a_bad_spec_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        CacheSpec(*args)


def test_expected_entries_must_be_specs():
    with pytest.raises(TypeError, match=r"expected\[0\] must be a CacheSpec, got str"):
        check_caches([KVCache()], ["full"], "Model")


def test_the_check_is_cheap():
    caches, expected = [], []
    for i in range(36):  # a few dozen layers
        if i >= 20:
            caches.append(caches[18 + i % 2].shared_view())
            expected.append(CacheSpec("sliding", 512, 18) if i % 2 == 0 else CacheSpec("full", None, 19))
        elif i % 2:
            caches.append(KVCache()), expected.append(CacheSpec("full"))
        else:
            caches.append(RotatingKVCache(512)), expected.append(CacheSpec("sliding", 512))
    assert isinstance(caches[-1], SharedView)
    check_caches(caches, expected, "Model")
    seconds = min(timeit.repeat(lambda: check_caches(caches, expected, "Model"), number=20, repeat=3)) / 20
    assert seconds < 5e-3  # pure Python over the list: well under a millisecond in practice
