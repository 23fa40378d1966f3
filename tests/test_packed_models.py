"""Whole models through the packed kernels: the CPU policy puts ``zoo_packed.PackedLinear`` /
``PackedEmbedding`` in place of every 4/8-bit layer, and the logits and greedy tokens are those of
the same quantized model run as stored (MLX's own quantized matmul) and dequantized to float32.

Tiny random checkpoints saved by transformers: Gemma 4 (T1 with attention biases and an untied
head, E2B-like with per-layer inputs and KV sharing) and Gemma 3 (tied head); prompts long enough
that prefill chunks take the dequantize-then-BLAS path and decode steps take the kernel.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zoo_cpu import extension, packed as zoo_packed  # noqa: E402
import models  # noqa: E402
from zoo_cpu import switches  # noqa: E402
from models import precision  # noqa: E402
from models.convert import convert  # noqa: E402
from graphs.layers import GeGLUMLP, SelfAttention  # noqa: E402
from models.generation.generate import generate_tokens  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests.test_convert import _gemma3  # noqa: E402
from weights.quantize import QuantizationPolicy  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (extension.status().available and precision.choose_plan().cpu and precision.fast_cpu_blas()),
    reason=f"the packed CPU path is not in use here ({extension.describe()})",
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T1_bias_untied"], root / "T1_bias_untied")
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["E2B_like"], root / "E2B_like")
    hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T3"], root / "T3")
    _gemma3("base", root / "gemma3")
    return root


def _load(folder, policy: str, bits: int, group: int, **kwargs):
    with switches.override(GEMMA_ZOO_CPU_QUANT=policy):
        if kwargs:
            return models.load(str(folder), tokenizer=False, **kwargs)
        return models.load(str(folder), tokenizer=False, q_bits=bits, q_group_size=group)


@pytest.mark.parametrize("name", ["T1_bias_untied", "E2B_like", "gemma3"])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_packed_model_equals_the_stored_and_dequantized_ones(folders, name, bits, group):
    packed = _load(folders / name, "packed", bits, group)
    stored = _load(folders / name, "as-stored", bits, group)
    dense = _load(folders / name, "dequantize", bits, group)
    layers = [m for _, m in packed.graph.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert layers and all(isinstance(m, (zoo_packed.PackedLinear, zoo_packed.PackedEmbedding)) for m in layers)
    assert any(note.startswith(f"quantized layers: {len(layers)} packed with float32 scales") for note in packed.device_notes)
    ids = qt.token_ids(5, 40, 256)  # more rows than zoo_packed.KERNEL_ROWS: the dequantize-then-BLAS path
    want = stored.logits(ids)
    assert qt.max_relative_difference(packed.logits(ids), want) < 1e-4
    assert qt.max_relative_difference(dense.logits(ids), want) < 1e-4
    prompt = ids[0][:24]
    a = list(generate_tokens(packed.forward, prompt, packed.make_cache(), max_tokens=12))
    b = list(generate_tokens(dense.forward, prompt, dense.make_cache(), max_tokens=12))
    assert a == b


def _unfused(model):
    for _, module in model.graph.named_modules():
        if getattr(module, "fused", None) is not None:
            module.fused = None
    return model


def _stepwise(model, ids: list[int], prompt: int) -> mx.array:
    cache = model.make_cache()
    parts = [model.logits([ids[:prompt]], cache)] + [model.logits([[t]], cache) for t in ids[prompt:]]
    return mx.concatenate(parts, axis=1)


@pytest.mark.parametrize("name", ["T1_bias_untied", "E2B_like", "T3", "gemma3"])
@pytest.mark.parametrize("compile_step", ["1", "0"])
@pytest.mark.parametrize("policy", ["packed", "dequantize"])
def test_fused_products_give_the_unfused_logits(folders, name, compile_step, policy):
    """q/k/v (K=V layers: q/k; KV-shared layers: none) and up/gate as one product each, packed or
    float32: the parameters and the logits are the unfused model's, decode steps bit for bit (each
    output row is computed alone), with the decode step compiled whole or not."""
    fused = _load(folders / name, policy, 4, 32)
    plain = _unfused(_load(folders / name, policy, 4, 32))
    if policy == "dequantize":  # float32 layers: not fused by the policy (yet), fused here
        for _, module in fused.graph.named_modules():
            if isinstance(module, (SelfAttention, GeGLUMLP)) and len(module.fusable()) > 1:
                module.fuse()
    count = sum(getattr(m, "fused", None) is not None for _, m in fused.graph.named_modules())
    assert count
    if policy == "packed":
        assert any(n.startswith(f"{count} fused products") for n in fused.device_notes)
    mine, theirs = dict(tree_flatten(fused.graph.parameters())), dict(tree_flatten(plain.graph.parameters()))
    assert mine.keys() == theirs.keys() and all(mx.array_equal(mine[k], theirs[k]).item() for k in mine)
    ids = qt.token_ids(7, 44, 256)
    assert qt.max_relative_difference(fused.logits(ids), plain.logits(ids)) < 1e-5
    with switches.override(GEMMA_ZOO_COMPILE_STEP=compile_step):
        a, b = _stepwise(fused, ids[0], 36), _stepwise(plain, ids[0], 36)
    assert qt.max_relative_difference(a[:, :36], b[:, :36]) < 1e-5
    assert mx.array_equal(a[:, 36:], b[:, 36:]).item()


def test_fused_products_step_aside_for_a_replaced_weight(folders):
    model = _load(folders / "gemma3", "packed", 8, 64)
    attn = model.graph.layers[0].self_attn
    ids = qt.token_ids(8, 6, 256)
    before = model.logits(ids)
    attn.k_proj.weight = mx.array(attn.k_proj.weight)  # the same values in another array
    assert attn.fused(mx.zeros((1, 1, attn.q_proj.weight.shape[1] * 32 // 8))) is None
    assert mx.array_equal(model.logits(ids), before).item()


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_scales_are_read_as_stored(folders, tmp_path, bits):
    """A pre-quantized folder's bf16 scales and biases stay bf16 (the kernels read them; 2 bytes a
    group less per token) while everything else computes in float32: the float32-scale model's logits."""
    folder = tmp_path / "bf16"
    convert(str(folders / "T1_bias_untied"), folder, q_bits=bits, q_group_size=32, dtype="bfloat16")
    with switches.override(GEMMA_ZOO_CPU_QUANT="packed"):
        packed = models.load(str(folder), tokenizer=False)
    with switches.override(GEMMA_ZOO_CPU_QUANT="fp32-scales"):
        scaled = models.load(str(folder), tokenizer=False)
    layer = packed.graph.layers[0].mlp.up_proj
    assert isinstance(layer, zoo_packed.PackedLinear) and layer.scales.dtype == layer.biases.dtype == mx.bfloat16
    assert packed.graph.layers[0].input_layernorm.weight.dtype == mx.float32
    assert any("packed with bfloat16 scales" in note for note in packed.device_notes)
    ids = qt.token_ids(4, 20, 256)
    assert qt.max_relative_difference(packed.logits(ids), scaled.logits(ids)) < 1e-4


@pytest.mark.parametrize("bits", [4, 8])
def test_the_zoo_policies_convert_and_run_packed(folders, tmp_path, bits):
    """The zoo's quantized 270M policies (float16 scales; at 4 bits an 8-bit g64 embedding and tied
    head) on a tiny Gemma 3: the written folder says so, the kernels read the float16 scales, and the
    logits are those of the same folder dequantized to float32 (run as stored, MLX would compute in
    float16 from those scales)."""
    from models.zoo import QUANTIZED_270M, policy_name

    policy = QUANTIZED_270M[bits]
    assert policy_name(policy) == {8: "8bit-g64-e8g64-f16", 4: "4bit-g32-e8g64-f16"}[bits]
    folder = tmp_path / policy_name(policy)
    convert(str(folders / "gemma3"), folder, q_policy=policy)
    packed = _load(folder, "packed", 0, 0, dtype="auto")
    embed = packed.graph.embed_tokens
    assert isinstance(embed, zoo_packed.PackedEmbedding) and (embed.bits, embed.group_size) == (8, 64)
    layer = packed.graph.layers[0].mlp.up_proj
    assert (layer.bits, layer.group_size) == (bits, policy.group_size)
    assert layer.scales.dtype == layer.biases.dtype == embed.scales.dtype == mx.float16
    ids = qt.token_ids(6, 40, 256)
    want = _load(folder, "dequantize", 0, 0, dtype="auto").logits(ids)
    assert qt.max_relative_difference(packed.logits(ids), want) < 1e-4


def test_a_policy_names_a_bad_scale_dtype():
    with pytest.raises(ValueError, match="scale_dtype='float64'"):
        QuantizationPolicy(4, 32, scale_dtype="float64")
    with pytest.raises(ValueError, match="embed_group_size"):
        QuantizationPolicy(4, 32, embed_group_size=48)


def test_auto_takes_the_kernels_and_an_explicit_packed_without_them_is_refused(folders, monkeypatch):
    model = _load(folders / "gemma3", "auto", 8, 64)
    assert isinstance(model.graph.embed_tokens, zoo_packed.PackedEmbedding)
    monkeypatch.setattr(extension, "_status", extension.Status(None, "not built at install time: no compiler"))
    with pytest.raises(RuntimeError, match="GEMMA_ZOO_CPU_QUANT=packed, but the packed 4/8-bit kernels are off: not built"):
        _load(folders / "gemma3", "packed", 8, 64)
    fallback = _load(folders / "gemma3", "auto", 8, 64)
    assert not precision._quantized_leaves(fallback.graph)
    assert any("packed 4/8-bit kernels off: not built at install time: no compiler" in n for n in fallback.device_notes)


@pytest.mark.parametrize("policy,rest", [("auto", "dequantized to float32"), ("packed", "kept packed with float32 scales")])
def test_layers_the_kernels_do_not_take(folders, policy, rest):
    """3-bit layers have no kernel: under ``auto`` the memory rule (dequantized), under ``packed``
    kept packed (MLX's quantized matmul); said beside the packed (8-bit) embedding."""
    q_policy = QuantizationPolicy(3, 32, embed_bits=8)
    model = _load(folders / "gemma3", policy, 0, 0, q_policy=q_policy)
    assert isinstance(model.graph.embed_tokens, zoo_packed.PackedEmbedding)
    left = [type(m) for _, m in precision._quantized_leaves(model.graph)]
    assert left[0] is zoo_packed.PackedEmbedding and all(t is nn.QuantizedLinear for t in left[1:])
    assert len(left) == (1 if policy == "auto" else 1 + 6 * 7)
    assert any("quantized layers: 1 packed" in n and rest in n for n in model.device_notes)
    ids = qt.token_ids(1, 8, 256)
    want = _load(folders / "gemma3", "as-stored", 0, 0, q_policy=q_policy).logits(ids)
    assert qt.max_relative_difference(model.logits(ids), want) < 1e-4
