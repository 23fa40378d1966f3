"""Every cache read against a dense, cache-free reference, over random sequences of reads.

The property test drives a cache and ``DenseReference`` with the same random program: prefill
chunks shorter than, equal to and longer than the window, decode runs that wrap the storage many
times, images (longer than the window, right after earlier text), encoder blocks, canvas reads,
trims (after wraps too), state round trips and KV-shared views. fp32 outputs must agree to 1e-5.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache, cache_from_state
from tests.dense_reference import DenseReference

TOL = 1e-5
D = 8


class Driver:
    """Runs one cache and the reference side by side and checks every answer."""

    def __init__(self, window, slack, step, B, Hkv, groups, Dv, scale, seed, bits=None, group_size=32, D=D):
        if bits is None:
            self.cache = KVCache(step=step) if window is None else RotatingKVCache(window, slack=slack, step=step)
        elif window is None:
            self.cache = QuantizedKVCache(bits=bits, group_size=group_size, step=step)
        else:
            self.cache = RotatingQuantizedKVCache(window, bits=bits, group_size=group_size, slack=slack, step=step)
        self.bits, self.group_size, self.D = bits, group_size, D
        self.ref = DenseReference(window)
        self.window, self.slack = window, slack
        self.B, self.Hkv, self.Hq, self.Dv, self.scale = B, Hkv, Hkv * groups, Dv, scale
        self.rng = np.random.default_rng(seed)
        self.trimmed = False

    def qkv(self, L):
        r = self.rng
        q = r.standard_normal((self.B, self.Hq, L, self.D)).astype(np.float32)
        k = r.standard_normal((self.B, self.Hkv, L, self.D)).astype(np.float32)
        v = r.standard_normal((self.B, self.Hkv, L, self.Dv)).astype(np.float32)
        return mx.array(q), mx.array(k), mx.array(v)

    def stored(self, x):
        """What the cache keeps of ``x``: itself, or its quantize-dequantize round trip, so that the
        reference sees the same values and only storage and reading errors show."""
        if self.bits is None:
            return x
        return mx.dequantize(*mx.quantize(x, group_size=self.group_size, bits=self.bits),
                             group_size=self.group_size, bits=self.bits)

    def blocks(self, L):
        """Random images per row; a row whose stored positions end in an image starts with text."""
        out = np.full((self.B, L), -1, dtype=np.int32)
        for b in range(self.B):
            pos, image = 0, 0
            while pos < L:
                if self.rng.random() < 0.5:
                    length = int(self.rng.integers(1, 2 * (self.window or 4) + 3))
                    out[b, pos : pos + length] = image
                    image += 1
                    pos += length
                pos += int(self.rng.integers(1, 4))
            if self.ref.offset and self.ref.images[b, -1] >= 0:
                out[b, 0] = -1
        return mx.array(out)

    def compare(self, got, want, what):
        diff = float(np.max(np.abs(np.array(got, dtype=np.float64) - want)))
        assert diff < TOL, f"{what}: max |diff| {diff}"

    def write_read(self, read, L):
        q, k, v = self.qkv(L)
        blocks = self.blocks(L) if read in ("vision_prefill", "encoder") else None
        args = (q, k, v) if blocks is None else (q, k, v, blocks)
        got = getattr(self.cache, read)(*args, scale=self.scale)
        self.ref.write(self.stored(k), self.stored(v), None if blocks is None else np.array(blocks))
        self.compare(got, self.ref.attend_new(read, q, self.scale), f"{read} L={L}")
        # A KV-shared layer reads the same positions with its own queries, without writing.
        q2 = self.qkv(L)[0]
        view = self.cache.shared_view()
        shared = getattr(view, read)(q2, scale=self.scale)
        self.compare(shared, self.ref.attend_new(read, q2, self.scale), f"shared {read} L={L}")
        newest = int(self.rng.integers(1, L + 1))
        shared_tail = getattr(view, read)(q2[:, :, L - newest :], scale=self.scale)
        want = self.ref.attend_new(read, q2, self.scale)[:, :, L - newest :]
        self.compare(shared_tail, want, f"shared {read} newest {newest} of L={L}")
        self.check_invariants(after_write=L)

    def canvas(self, L):
        q, k, v = self.qkv(L)
        before = (self.cache.offset, self.cache.stored)
        got = self.cache.canvas(q, k, v, scale=self.scale)
        self.compare(got, self.ref.canvas(q, self.stored(k), self.stored(v), self.scale), f"canvas L={L}")
        assert (self.cache.offset, self.cache.stored) == before, "canvas must write nothing"
        self.check_invariants(after_write=0)

    def trim(self, n):
        if self.cache.can_trim(n):
            assert self.cache.trim(n) == n
            self.ref.trim(n)
            self.trimmed = True
        else:
            before = (self.cache.offset, self.cache.stored)
            with pytest.raises(ValueError, match="trim"):
                self.cache.trim(n)
            assert (self.cache.offset, self.cache.stored) == before
        self.check_invariants(after_write=0)

    def restore(self):
        self.cache = cache_from_state(self.cache.state)
        self.check_invariants(after_write=0)

    def program(self, ops):
        """Run ``(op, n)`` steps drawn from ``OPS``."""
        for op, n in ops:
            if op == "decode":
                for _ in range(n):
                    self.write_read("decode", 1)
            elif op in ("window", "vision_prefill", "encoder"):
                self.write_read(op, n)
            elif op == "canvas":
                if self.ref.offset:
                    self.canvas(n)
            elif op == "trim":
                if self.ref.offset:
                    self.trim(min(n, self.ref.offset))
            else:
                self.restore()

    def check_invariants(self, after_write):
        c, ref = self.cache, self.ref
        assert c.offset == ref.offset
        stored = c.stored
        if self.window is None:
            assert stored == ref.offset
        else:
            assert min(ref.offset, self.window - 1) <= stored
            if self.bits is None:
                assert c.nbytes <= self.B * self.Hkv * (self.D + self.Dv) * 4 * c.capacity
        if stored:
            keys, values = c.temporal()
            np.testing.assert_array_equal(np.array(keys), ref.keys[:, :, ref.offset - stored :].astype(np.float32))
            np.testing.assert_array_equal(np.array(values), ref.values[:, :, ref.offset - stored :].astype(np.float32))
        if after_write:
            # Speculative rollback: right after writing L positions, dropping up to min(L, slack) of
            # them is always exact; with no trim so far, up to `slack` positions are.
            written = after_write if self.trimmed else ref.offset
            bound = ref.offset if self.window is None else min(self.slack, written, ref.offset)
            assert all(c.can_trim(n) for n in range(bound + 1))


OPS = st.one_of(
    st.tuples(st.just("window"), st.integers(1, 20)),
    st.tuples(st.just("decode"), st.integers(1, 20)),
    st.tuples(st.just("vision_prefill"), st.integers(1, 24)),
    st.tuples(st.just("encoder"), st.integers(1, 24)),
    st.tuples(st.just("canvas"), st.integers(1, 10)),
    st.tuples(st.just("trim"), st.integers(1, 6)),
    st.tuples(st.just("restore"), st.just(0)),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.one_of(st.none(), st.integers(1, 9)),
    slack=st.integers(0, 4),
    step=st.integers(1, 8),
    B=st.sampled_from([1, 3]),
    Hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    Dv=st.sampled_from([D, 12]),
    scale=st.sampled_from([1.0, D**-0.5]),
    seed=st.integers(0, 2**31 - 1),
    ops=st.lists(OPS, min_size=1, max_size=25),
)
def test_random_programs_match_dense_reference(window, slack, step, B, Hkv, groups, Dv, scale, seed, ops):
    run = Driver(window, slack, step, B, Hkv, groups, Dv, scale, seed)
    run.program(ops)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    window=st.one_of(st.none(), st.integers(1, 9)),
    slack=st.integers(0, 4),
    step=st.integers(1, 8),
    B=st.sampled_from([1, 3]),
    Hkv=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2, 4]),
    quant=st.sampled_from([(4, 32, 32), (8, 32, 32), (4, 64, 64), (8, 64, 64)]),
    sharpness=st.sampled_from([1.0, 2.0]),
    seed=st.integers(0, 2**31 - 1),
    ops=st.lists(OPS, min_size=1, max_size=20),
)
def test_quantized_caches_match_dense_reference_on_the_round_trip(window, slack, step, B, Hkv, groups, quant, sharpness, seed, ops):
    """The same random programs on quantized storage: the reference attends the quantize-dequantize
    round trip of every key and value, so the comparison isolates storage and reading errors."""
    bits, group_size, dim = quant
    scale = sharpness * dim**-0.5
    run = Driver(window, slack, step, B, Hkv, groups, dim, scale, seed, bits=bits, group_size=group_size, D=dim)
    run.program(ops)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("chunk", [1, 7, 3, 5, 6, 13])
@pytest.mark.parametrize("B,Hkv,groups", [(1, 1, 1), (3, 2, 2), (1, 1, 4)])
def test_chunked_prefill_then_long_decode(window, chunk, B, Hkv, groups):
    """Prefill chunks of 1, 7, < W, = W, > W, then decode through several wraps of the window."""
    run = Driver(window, slack=3, step=4, B=B, Hkv=Hkv, groups=groups, Dv=D, scale=1.0, seed=chunk)
    prompt = 23
    done = 0
    while done < prompt:
        L = min(chunk, prompt - done)
        run.write_read("window", L)
        done += L
    for _ in range(40):
        run.write_read("decode", 1)


@pytest.mark.parametrize("window", [None, 4])
def test_trims_after_wraps_then_decode_and_window(window):
    """Speculative rollback: trims of 1..slack long after the storage has wrapped stay exact."""
    slack = 4
    run = Driver(window, slack=slack, step=3, B=3, Hkv=1, groups=2, Dv=D, scale=1.0, seed=7)
    run.write_read("window", 9)
    for round_ in range(12):
        for _ in range(5):
            run.write_read("decode", 1)
        run.trim(1 + round_ % slack)
        run.write_read("window", 1 + round_ % 6)
        run.trim(1 + (round_ + 1) % slack)


def test_image_after_cached_text_and_longer_than_window():
    """An image right after a cached text prefix, longer than the window, on a sliding cache."""
    for read in ("vision_prefill", "encoder"):
        run = Driver(4, slack=2, step=4, B=1, Hkv=1, groups=2, Dv=D, scale=1.0, seed=3)
        run.write_read("window", 6)
        q, k, v = run.qkv(12)
        blocks = mx.array([[0] * 10 + [-1, -1]])
        got = getattr(run.cache, read)(q, k, v, blocks, scale=1.0)
        run.ref.write(k, v, np.array(blocks))
        run.compare(got, run.ref.attend_new(read, q, 1.0), read)
        run.write_read("decode", 1)


def test_full_layer_vision_prefill_is_causal():
    """Full layers ignore images in Gemma 4's vision prefill: the output equals a plain window read."""
    rng = np.random.default_rng(0)
    q, k, v = (mx.array(rng.standard_normal((1, 2, 9, D)).astype(np.float32)) for _ in range(3))
    k, v = k[:, :1], v[:, :1]
    blocks = mx.array([[-1, 0, 0, 0, 0, -1, 1, 1, -1]])
    a = KVCache().vision_prefill(q, k, v, blocks, scale=1.0)
    b = KVCache().window(q, k, v, scale=1.0)
    assert float(mx.max(mx.abs(a - b))) == 0.0


def test_image_split_across_reads_raises():
    cache = RotatingKVCache(4)
    q, k, v = (mx.zeros((1, 1, 3, D)) for _ in range(3))
    cache.vision_prefill(q, k, v, mx.array([[-1, 0, 0]]), scale=1.0)
    with pytest.raises(ValueError, match="inside an image"):
        cache.vision_prefill(q, k, v, mx.array([[0, 0, -1]]), scale=1.0)
    assert cache.offset == 3


def test_ten_thousand_decodes_keep_storage_constant():
    cache = RotatingKVCache(16, slack=4, step=8)
    q = mx.ones((1, 2, 1, D))
    kv = mx.ones((1, 1, 1, D))
    sizes = set()
    for i in range(10_000):
        out = cache.decode(q, kv, kv, scale=1.0)
        if i % 64 == 0:
            mx.eval(out)
        if i >= cache.capacity:
            sizes.add(cache.nbytes)
    assert len(sizes) == 1
    assert sizes.pop() == 2 * cache.capacity * D * 4
    assert cache.offset == 10_000


def test_state_round_trip_mid_wrap_continues_identically():
    rng = np.random.default_rng(1)

    def qkv(L):
        return tuple(mx.array(rng.standard_normal((1, h, L, D)).astype(np.float32)) for h in (2, 1, 1))

    cache = RotatingKVCache(6, slack=2, step=3)
    cache.window(*qkv(8), scale=1.0)
    for _ in range(13):  # wrapped more than once, mid-step
        cache.decode(*qkv(1), scale=1.0)
    restored = cache_from_state(cache.state)
    assert restored.offset == cache.offset and restored.kind == cache.kind
    for L in (1, 1, 4, 1, 9, 1):
        inputs = qkv(L)
        read = "decode" if L == 1 else "window"
        a = getattr(cache, read)(*inputs, scale=1.0)
        b = getattr(restored, read)(*inputs, scale=1.0)
        assert float(mx.max(mx.abs(a - b))) == 0.0


def test_decode_builds_no_mask_in_steady_state():
    cache = RotatingKVCache(4, slack=2, step=2)
    x = mx.ones((1, 1, 1, D))
    for _ in range(20):
        cache.decode(x, x, x, scale=1.0)
        assert cache._last.mask is None
        assert cache._last.keys[0].shape[2] == min(cache.offset, 4)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("L", [1, 4, 7, 20])
def test_bidirectional_read_on_an_empty_cache(window, L):
    run = Driver(window, slack=2, step=4, B=3, Hkv=2, groups=2, Dv=12, scale=1.0, seed=L)
    run.write_read("bidirectional", L)
    q, k, v = run.qkv(1)
    with pytest.raises(ValueError, match="needs an empty cache"):
        run.cache.bidirectional(q, k, v, scale=1.0)
