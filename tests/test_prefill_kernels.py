"""The C++ extension's prefill kernels (``zoo_cpu.prefill``) against float64, on every instruction
set this CPU runs, and their use by ``cache`` and the graphs against the compiled chains."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx.core as mx

import models
from cache import attention
from models import precision
from zoo_cpu import backend, extension, fast_math, prefill

pytestmark = pytest.mark.skipif(not extension.available(), reason="the C++ extension is not built here")

ISAS = extension.status().module.available_isas() if extension.available() else []


@pytest.fixture(autouse=True)
def kernels_on():
    """The kernels switched on whatever the environment says (tests switch them off themselves)."""
    with backend.using(backend.Backend(True, True, backend.for_cpu().decode)):
        yield


def reference(q, k, v, scale, mask):
    """float64 ``softmax(q k^T * scale + mask) v`` with GQA; ``mask`` None, "causal" or boolean."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    L, T = q.shape[2], k.shape[2]
    if isinstance(mask, str):
        mask = np.arange(T - L, T)[:, None] >= np.arange(T)[None]
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def bound(q, k, v, scale):
    """A float32 summation bound: each score is off by ~eps * scale * sum |q_d k_d| (which moves
    its weight by as much, relatively), each output by ~eps * T * max |v| from the weighted sum."""
    worst_score = scale * np.abs(q).max() * np.abs(k).max() * q.shape[-1]
    return 1e-6 * np.abs(v).max() * (8 * worst_score + 2 * k.shape[2]) + 1e-7


def arrays(rng, B, Hq, Hkv, L, T, D, Dv):
    q = rng.standard_normal((B, Hq, L, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, T, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, T, Dv)).astype(np.float32)
    return q, k, v


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 2), Hkv=st.integers(1, 3), groups=st.integers(1, 4), L=st.integers(1, 80), extra=st.integers(0, 60),
    D=st.integers(1, 72), Dv=st.integers(1, 72), mask=st.sampled_from([None, "causal", "2d", "4d", "4d-one"]),
    isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_attention_matches_float64(B, Hkv, groups, L, extra, D, Dv, mask, isa, seed):
    rng = np.random.default_rng(seed)
    Hq, T = Hkv * groups, L + extra
    q, k, v = arrays(rng, B, Hq, Hkv, L, T, D, Dv)
    scale = float(rng.uniform(0.05, 1.0))
    if mask in (None, "causal"):
        want_mask, given_mask = mask, mask
    else:
        shape = {"2d": (L, T), "4d": (B, 1, L, T), "4d-one": (1, 1, L, T)}[mask]
        m = rng.random(shape) < 0.6
        m[..., 0] = True  # every query sees a key
        want_mask, given_mask = m, mx.array(m)
    assert prefill.takes(mx.array(q), mx.array(k), mx.array(v), given_mask)
    got = np.array(prefill.attention(mx.array(q), mx.array(k), mx.array(v), scale, given_mask, isa=isa))
    want = reference(q, k, v, scale, want_mask)
    assert got.dtype == np.float32 and got.shape == (B, Hq, L, Dv)
    assert np.abs(got - want).max() <= bound(q, k, v, scale)


@pytest.mark.parametrize("isa", ISAS)
def test_attention_of_a_270m_chunk_and_strided_inputs(isa):
    """The 270M's prefill shapes (4 query heads on 1 kv head, D 256, 512 queries after 100 stored
    keys), queries as the projection's transposed view and a broadcast (stride 0) mask."""
    rng = np.random.default_rng(0)
    q, k, v = arrays(rng, 1, 4, 1, 512, 612, 256, 256)
    q_view = mx.array(q.transpose(0, 2, 1, 3).copy()).transpose(0, 2, 1, 3)
    for mask in ("causal", mx.broadcast_to(mx.arange(612)[None] >= 30, (512, 612))):
        got = np.array(prefill.attention(q_view, mx.array(k), mx.array(v), 0.0625, mask, isa=isa))
        want = reference(q, k, v, 0.0625, mask if isinstance(mask, str) else np.array(mask))
        assert np.abs(got - want).max() <= bound(q, k, v, 0.0625)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mask", [None, "causal", "2d", "4d", "late"])
def test_attention_over_many_key_blocks_matches_float64(isa, mask):
    """Runs longer than a block of query rows takes at once (256 keys: the online softmax rescales
    the earlier blocks' sums and outputs), with odd head dims, 3 query heads on a kv head (attended
    by one job: 2 batch rows x 2 row blocks are jobs enough), and masks whose rows see no key in
    whole blocks ("late": the first 700 keys hidden from every row, so a row's maximum is -inf
    until a later block)."""
    rng = np.random.default_rng(11)
    B, Hkv, Hq, L, T, D, Dv = 2, 1, 3, 45, 1337, 72, 40
    q, k, v = arrays(rng, B, Hq, Hkv, L, T, D, Dv)
    if mask in (None, "causal"):
        want_mask = given_mask = mask
    else:
        m = rng.random((L, T) if mask == "2d" else (B, 1, L, T)) < 0.3
        if mask == "late":
            m[..., :700] = False
        m[..., -1] = True  # every query sees a key
        want_mask, given_mask = m, mx.array(m)
    got = np.array(prefill.attention(mx.array(q), mx.array(k), mx.array(v), 0.2, given_mask, isa=isa))
    want = reference(q, k, v, 0.2, want_mask)
    assert np.abs(got - want).max() <= bound(q, k, v, 0.2)


@pytest.mark.parametrize("isa", ISAS or ["portable"])
def test_attention_in_a_band_reads_only_its_panels_and_matches_float64(isa):
    """A sliding window's band (``|i - j| <= 100`` over 700 positions, an encoder's sliding read):
    each block of query rows reads only the key panels between the first and the last key any of
    its rows sees, so its span starts and ends inside the 256-key blocks. Rows 32-63 (a whole
    block) and row 5 see no key: NaN rows, the others unchanged."""
    rng = np.random.default_rng(5)
    q, k, v = arrays(rng, 1, 3, 1, 700, 700, 64, 48)
    pos = np.arange(700)
    band = np.abs(pos[:, None] - pos[None]) <= 100
    hidden = band.copy()
    hidden[32:64] = False
    hidden[5] = False
    for m in (band, hidden):
        got = np.array(prefill.attention(mx.array(q), mx.array(k), mx.array(v), 0.125, mx.array(m), isa=isa))
        sees = m.any(1)
        assert np.isnan(got[:, :, ~sees]).all() and not np.isnan(got[:, :, sees]).any()
        want = reference(q[:, :, sees], k, v, 0.125, m[sees])
        assert np.abs(got[:, :, sees] - want).max() <= bound(q, k, v, 0.125)


def test_a_row_with_no_visible_key_is_nan_as_in_mlx():
    q, k, v = arrays(np.random.default_rng(1), 1, 1, 1, 3, 5, 8, 8)
    mask = np.ones((3, 5), bool)
    mask[1] = False
    got = np.array(prefill.attention(mx.array(q), mx.array(k), mx.array(v), 0.5, mx.array(mask)))
    assert np.isnan(got[0, 0, 1]).all() and not np.isnan(got[0, 0, [0, 2]]).any()


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), isa=st.sampled_from(ISAS or ["portable"]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_gelu_gate_matches_float64(shape, isa, seed):
    rng = np.random.default_rng(seed)
    gate = (rng.standard_normal(shape) * 5).astype(np.float32)
    up = rng.standard_normal(shape).astype(np.float32)
    got = np.array(prefill.gelu_gated(mx.array(up), mx.array(gate), isa=isa))
    g = gate.astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * up
    # Eigen's tanh is within 4e-7 absolute; the products add a few float32 roundings
    assert np.abs(got - want).max() <= 1e-6 * (np.abs(g).max() * np.abs(up).max() + 1)


def test_gelu_gate_of_a_prefill_mlp_splits_and_matches_the_chain():
    gate = mx.random.normal((1, 512, 2048), key=mx.random.key(2)) * 3
    up = mx.random.normal((1, 512, 2048), key=mx.random.key(3))
    got = prefill.gelu_gated(up, gate)
    with backend.using(replace(backend.active(), prefill=False)):
        chain = fast_math.gelu_gated(up, gate)
    assert mx.abs(got - chain).max().item() < 1e-5


def test_cache_reads_take_the_kernels_and_the_switch_turns_them_off(monkeypatch):
    calls, fused = [], prefill.attention
    monkeypatch.setattr(prefill, "attention", lambda *a: calls.append("attention") or fused(*a))
    q, k, v = (mx.array(a) for a in arrays(np.random.default_rng(3), 1, 4, 1, 64, 64, 32, 32))
    on = attention.attend(q, k, v, 0.2, "causal")
    with backend.using(replace(backend.active(), prefill=False)):
        off = attention.attend(q, k, v, 0.2, "causal")
    assert calls == ["attention"]
    assert mx.abs(on - off).max().item() < 1e-5
    # bf16 reads and per-head masks are not the kernel's: the blocks of cache.attention take them
    assert not prefill.takes(q.astype(mx.bfloat16), k.astype(mx.bfloat16), v.astype(mx.bfloat16), "causal")
    assert not prefill.takes(q, k, v, mx.ones((1, 4, 64, 64), dtype=mx.bool_))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: prefill.attention(mx.zeros((1, 3, 4, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), 1.0, None),
         "query heads 3 are not a multiple of kv heads 2"),
        (lambda: prefill.attention(mx.zeros((1, 1, 5, 8)), mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), 1.0, "causal"),
         "T=4 < L=5"),
        (lambda: prefill.attention(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), 1.0,
                                   mx.ones((4, 5), dtype=mx.bool_)), r"mask must be bool \[L, T\] or .* got \[4, 5\]"),
        (lambda: prefill.attention(mx.zeros((1, 1, 4, 8), dtype=mx.float16), mx.zeros((1, 1, 4, 8)),
                                   mx.zeros((1, 1, 4, 8)), 1.0, None), "q must be float32"),
        (lambda: prefill.attention(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), 1.0, "full"),
         "mask must be None, 'causal' or a boolean array"),
        (lambda: prefill.gelu_gated(mx.zeros((2, 3)), mx.zeros((3, 2))), "must have one shape"),
        (lambda: prefill.rms_norm(mx.zeros((2, 3)), mx.zeros((4,)), 1e-6), r"weight must be \[D\] with D=3"),
        (lambda: prefill.rotate(mx.zeros((1, 2, 5, 8)), mx.zeros((5, 3)), mx.zeros((5, 3))),
         r"cos and sin must both be \[L, D/2\]"),
        (lambda: prefill.rotate(mx.zeros((1, 2, 5, 7)), mx.zeros((5, 3)), mx.zeros((5, 3))), "with an even D"),
        (lambda: prefill.linear(mx.zeros((2, 3)), mx.zeros((4, 5))), r"x \[..., K\] and w \[N, K\] do not match"),
        (lambda: prefill.linear(mx.zeros((2, 3)), mx.zeros((4, 5)), transposed=True),
         r"x \[..., K\] and w \[K, N\] do not match"),
        (lambda: prefill.attention(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), mx.zeros((1, 1, 4, 8)), 1.0, None,
                                   isa="sve"), "isa='sve' is not available"),
    ],
)  # fmt: skip
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        mx.eval(call())


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 150), K=st.integers(1, 1700), N=st.integers(1, 130), lead=st.sampled_from([(), (1,), (2, 1)]),
       isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_linear_matches_float64(M, K, N, lead, isa, seed):
    """Past 768 inputs K is cut into equal blocks (kLinearInputs), each added to the output in turn."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    got = np.array(prefill.linear(mx.array(x), mx.array(w), isa=isa))
    want = x.astype(np.float64) @ w.astype(np.float64).T
    # float32 summation of K products: within eps * K * max |x w| (the BLAS's bound too)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1.2e-7 * K * np.abs(x).max() * np.abs(w).max() + 1e-30


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=st.integers(1, 33), K=st.integers(1, 90), N=st.integers(1, 9000), lead=st.sampled_from([(), (1,), (2, 1)]),
       isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_linear_transposed_matches_float64(M, K, N, lead, isa, seed):
    """The few-row kernel on a weight stored transposed ([K, N], the output head's layout): any rows
    (groups of 4 or 8 a tile), inputs past its blocks of 8 (24 above 4 rows), columns past its tiles and
    4096-column chunks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((*lead, M, K)).astype(np.float32)
    wt = rng.standard_normal((K, N)).astype(np.float32)
    got = np.array(prefill.linear(mx.array(x), mx.array(wt), isa=isa, transposed=True))
    want = x.astype(np.float64) @ wt.astype(np.float64)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1.2e-7 * K * np.abs(x).max() * np.abs(wt).max() + 1e-30


@pytest.mark.parametrize("isa", ISAS or ["portable"])
@pytest.mark.parametrize("M", [9, 20, 64])
def test_linear_transposed_of_many_rows_over_long_inputs_matches_float64(isa, M):
    """A canvas's rows against a table stored ``[V, H]`` (DiffusionGemma's self-conditioning
    product ``probs @ E``): blocks of 512 inputs, the last one short, the columns split in two
    chunks (one per core) with columns past the last whole tile."""
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, 1100)).astype(np.float32)
    wt = rng.standard_normal((1100, 300)).astype(np.float32)
    got = np.array(prefill.linear(mx.array(x), mx.array(wt), isa=isa, transposed=True))
    want = x.astype(np.float64) @ wt.astype(np.float64)
    assert np.abs(got - want).max() <= 1.2e-7 * 1100 * np.abs(x).max() * np.abs(wt).max()


@pytest.mark.parametrize("isa", ISAS or ["portable"])
@pytest.mark.parametrize("K, N", [(1, 5), (17, 7), (640, 97), (2048, 50)])
def test_linear_of_up_to_8_rows_matches_float64_and_gives_each_row_the_same_bits_in_any_batch(isa, K, N):
    """Up to 8 rows take the unpacked dot kernel (``linear_dots``): tiles of 4, 3 or 2 weight rows
    and single rows past them, inputs past the last whole vector; each output's sum runs in one
    order, so a row's result does not depend on which rows share its batch."""
    rng = np.random.default_rng(K * 1000 + N)
    x = rng.standard_normal((8, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    alone = [np.array(prefill.linear(mx.array(x[m : m + 1]), mx.array(w), isa=isa)) for m in range(8)]
    for M in range(1, 9):
        got = np.array(prefill.linear(mx.array(x[:M]), mx.array(w), isa=isa))
        assert np.abs(got - want[:M]).max() <= 1.2e-7 * K * np.abs(x).max() * np.abs(w).max()
        assert all(np.array_equal(got[m], alone[m][0]) for m in range(M))


def test_linear_of_strided_inputs_and_270m_shapes():
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((640, 512)).astype(np.float32)).T[None]  # [1, 512, 640], transposed view
    w = mx.array(rng.standard_normal((2048, 640)).astype(np.float32))
    got = prefill.linear(x, w)
    want = np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T
    assert np.abs(np.array(got) - want).max() < 1.2e-7 * 640 * 25
    empty = prefill.linear(mx.zeros((3, 0)), mx.zeros((5, 0)))  # K = 0: zeros, as MLX gives
    assert np.array_equal(np.array(empty), np.zeros((3, 5), np.float32))


def test_linear_layer_takes_every_float32_product_with_rows_and_keeps_its_parameters(monkeypatch):
    import mlx.nn as nn

    base = nn.Linear(24, 40, bias=True)
    layer = prefill.Linear.of(base)
    assert layer.parameters().keys() == base.parameters().keys() and layer.weight is base.weight
    calls, gemm = [], prefill.linear
    monkeypatch.setattr(prefill, "linear", lambda *a: calls.append(a[0].shape) or gemm(*a))
    one, many, none = mx.random.normal((1, 1, 24)), mx.random.normal((2, 33, 24)), mx.zeros((2, 0, 24))
    for x in (one, many):
        assert mx.abs(layer(x) - base(x)).max().item() < 1e-5
    assert layer(none).shape == (2, 0, 40)
    assert calls == [(1, 1, 24), (2, 33, 24)]  # no rows: MLX's
    with backend.using(replace(backend.active(), prefill=False)):
        layer(many)
    with backend.using(backend.MLX):
        layer(many)
    layer(many.astype(mx.bfloat16))
    assert calls == [(1, 1, 24), (2, 33, 24)]


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests import hf_tiny
    from tests.test_convert import _gemma3

    root = tmp_path_factory.mktemp("prefill")
    for name in ("E2B_like", "T1_bias_untied"):
        hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS[name], root / name)
    _gemma3("base", root / "gemma3")
    return root


@pytest.mark.skipif(not precision.fast_cpu_blas(), reason="models.precision leaves the graph as built without a fast BLAS")
@pytest.mark.parametrize("name", ["E2B_like", "T1_bias_untied", "gemma3"])
def test_loaded_models_take_the_kernels_and_match_float64(tiny_folders, name):
    """Loaded as users load them (float32 on this CPU), a 40-token forward through the kernels is
    as close to transformers' float64 logits as the same model through the compiled chains."""
    import transformers

    from tests import hf_tiny

    folder = tiny_folders / name
    model = models.load(str(folder), tokenizer=False)
    linears = [m for _, m in model.graph.named_modules() if isinstance(m, prefill.Linear)]
    assert linears and f"projections on the extension: {len(linears)} (up to 8 rows as dot products, more as a GEMM)" in model.device_notes
    assert any(n.startswith("prefill kernels on both cores: attention, GeGLU gate, RoPE, RMSNorm") for n in model.device_notes)
    head = model.graph.head_module()
    assert not isinstance(head, prefill.Linear)
    ids = np.random.default_rng(7).integers(0, 200, (1, 40))
    hf_class = transformers.Gemma3ForCausalLM if name == "gemma3" else transformers.Gemma4ForCausalLM
    want = hf_tiny.float64_logits(hf_class.from_pretrained(folder).eval(), ids)
    on = np.array(model.logits(mx.array(ids)))
    with backend.using(replace(backend.active(), prefill=False)):
        off = np.array(model.logits(mx.array(ids)))
    assert np.abs(on - want).max() <= max(2 * np.abs(off - want).max(), 1e-5)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), D=st.integers(1, 300), weighted=st.booleans(), lead=st.sampled_from([(), (2,), (1, 3)]),
       isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_rms_norm_matches_float64(rows, D, weighted, lead, isa, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((*lead, rows, D)) * rng.uniform(0.01, 30)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32) if weighted else None
    got = np.array(prefill.rms_norm(mx.array(x), None if w is None else mx.array(w), 1e-6, isa=isa))
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * (1.0 if w is None else w.astype(np.float64))
    scale = 1.0 if w is None else np.abs(w).max()
    # each output: a float32 sum of D squares (relative eps * D / 2 in the norm) and two roundings
    assert np.abs(got - want).max() <= (6e-8 * D + 3e-7) * np.abs(x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)).max() * scale + 1e-30


@pytest.mark.parametrize("isa", ISAS or ["portable"])
def test_rms_norm_of_views_gives_the_bits_of_their_copies(isa):
    """Inputs as the layers hand them: the queries' transposed view of a projection (rows of D
    adjacent floats, far apart), a view whose last axis is strided, a broadcast residual and a
    strided weight: each copied in the evaluation, a row at a time, to the same result as a contiguous copy."""
    rng = np.random.default_rng(11)
    projected = mx.array(rng.standard_normal((2, 37, 3 * 64 + 5)).astype(np.float32))
    heads = projected[..., : 3 * 64].reshape(2, 37, 3, 64).transpose(0, 2, 1, 3)  # [B, H, L, D] view
    across = mx.array(rng.standard_normal((64, 2, 3, 37)).astype(np.float32)).transpose(1, 2, 3, 0)  # last axis strided
    residual = mx.broadcast_to(mx.array(rng.standard_normal(64).astype(np.float32)), (2, 3, 37, 64))
    weight = mx.array(rng.standard_normal(128).astype(np.float32))[::2]
    for x in (heads, across):
        for w, r in ((None, None), (weight, residual)):
            shift = 0.0 if w is None else 1.0
            got = prefill.rms_norm(x, w, 1e-6, shift=shift, residual=r, isa=isa)
            copies = [None if a is None else mx.array(np.array(a)) for a in (x, w, r)]
            want = prefill.rms_norm(copies[0], copies[1], 1e-6, shift=shift, residual=copies[2], isa=isa)
            assert np.array_equal(np.array(got), np.array(want))


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 2), H=st.integers(1, 4), L=st.integers(1, 40), half=st.integers(1, 70), per_row=st.booleans(),
       isa=st.sampled_from(ISAS or ["portable"]), seed=st.integers(0, 2**16))  # fmt: skip
def test_rotate_matches_float64_on_strided_queries(B, H, L, half, per_row, isa, seed):
    rng = np.random.default_rng(seed)
    D = 2 * half
    x = rng.standard_normal((B, L, H, D)).astype(np.float32)  # a projection's layout, viewed [B, H, L, D]
    shape = (B, 1, L, half) if per_row else (L, half)
    angles = rng.uniform(-50, 50, shape)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    got = np.array(prefill.rotate(mx.array(x).transpose(0, 2, 1, 3), mx.array(cos), mx.array(sin), isa=isa))
    xh = x.transpose(0, 2, 1, 3).astype(np.float64)
    x1, x2 = xh[..., :half], xh[..., half:]
    c, s = cos.astype(np.float64), sin.astype(np.float64)
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    assert np.abs(got - want).max() <= 2.5e-7 * np.abs(xh).max()


def test_norm_and_rope_in_cache_take_the_prefill_kernels_for_prefill_rows_only(monkeypatch):
    calls, fused_norm, fused_rotate = [], prefill.rms_norm, prefill.rotate
    monkeypatch.setattr(prefill, "rms_norm", lambda *a: calls.append("norm") or fused_norm(*a))
    monkeypatch.setattr(prefill, "rotate", lambda *a: calls.append("rotate") or fused_rotate(*a))
    x, w = mx.random.normal((1, 20, 64)), mx.random.normal((64,))
    cos, sin = mx.cos(mx.arange(20 * 32).reshape(20, 32) / 7), mx.sin(mx.arange(20 * 32).reshape(20, 32) / 7)
    q = x.reshape(1, 20, 2, 32).transpose(0, 2, 1, 3)
    norm, rotated = fast_math.rms_norm(x, w, 1e-6), fast_math.rotate(q, cos[:, :16], sin[:, :16])
    assert calls == ["norm", "rotate"]
    assert mx.abs(norm - mx.fast.rms_norm(x, w, 1e-6)).max().item() < 1e-5
    assert mx.abs(rotated - fast_math.rotate_half(q, cos[:, :16], sin[:, :16])).max().item() < 1e-5
    with backend.using(replace(backend.active(), decode=False)):  # decode rows: the decode kernels' (tests/test_decode_kernels.py)
        fast_math.rms_norm(x[:, :1], w, 1e-6), fast_math.rotate(q[:, :, :1], cos[:1, :16], sin[:1, :16])
    fast_math.rms_norm(x.astype(mx.bfloat16), w, 1e-6)
    with backend.using(replace(backend.active(), prefill=False)):
        fast_math.rms_norm(x, w, 1e-6), fast_math.rotate(q, cos[:, :16], sin[:, :16])
    assert calls == ["norm", "rotate"]
