"""The CPU speed policy: precision chosen per device, quantized layers on the CPU, the head layout,
the compiled decode pieces. Every speed-up must leave the numbers the same."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models  # noqa: E402
from graphs.gemma3_text import GemmaRMSNorm  # noqa: E402
from graphs.layers import RMSNorm, RoPE  # noqa: E402
from zoo_cpu import backend, switches  # noqa: E402
from graphs import speedups  # noqa: E402
from models import precision  # noqa: E402
from models.generation.generate import generate_tokens  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402

cpu_with_blas = pytest.mark.skipif(
    not (precision.choose_plan().cpu and precision.fast_cpu_blas()), reason="the policy under test is the CPU + fast BLAS one"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T2"], root / "f32")
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["E2B_like"], root / "bf16", dtype=torch.bfloat16)
    return root


def float_dtypes(graph) -> dict[str, mx.Dtype]:
    from mlx.utils import tree_flatten

    return {k: a.dtype for k, a in tree_flatten(graph.parameters()) if mx.issubdtype(a.dtype, mx.floating)}


# ---------------------------------------------------------------------------------------- choose
def test_explicit_and_none_dtypes_are_obeyed():
    assert precision.choose("bfloat16").dtype == mx.bfloat16
    assert precision.choose("float32").dtype == mx.float32
    assert precision.choose(None).dtype is None
    assert not precision.choose("float32").auto


@cpu_with_blas
def test_auto_on_cpu_upcasts_bf16_but_keeps_gather_only_tables():
    weights = {"embed_tokens.weight": mx.zeros((8, 4), mx.bfloat16), "embed_tokens_per_layer.weight": mx.zeros((8, 4), mx.bfloat16)}
    chosen = precision.choose("auto", weights)
    assert chosen.dtype == mx.float32 and chosen.auto
    cast = precision.cast_weights(weights, chosen)
    assert cast["embed_tokens.weight"].dtype == mx.float32
    assert cast["embed_tokens_per_layer.weight"].dtype == mx.bfloat16
    assert "float32" in chosen.describe()


@cpu_with_blas
def test_auto_keeps_bf16_when_float32_would_not_fit(monkeypatch):
    monkeypatch.setattr(precision, "physical_memory", lambda: 64)
    chosen = precision.choose("auto", {"w": mx.zeros((8, 4), mx.bfloat16)})
    assert chosen.dtype is None and "over 50%" in chosen.reason


def test_auto_without_a_fast_blas_keeps_the_checkpoint_dtype(monkeypatch):
    monkeypatch.setattr(precision, "fast_cpu_blas", lambda: False)
    assert precision.choose("auto", {"w": mx.zeros((8, 4), mx.bfloat16)}, precision.choose_plan("cpu")).dtype is None


def test_the_plan_is_one_value_chosen_by_name_switch_or_device():
    cpu, accelerator = precision.choose_plan("cpu"), precision.choose_plan("accelerator")
    assert cpu.cpu and not cpu.overlap and cpu.backend == backend.for_cpu()
    assert not accelerator.cpu and accelerator.overlap and accelerator.backend == backend.MLX
    assert precision.choose("auto", {"w": mx.zeros((8, 4), mx.bfloat16)}, accelerator).dtype is None
    with switches.override(GEMMA_ZOO_PLAN="accelerator"):
        assert precision.choose_plan().name == "accelerator" and "GEMMA_ZOO_PLAN" in precision.choose_plan().reason
    with switches.override(GEMMA_ZOO_PLAN="auto"):
        auto = precision.choose_plan()
        assert auto.name == ("cpu" if mx.default_device() == mx.cpu else "accelerator")
        assert "default device" in auto.reason
    with pytest.raises(ValueError, match="plan='gpu' is not a device plan"):
        precision.choose_plan("gpu")


# ---------------------------------------------------------------------------------------- load
@cpu_with_blas
def test_bf16_checkpoint_loads_in_float32_on_cpu_and_equals_an_explicit_cast(checkpoints):
    auto = models.load(str(checkpoints / "bf16"), tokenizer=False)
    dtypes = float_dtypes(auto.graph)
    assert dtypes["embed_tokens_per_layer.weight"] == mx.bfloat16  # gathered only: kept as stored
    assert all(d == mx.float32 for k, d in dtypes.items() if "embed_tokens_per_layer" not in k)
    explicit = models.load(str(checkpoints / "bf16"), tokenizer=False, dtype="float32")
    ids = [[2, 17, 99, 4, 56, 200, 31, 7]]
    # Rows of a bf16 table cast to float32 on read are the rows cast on load: the same numbers.
    np.testing.assert_allclose(np.array(auto.logits(ids)), np.array(explicit.logits(ids)), atol=1e-5)
    assert auto.precision.auto and auto.device_notes


@cpu_with_blas
def test_head_relayout_changes_no_value(checkpoints):
    model = models.load(str(checkpoints / "f32"), tokenizer=False)
    plain = models.load(str(checkpoints / "f32"), tokenizer=False, dtype=None)
    plain.graph.embed_tokens.weight = mx.contiguous(plain.graph.embed_tokens.weight)  # undo, to compare
    assert any("transposed" in note for note in model.device_notes)
    assert mx.array_equal(model.graph.embed_tokens.weight, plain.graph.embed_tokens.weight).item()
    ids = [[2, 17, 99, 4, 56, 200, 31, 7]]
    np.testing.assert_allclose(np.array(model.logits(ids)), np.array(plain.logits(ids)), atol=1e-5)
    prompt = [2, 17, 99, 4, 56, 200, 31]
    a = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=16))
    b = list(generate_tokens(plain.forward, prompt, plain.make_cache(), max_tokens=16))
    assert a == b


@cpu_with_blas
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_layers_dequantized_on_cpu_give_the_quantized_model(checkpoints, monkeypatch, bits):
    folder = str(checkpoints / "f32")
    with switches.override(GEMMA_ZOO_CPU_QUANT="as-stored"):
        stored = models.load(folder, tokenizer=False, q_bits=bits, q_group_size=32)
    with switches.override(GEMMA_ZOO_CPU_QUANT="dequantize"):
        dense = models.load(folder, tokenizer=False, q_bits=bits, q_group_size=32)
    assert not precision._quantized_leaves(dense.graph)
    assert any("dequantized" in note for note in dense.device_notes)
    with switches.override(GEMMA_ZOO_CPU_QUANT="fp32-scales"):
        scaled = models.load(folder, tokenizer=False, q_bits=bits, q_group_size=32)
    leaves = precision._quantized_leaves(scaled.graph)
    assert leaves and all(m.scales.dtype == mx.float32 for _, m in leaves)
    ids = qt.token_ids(3, 24, 256)
    want = stored.logits(ids)
    for got in (dense.logits(ids), scaled.logits(ids)):
        assert qt.max_relative_difference(got, want) < 1e-4


@cpu_with_blas
def test_auto_quantized_policy_falls_back_to_packed_when_memory_is_short(checkpoints, monkeypatch):
    monkeypatch.setattr(precision, "physical_memory", lambda: 1024)
    with switches.override(GEMMA_ZOO_CPU_QUANT="auto"):
        model = models.load(str(checkpoints / "f32"), tokenizer=False, q_bits=4, q_group_size=32)
    assert precision._quantized_leaves(model.graph)
    assert any("packed with float32 scales" in note for note in model.device_notes)


def test_unknown_quantized_policy_is_refused(monkeypatch):
    monkeypatch.setenv(precision.QUANT_SWITCH, "fast")
    switches.reload()
    try:
        with pytest.raises(ValueError, match="GEMMA_ZOO_CPU_QUANT"):
            precision.quantized_policy(nn.Linear(2, 2))
    finally:
        monkeypatch.delenv(precision.QUANT_SWITCH)
        switches.reload()


# ---------------------------------------------------------------------------------------- compiled pieces
@pytest.mark.parametrize("kind", ["default", "proportional"])
@pytest.mark.parametrize("norm_kind", ["gemma3", "gemma4", "gemma4_no_weight"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fused_norm_rope_is_bit_identical(kind, norm_kind, dtype):
    D = 64
    params = {"rope_type": kind, "rope_theta": 10000.0}
    if kind == "proportional":
        params.update(partial_rotary_factor=0.25, rope_theta=1e6)
    rope = RoPE(D, params)
    norm = {"gemma3": GemmaRMSNorm(D, 1e-6), "gemma4": RMSNorm(D, 1e-6), "gemma4_no_weight": RMSNorm(D, 1e-6, with_weight=False)}[norm_kind]
    if "weight" in norm:
        norm.weight = mx.random.normal((D,), key=mx.random.key(1)) * 0.1
    for offset in (0, 5, 4097):
        x = mx.random.normal((1, 4, 1, D), key=mx.random.key(offset)).astype(dtype)
        got = speedups.norm_rope(x, norm, rope, offset, plus_one=norm_kind == "gemma3")
        assert got.dtype == dtype
        assert mx.array_equal(got, rope(norm(x), offset)).item()


def test_fused_norm_rope_follows_the_backend_selected_after_its_first_trace():
    """A trace made under one backend is not reused under another (the suite once ran a test whose
    trace used MLX's norm before one that compared against the kernels' norm)."""
    D = 64
    rope = RoPE(D, {"rope_type": "default", "rope_theta": 10000.0})
    norm = GemmaRMSNorm(D, 1e-6)
    norm.weight = mx.random.normal((D,), key=mx.random.key(1)) * 0.1
    x = mx.random.normal((1, 4, 1, D), key=mx.random.key(3))
    for chosen in (backend.Backend(True, False, False), backend.for_cpu(), backend.Backend(True, False, False)):
        with backend.using(chosen):
            assert mx.array_equal(speedups.norm_rope(x, norm, rope, 7, plus_one=True), rope(norm(x), 7)).item(), chosen


def test_compiled_decode_generates_the_same_tokens(checkpoints, monkeypatch):
    model = models.load(str(checkpoints / "f32"), tokenizer=False)
    prompt = [2, 17, 99, 4, 56, 200, 31]
    compiled = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=24))
    with switches.override(GEMMA_ZOO_COMPILE="0"):
        plain = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=24))
    assert compiled == plain


# ---------------------------------------------------------------------------------------- CPU streams
@cpu_with_blas
def test_split_head_and_parallel_mlp_keep_the_numbers(checkpoints, monkeypatch):
    model = models.load(str(checkpoints / "f32"), tokenizer=False)
    assert model.graph.head_blocks is not None
    assert any("on 2 CPU streams" in note for note in model.device_notes)
    assert any("split across 2 CPU streams" in note for note in model.device_notes)
    ids = [[2, 17, 99, 4, 56, 200, 31, 7]]
    prompt = [2, 17, 99, 4, 56, 200, 31]
    split_tokens = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=24))
    head = model.graph.head_module().weight
    for rows in (1, 5, 8, 32):  # one row: the streams; 2-32 (a verify block, a batch): the few-row kernel
        h = mx.random.normal((1, rows, head.shape[1]), key=mx.random.key(rows))
        assert mx.abs(model.graph.head_product(h) - h @ head.T).max().item() < 1e-4
    long_ids = [list(range(3, 40))]
    split_prefill = model.logits(long_ids)  # 37 rows: the BLAS threads these itself, nothing split
    cache = model.make_cache()
    model.logits(ids[0][:-1], cache)
    split_last = model.logits(ids[0][-1:], cache)
    with switches.override(GEMMA_ZOO_STREAMS="0"):
        model = models.load(str(checkpoints / "f32"), tokenizer=False)
    assert model.graph.head_blocks is not None and not model.graph.head_blocks.blocks  # stored transposed, not split
    assert not any("CPU streams" in note for note in model.device_notes)  # --verbose says what is in effect
    plain_tokens = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=24))
    cache = model.make_cache()
    model.logits(ids[0][:-1], cache)
    plain_last = model.logits(ids[0][-1:], cache)
    assert split_tokens == plain_tokens
    assert mx.array_equal(split_prefill, model.logits(long_ids)).item()
    # The head's two halves are summed: the same product up to float32 rounding.
    np.testing.assert_allclose(np.array(split_last), np.array(plain_last), rtol=1e-5, atol=1e-5)


@cpu_with_blas
def test_replaced_head_weight_is_never_read_from_stale_blocks(checkpoints):
    model = models.load(str(checkpoints / "f32"), tokenizer=False)
    graph = model.graph
    h = mx.random.normal((1, 1, graph.config.hidden_size), key=mx.random.key(3))
    graph.embed_tokens.weight = graph.embed_tokens.weight * 2  # e.g. new weights loaded
    want = graph.embed_tokens.as_linear(h)
    assert mx.array_equal(graph.head_product(h), want).item()


def test_the_memory_rule_keeps_quantized_weights_that_would_not_fit_dequantized(monkeypatch):
    graph = nn.Sequential(nn.Linear(64, 64))  # 16,640 float32 bytes with its bias
    monkeypatch.setattr(precision, "physical_memory", lambda: 10_000)
    choice, why = precision._memory_rule(graph, [])
    assert choice == "fp32-scales" and why.startswith(f"dequantized it would take 0.0 GiB, over {precision.MEMORY_SHARE:.0%} of 0 GiB")
    monkeypatch.setattr(precision, "physical_memory", lambda: None)  # unknown: dequantize
    assert precision._memory_rule(graph, [])[0] == "dequantize"
