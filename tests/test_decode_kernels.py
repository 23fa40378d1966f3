"""The decode kernels (``zoo_cpu.decode``, ``zoo_cpu/src/decode*``): a decode step's query/key/value
heads and its attention over a run of a cache's planes, each one graph node, against float64 and
against MLX's ops in whole models (kernels on == off, token after token)."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mlx.core as mx

from zoo_cpu import backend, decode, extension, prefill, switches

pytestmark = pytest.mark.skipif(not extension.available(), reason="the C++ extension is not built here")
ISAS = extension.status().module.available_isas() if extension.available() else []


def norm64(x, w, eps, shift):
    x = x.astype(np.float64)
    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    return y if w is None else y * (w.astype(np.float64) + shift)


def rope64(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos.astype(np.float64), sin.astype(np.float64)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# name: kv heads, has_v, v_norm, shift (Gemma 3; Gemma 4; Gemma 4 K=V; a KV-shared layer's queries)
KINDS = {
    "gemma3": (2, True, False, 1.0),
    "gemma4": (2, True, True, 0.0),
    "k_eq_v": (1, False, True, 0.0),
    "queries_only": (0, False, False, 0.0),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", KINDS)
def test_heads_match_float64(kind, isa):
    kv, has_v, v_norm, shift = KINDS[kind]
    rng = np.random.default_rng(0)
    B, H, D, eps = 2, 4, 40, 1e-6
    width = (H + kv * (2 if has_v else 1)) * D
    x = (rng.standard_normal((B, 1, width)) * 3).astype(np.float32)
    qw, kw = (rng.standard_normal(D) * 0.3).astype(np.float32), (rng.standard_normal(D) * 0.3).astype(np.float32)
    angles = rng.uniform(-40, 40, (1, D // 2))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    out = decode.heads(mx.array(x), H, kv, has_v, D, mx.array(qw), mx.array(kw) if kv else None, shift, eps, v_norm,
                       mx.array(cos), mx.array(sin), isa=isa)  # fmt: skip
    assert len(out) == (3 if kv else 1)
    heads = x.reshape(B, -1, D).transpose(1, 0, 2)[:, :, None]  # [heads, B, 1, D]
    want_q = rope64(norm64(heads[:H], qw, eps, shift), cos, sin).transpose(1, 0, 2, 3)
    np.testing.assert_allclose(np.array(out[0]), want_q, rtol=0, atol=2e-6 * np.abs(want_q).max())
    if kv:
        raw_k = heads[H : H + kv]
        raw_v = heads[H + kv :] if has_v else raw_k
        want_k = rope64(norm64(raw_k, kw, eps, shift), cos, sin).transpose(1, 0, 2, 3)
        want_v = (norm64(raw_v, None, eps, 0.0) if v_norm else raw_v.astype(np.float64)).transpose(1, 0, 2, 3)
        np.testing.assert_allclose(np.array(out[1]), want_k, rtol=0, atol=2e-6 * np.abs(want_k).max())
        np.testing.assert_allclose(np.array(out[2]), want_v, rtol=0, atol=2e-6 * np.abs(want_v).max())


def attention64(q, keys, values, start, size, scale, mask):
    B, Hq, _, D = q.shape
    Hkv = keys.shape[1]
    k = keys[:, :, start : start + size].astype(np.float64)
    v = values[:, :, start : start + size].astype(np.float64)
    k, v = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    s = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k) * scale
    if mask is not None:
        s = np.where(np.broadcast_to(mask[:, None, None, :], s.shape), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), v)


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), groups=st.integers(1, 9), D=st.sampled_from([8, 18, 24, 64, 256]),
       Dv=st.sampled_from([8, 40, 64, 200]), T=st.integers(1, 1200), data=st.data(), isa=st.sampled_from(ISAS or ["portable"]))  # fmt: skip
def test_attention_matches_float64_over_a_run(B, Hkv, groups, D, Dv, T, data, isa):
    """Query heads a kv head in groups of 8, 4, 2 and 1, head dims off the vector width, values in
    column blocks and single vectors and a scalar tail, runs of up to 8 parts (128 rows or more each)."""
    size = data.draw(st.integers(1, T))
    start = data.draw(st.integers(0, T - size))
    masked = data.draw(st.sampled_from(["none", "one", "per_row", "tail"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q = rng.standard_normal((B, Hkv * groups, 1, D)).astype(np.float32)
    keys = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    values = rng.standard_normal((B, Hkv, T, Dv)).astype(np.float32)
    mask = None
    if masked == "one":
        mask = rng.random((1, size)) < 0.7
    elif masked == "per_row":
        mask = rng.random((B, size)) < 0.7
    elif masked == "tail":  # only the last rows visible: whole parts of the run masked out
        mask = np.arange(size)[None] >= size - max(1, size // 5)
    if mask is not None:
        mask[:, -1] = True  # the cache's masks always show the new position
    scale = 0.125
    got = decode.attention(mx.array(q), mx.array(keys), mx.array(values), mx.array(start), size, scale,
                           None if mask is None else mx.array(mask), isa=isa)  # fmt: skip
    want = attention64(q, keys, values, start, size, scale, mask)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-6 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("isa", ISAS or ["portable"])
def test_attention_never_reads_a_masked_row(isa):
    """A masked row's storage may hold anything (a buffer's unwritten rows): NaN and inf there
    change nothing, whether the row sits in a whole block of rows or in a tail."""
    rng = np.random.default_rng(5)
    T, D = 203, 64
    q = rng.standard_normal((1, 8, 1, D)).astype(np.float32)
    keys = rng.standard_normal((1, 1, T, D)).astype(np.float32)
    values = rng.standard_normal((1, 1, T, D)).astype(np.float32)
    mask = rng.random((1, T)) < 0.6
    mask[:, -1] = True
    want = attention64(q, keys, values, 0, T, 0.125, mask)
    keys[:, :, ~mask[0]] = np.nan
    values[:, :, ~mask[0]] = np.inf
    got = decode.attention(mx.array(q), mx.array(keys), mx.array(values), mx.array(0), T, 0.125, mx.array(mask), isa=isa)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_attention_reads_strided_planes_in_place():
    """A cache's stored rows are a view of its buffer: rows of [B, H, capacity, D] planes."""
    rng = np.random.default_rng(3)
    planes = rng.standard_normal((2, 2, 300, 16)).astype(np.float32)
    k, v = mx.array(planes)[:, :, :257], mx.array(planes[::-1].copy())[:, :, :257]
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float32)
    got = decode.attention(mx.array(q), k, v, mx.array(0), 257, 0.3, None)
    want = attention64(q, np.array(k), np.array(v), 0, 257, 0.3, None)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-6 * np.abs(want).max())


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 2), Hkv=st.integers(1, 2), groups=st.integers(1, 4), D=st.sampled_from([64, 128, 256]),
       Dv=st.sampled_from([64, 256]), group=st.sampled_from([32, 64]), bits=st.sampled_from(decode.QUANTIZED_BITS),
       T=st.integers(1, 700), data=st.data(), isa=st.sampled_from(ISAS or ["portable"]))  # fmt: skip
def test_quantized_attention_matches_float64_over_a_run(B, Hkv, groups, D, Dv, group, bits, T, data, isa):
    """The quantized read equals float64 attention over the planes' dequantized values (what the
    codes stand for), so the kernel adds no error beyond the storage's own."""
    size = data.draw(st.integers(1, T))
    start = data.draw(st.integers(0, T - size))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q = rng.standard_normal((B, Hkv * groups, 1, D)).astype(np.float32)
    keys = mx.quantize(mx.array(rng.standard_normal((B, Hkv, T, D)).astype(np.float32)), group_size=group, bits=bits)
    values = mx.quantize(mx.array(rng.standard_normal((B, Hkv, T, Dv)).astype(np.float32)), group_size=group, bits=bits)
    mask = data.draw(st.sampled_from([None, "per_row"]))
    if mask:
        mask = rng.random((B, size)) < 0.7
        mask[:, -1] = True
    got = decode.attention_quantized(mx.array(q), keys, values, mx.array(start), size, 0.125,
                                     None if mask is None else mx.array(mask), bits, group, isa=isa)  # fmt: skip
    dense = [np.array(mx.dequantize(*planes, group_size=group, bits=bits)) for planes in (keys, values)]
    want = attention64(q, *dense, start, size, 0.125, mask)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=5e-6 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bits", decode.QUANTIZED_BITS)
def test_quantized_attention_never_uses_a_masked_row(bits, isa):
    """A masked row's scales and biases may hold anything (a buffer's unwritten rows): NaN and inf
    there change nothing, though the kernel dequantizes whole blocks of rows, masked ones included."""
    rng = np.random.default_rng(6)
    T, D, group = 203, 64, 32
    q = rng.standard_normal((1, 4, 1, D)).astype(np.float32)
    keys = mx.quantize(mx.array(rng.standard_normal((1, 1, T, D)).astype(np.float32)), group_size=group, bits=bits)
    values = mx.quantize(mx.array(rng.standard_normal((1, 1, T, D)).astype(np.float32)), group_size=group, bits=bits)
    mask = rng.random((1, T)) < 0.6
    mask[:, -1] = True
    dense = [np.array(mx.dequantize(*planes, group_size=group, bits=bits)) for planes in (keys, values)]
    want = attention64(q, *dense, 0, T, 0.125, mask)
    spoiled = []
    for (packed, scales, biases), bad in zip((keys, values), (np.nan, np.inf)):
        scales, biases = np.array(scales), np.array(biases)
        scales[:, :, ~mask[0]], biases[:, :, ~mask[0]] = bad, -bad
        spoiled.append((packed, mx.array(scales), mx.array(biases)))
    got = decode.attention_quantized(mx.array(q), *spoiled, mx.array(0), T, 0.125, mx.array(mask), bits, group, isa=isa)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=5e-6 * max(1.0, np.abs(want).max()))


def test_quantized_attention_reads_strided_planes_in_place():
    """A quantized cache's rows are views of its buffers too (packed words, scales, biases)."""
    rng = np.random.default_rng(4)
    full = [mx.quantize(mx.array(rng.standard_normal((1, 2, 400, 64)).astype(np.float32)), group_size=64, bits=8)
            for _ in range(2)]  # fmt: skip
    keys, values = (tuple(p[:, :, :300] for p in planes) for planes in full)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    got = decode.attention_quantized(mx.array(q), keys, values, mx.array(20), 280, 0.3, None, 8, 64)
    dense = [np.array(mx.dequantize(*planes, group_size=64, bits=8)) for planes in (keys, values)]
    want = attention64(q, *dense, 20, 280, 0.3, None)
    np.testing.assert_allclose(np.array(got), want, rtol=0, atol=5e-6 * np.abs(want).max())


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), Hkv=st.integers(1, 2), groups=st.integers(1, 4), D=st.sampled_from([64, 128]),
       Dv=st.sampled_from([64, 256]), bits=st.sampled_from([None, *decode.QUANTIZED_BITS]), data=st.data(),
       isa=st.sampled_from(ISAS or ["portable"]))  # fmt: skip
def test_attention_rows_equal_each_row_alone(B, Hkv, groups, D, Dv, bits, data, isa):
    """A batch's rows, each over a run of planes of its own length (a strided view of a larger
    buffer, as a cache's are), in one call: each row's output is exactly the single-row kernel's
    (the same parts and the same sums), float and 4/8-bit quantized planes."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    q = mx.array(rng.standard_normal((B, Hkv * groups, 1, D)).astype(np.float32))
    keys, values, starts, sizes = [], [], [], []
    for _ in range(B):
        T = data.draw(st.integers(1, 600))
        sizes.append(data.draw(st.integers(1, T)))
        starts.append(data.draw(st.integers(0, T - sizes[-1])))
        for planes, width in ((keys, D), (values, Dv)):
            x = mx.array(rng.standard_normal((1, Hkv, T + 7, width)).astype(np.float32))[:, :, :T]
            planes.append((x,) if bits is None else tuple(mx.quantize(x, group_size=64, bits=bits)))
    got = decode.attention_rows(q, keys, values, starts, sizes, 0.125, bits, 64, isa=isa)
    for r in range(B):
        if bits is None:
            alone = decode.attention(q[r : r + 1], keys[r][0], values[r][0], mx.array(starts[r]), sizes[r], 0.125, None, isa=isa)
        else:
            alone = decode.attention_quantized(q[r : r + 1], keys[r], values[r], mx.array(starts[r]), sizes[r], 0.125, None,
                                               bits, 64, isa=isa)  # fmt: skip
        np.testing.assert_array_equal(np.array(got[r : r + 1]), np.array(alone), err_msg=f"row {r}")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), D=st.integers(1, 300), shift=st.sampled_from([0.0, 1.0]), residual=st.booleans(),
       isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_rms_norm_shift_and_residual_match_float64(rows, D, shift, residual, isa, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((1, rows, D)) * 4).astype(np.float32)
    w = (rng.standard_normal(D) * 0.3).astype(np.float32)
    r = rng.standard_normal((1, rows, D)).astype(np.float32) if residual else None
    got = np.array(prefill.rms_norm(mx.array(x), mx.array(w), 1e-6, shift, None if r is None else mx.array(r), isa=isa))
    want = norm64(x, w, 1e-6, shift) + (0.0 if r is None else r)
    np.testing.assert_allclose(got, want, rtol=0, atol=(6e-8 * D + 1e-6) * max(1.0, np.abs(want).max()))


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 300), isa=st.sampled_from(ISAS or ["portable"]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_gelu_gate_of_a_joined_product_matches_float64(rows, width, isa, seed):
    """An MLP's up and gate as one product: rows of [up | gate], gated without a split."""
    joined = (np.random.default_rng(seed).standard_normal((1, rows, 2 * width)) * 3).astype(np.float32)
    got = np.array(prefill.gelu_gated(mx.array(joined), None, isa=isa))
    up, gate = joined[..., :width].astype(np.float64), joined[..., width:].astype(np.float64)
    want = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
    # tanh's absolute error (4e-7) scales with |gate * up| where 1 + tanh cancels (as the prefill kernel's bound)
    assert np.abs(got - want).max() <= 1e-6 * (np.abs(gate).max() * np.abs(up).max() + 1)


QUANTIZED_ROWS = tuple(mx.quantize(mx.zeros((1, 1, 4, 64)), group_size=64, bits=8))  # 4 rows of head dim 64


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: decode.heads(mx.zeros((1, 1, 10)), 2, 1, True, 4, None, None, 0, 1e-6, False, mx.zeros((1, 2)),
                              mx.zeros((1, 2))), r"projected must be \[B, 1, 16\]"),
        (lambda: decode.heads(mx.zeros((1, 1, 8)), 2, 0, False, 4, None, None, 0, 1e-6, False, mx.zeros((1, 3)),
                              mx.zeros((1, 3))), r"cos and sin must be \[1, 2\]"),
        (lambda: decode.heads(mx.zeros((1, 1, 8)), 3, 2, True, 2, None, None, 0, 1e-6, False, mx.zeros((1, 1)),
                              mx.zeros((1, 1))), r"heads a multiple of kv_heads"),
        (lambda: decode.attention(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)), mx.array(0),
                                  6, 1.0, None), r"size must be in \[1, 5\]"),
        (lambda: decode.attention(mx.zeros((1, 2, 1, 4)), mx.zeros((1, 1, 5, 4)), mx.zeros((1, 1, 5, 4)), mx.array(0),
                                  5, 1.0, mx.ones((1, 4), dtype=mx.bool_)), r"mask must be bool \[1 or B, size\] with size 5"),
        (lambda: decode.attention(mx.zeros((1, 3, 1, 4)), mx.zeros((1, 2, 5, 4)), mx.zeros((1, 2, 5, 4)), mx.array(0),
                                  5, 1.0, None), r"query heads 3 are not a multiple of kv heads 2"),
        (lambda: prefill.rms_norm(mx.zeros((1, 4)), None, 1e-6, 1.0), r"shift applies to a weight"),
        (lambda: prefill.gelu_gated(mx.zeros((1, 5)), None), r"even last axis, got \[1, 5\]"),
        (lambda: prefill.rms_norm(mx.zeros((1, 4)), mx.ones((4,)), 1e-6, 0.0, mx.zeros((2, 4))), r"residual \[2, 4\] must have x's shape"),
        (lambda: decode.attention_quantized(mx.zeros((1, 1, 1, 64)), QUANTIZED_ROWS, QUANTIZED_ROWS, mx.array(0), 4, 1.0, None, 3, 64),
         r"bits must be 4 or 8, got 3"),
        (lambda: decode.attention_quantized(mx.zeros((1, 1, 1, 128)), QUANTIZED_ROWS, QUANTIZED_ROWS, mx.array(0), 4, 1.0, None, 8, 64),
         r"keys of head dim 128 at 8 bits, group 64 need packed \[..., 32\]"),
        (lambda: decode.attention_rows(mx.zeros((2, 2, 1, 4)), [(mx.zeros((1, 1, 5, 4)),)], [(mx.zeros((1, 1, 5, 4)),)],
                                       [0], [5], 1.0), r"q's 2 rows need 4 planes \(2 a row\) and 2 starts and sizes, got 2 planes"),
        (lambda: decode.attention_rows(mx.zeros((2, 2, 1, 4)), [(mx.zeros((1, 1, 5, 4)),), (mx.zeros((1, 1, 3, 4)),)],
                                       [(mx.zeros((1, 1, 5, 4)),), (mx.zeros((1, 1, 3, 4)),)], [0, 1], [5, 3], 1.0),
         r"row 1: run \[1, 4\) is not a non-empty run of its planes' 3 rows"),
        (lambda: decode.attention_rows(mx.zeros((2, 2, 1, 4)), [(mx.zeros((1, 1, 5, 4)),), (mx.zeros((1, 2, 5, 4)),)],
                                       [(mx.zeros((1, 1, 5, 4)),), (mx.zeros((1, 2, 5, 4)),)], [0, 0], [5, 5], 1.0),
         r"row 1: planes \[1, 2, 5, 4\] of value head dim 4 do not fit row 0's 1 kv heads"),
        (lambda: decode.attention_rows(mx.zeros((1, 1, 1, 64)), [QUANTIZED_ROWS], [QUANTIZED_ROWS], [0], [4], 1.0, 4, 64),
         r"row 0: planes .* are not one head dim at 4 bits, group 64"),
        (lambda: decode.attention_rows(mx.zeros((1, 1, 1, 64)), [QUANTIZED_ROWS], [QUANTIZED_ROWS], [0], [4], 1.0, 3, 64),
         r"bits must be 0 \(float planes\), 4 or 8, got 3"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ------------------------------------------------------------------------------------ in whole models
transformers = pytest.importorskip("transformers")
from tests import hf_tiny  # noqa: E402
from tests.test_batch_generate import gemma3  # noqa: E402, F401  (the tiny Gemma 3 fixture)
from tests.test_gemma3_text_parity import BASE as GEMMA3_BASE  # noqa: E402


@pytest.fixture(scope="module", params=["T1", "T2", "T3", "E2B_like"])
def gemma4(request, tmp_path_factory):
    """(model, the folder transformers wrote it to)."""
    folder = tmp_path_factory.mktemp(request.param)
    return hf_tiny.load_causal_lm(request.param, folder), folder


def steps(model, kernels: bool, compiled: bool, rows: int = 1, n: int = 40) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens (of the first row) and the logits of the prompt's last position and of each
    decode step after it, for a 7-token prompt (batch rows at one offset)."""
    ids = mx.array(np.random.default_rng(1).integers(3, model.vocab_size, (rows, 7)))
    with backend.using(replace(backend.active(), decode=kernels)), switches.override(GEMMA_ZOO_COMPILE_STEP=compiled):
        cache = model.make_cache()
        logits = model.logits(ids, cache)[:, -1]
        tokens, out = [], [np.array(logits)]
        for _ in range(n):
            token = mx.argmax(logits, axis=-1)
            tokens.append(int(token[0]))
            logits = model._forward(token[:, None], cache, last_only=True)[:, -1]
            out.append(np.array(logits))
    return tokens, out


@pytest.mark.parametrize("compiled", [True, False])
def test_gemma4_kernels_as_close_to_float64_as_mlx_ops(gemma4, compiled):
    # 40 steps: the sliding layers' windows fill and slide, KV-shared layers replay their donors' runs
    gemma4, folder = gemma4
    ids = np.random.default_rng(1).integers(3, gemma4.vocab_size, (1, 7))
    tokens, off = steps(gemma4, False, compiled)
    again, on = steps(gemma4, True, compiled)
    assert again == tokens
    hf = transformers.Gemma4ForCausalLM.from_pretrained(folder).eval()
    want = hf_tiny.float64_logits(hf, np.concatenate([ids, np.array(tokens)[None, :-1]], axis=1))[0, 6:]
    err_off = max(np.abs(x[0] - w).max() for x, w in zip(off, want))
    err_on = max(np.abs(x[0] - w).max() for x, w in zip(on, want))
    # Both paths sit at float32 noise against float64 (1e-5 on logits of ~5 for E2B_like); which one
    # lands lower turns on summation order (the projections' kernel moved it both ways), so the
    # floor is that noise level, 20x under the graphs' 1e-4 standard; a defect shows far above it.
    assert err_on <= max(1.5 * err_off, 2e-5), (err_on, err_off)


@pytest.mark.parametrize("rows", [1, 3])
def test_gemma3_kernels_equal_mlx_ops(gemma3, rows):
    for a, b in zip(steps(gemma3, False, True, rows)[1], steps(gemma3, True, True, rows)[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def gemma3_head64(tmp_path_factory):
    """The tiny random Gemma 3 with head dim 64, which quantization groups of 32 and 64 fit."""
    import models

    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gemma3_head64")
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**dict(GEMMA3_BASE, head_dim=64))).save_pretrained(folder)
    return models.load(str(folder), tokenizer=False)


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
@pytest.mark.parametrize("compiled", [True, False])
def test_gemma3_quantized_kv_kernel_equals_mlx_ops(gemma3_head64, bits, group, compiled, monkeypatch):
    """Quantized keys and values on every layer: the quantized decode kernel gives the logits MLX's
    quantized_matmul pair gives, step after step (the sliding layers' windows fill and slide)."""
    make = gemma3_head64.make_cache
    monkeypatch.setattr(gemma3_head64, "make_cache", lambda: [c.to_quantized(bits, group) for c in make()])
    off, on = steps(gemma3_head64, False, compiled), steps(gemma3_head64, True, compiled)
    assert on[0] == off[0]
    for a, b in zip(off[1], on[1]):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_the_kernels_shrink_the_step_graph(gemma3, tmp_path):
    """What the kernels are for: the step's graph shrinks (each node costs the CPU stream a task)."""

    def nodes(kernels: bool) -> int:
        with backend.using(replace(backend.active(), decode=kernels)):
            cache = gemma3.make_cache()
            mx.eval(gemma3.logits(mx.array([[5, 6, 7]]), cache))
            logits = gemma3._forward(mx.array([[8]]), cache, last_only=True)
            mx.export_to_dot(str(tmp_path / "step.dot"), logits)
            mx.eval(logits)
        return len(re.findall(r'label\s*=\s*"[A-Za-z]', (tmp_path / "step.dot").read_text()))

    # float32 layers: each projection stays a few nodes of MLX's matmul; the norms, heads and
    # attention around them (about half the step) become one node each
    with_kernels, without = nodes(True), nodes(False)
    assert with_kernels < 0.6 * without, (with_kernels, without)
