"""GGUF tensors repacked into MLX's affine layout (``weights.gguf_packed``) and the packed folder.

Fast: random Q8_0 / Q5_0 / Q4_K blocks (gguf-py quantizes the first two; Q4_K is random bytes,
as gguf-py cannot quantize K-types) must dequantize through ``mx.dequantize`` to exactly what
``gguf.quants.dequantize`` gives; the tiny Gemma 3 GGUF of ``tests/test_gguf_import.py``
converted with ``packed=True`` must load through ``models.load`` and match its float import.
Slow: the real Q4_K_M file as the zoo's ``gemma-3-270m-q4km``, every exactly repacked tensor equal
to the float32 ``gemma-3-270m``'s, and its teacher-forced logits scored against float32 as
``tests/test_packed_real.py`` scores the other quantized zoo models (numbers in docs/quantization.md).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from zoo_cpu import extension, packed as zoo_packed
import models
from models.assets.gemma3_270m import gemma3_270m_gguf
from models.zoo import ZOO
from weights.gguf_gemma3 import hf_tensor_name
from weights.gguf_import import convert_gguf, read_gguf
from weights.gguf_packed import EXACT_TYPES, pack_tensor

transformers = pytest.importorskip("transformers")

from tests.test_gguf_import import CONFIG, _k_quant_bytes, _write_gguf  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests.test_packed_real import _chunked  # noqa: E402
from tests.test_quantized_weights_real import folder, ids, reference_logits  # noqa: E402,F401  (fixtures)
from zoo_cpu import switches


class _Tensor:
    """What ``pack_tensor`` reads of a ``GGUFReader`` tensor."""

    def __init__(self, name: str, data: np.ndarray, kind: Q):
        self.name, self.data, self.tensor_type = name, data, kind


def _payload(kind: Q, rows: int, cols: int, rng) -> np.ndarray:
    if kind == Q.Q4_K:
        return _k_quant_bytes(kind, rows, cols, rng)
    return quantize(rng.normal(0.0, 0.5, size=(rows, cols)).astype(np.float32), kind)


@pytest.mark.parametrize("kind", sorted(EXACT_TYPES), ids=lambda k: k.name)
def test_exact_types_dequantize_to_the_gguf_values(kind):
    rng = np.random.default_rng(int(kind))
    data = _payload(kind, 8, 512, rng)
    packed = pack_tensor(_Tensor("blk.0.x.weight", data, kind))
    want = dequantize(data, kind).reshape(8, 512)
    assert packed.exact and packed.group_size == 32 and packed.bits == (4 if kind == Q.Q4_K else 8)
    np.testing.assert_array_equal(np.array(packed.dequantized()), want)
    if kind != Q.Q4_K:  # fp16 d times a power of two or a 5-bit integer: float16 holds it
        assert packed.scales.dtype == mx.float16 and packed.biases.dtype == mx.float16


def test_q4_k_scales_narrow_to_float16_only_when_exact():
    rng = np.random.default_rng(1)
    data = _k_quant_bytes(Q.Q4_K, 4, 256, rng)
    data[:, 0:4] = np.array([0.25, 0.125], dtype=np.float16).view(np.uint8)  # d, dmin: times 6-bit ints fit f16
    assert pack_tensor(_Tensor("t", data, Q.Q4_K)).scales.dtype == mx.float16
    data[:, 0:2] = np.array([0.1], dtype=np.float16).view(np.uint8)  # 11 significant bits times up to 6 more
    packed = pack_tensor(_Tensor("t", data, Q.Q4_K))
    assert packed.scales.dtype == mx.float32
    np.testing.assert_array_equal(np.array(packed.dequantized()), dequantize(data, Q.Q4_K).reshape(4, 256))


def test_other_types_are_requantized_at_8_bits_and_float_tensors_refused():
    rng = np.random.default_rng(2)
    data = _k_quant_bytes(Q.Q6_K, 4, 256, rng)
    with pytest.raises(ValueError, match="requantized from its values"):
        pack_tensor(_Tensor("blk.0.ffn_down.weight", data, Q.Q6_K))
    values = dequantize(data, Q.Q6_K).reshape(4, 256)
    packed = pack_tensor(_Tensor("blk.0.ffn_down.weight", data, Q.Q6_K), values)
    assert not packed.exact and (packed.bits, packed.group_size) == (8, 32)
    assert packed.scales.dtype == (mx.float16 if np.abs(values).max() < 60_000 else mx.float32)
    step = (values.reshape(4, -1, 32).max(-1) - values.reshape(4, -1, 32).min(-1)) / 255
    assert (np.abs(np.array(packed.dequantized()) - values).reshape(4, -1, 32).max(-1) <= step).all()  # within one step
    small = values / np.abs(values).max()  # within float16's range: float16 scales and biases
    assert pack_tensor(_Tensor("blk.0.ffn_down.weight", data, Q.Q6_K), small).scales.dtype == mx.float16
    with pytest.raises(ValueError, match="'norm' is F32, a float tensor"):
        pack_tensor(_Tensor("norm", np.zeros(4, np.float32), Q.F32))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_packed")
    _write_gguf(root / "tiny.gguf")
    dense = convert_gguf(root / "tiny.gguf", root / "float", chat_template="{{ bos_token }}", progress=False)
    packed = convert_gguf(root / "tiny.gguf", root / "packed", chat_template="{{ bos_token }}", progress=False, packed=True)
    return root / "tiny.gguf", dense, packed


@pytest.mark.skipif(not extension.status().available, reason=f"packed kernels unavailable: {extension.describe()}")
def test_packed_folder_holds_the_gguf_grid_and_loads(folders):
    gguf, dense, packed = folders
    config = json.loads((packed / "config.json").read_text())
    entry = config["quantization"]
    assert entry["bits"] == 8 and entry["group_size"] == 32 and config["quantization_config"] == entry
    stored = mx.load(str(packed / "model.safetensors"))
    floats = mx.load(str(dense / "model.safetensors"))
    reader, _ = read_gguf(gguf)
    layers = CONFIG["num_hidden_layers"]
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, layers)
        module = name.removesuffix(".weight")
        if name.endswith("norm.weight") or Q(tensor.tensor_type) in (Q.F16, Q.BF16):
            assert f"{module}.scales" not in stored and stored[name].dtype == mx.float32, name
            assert entry.get(module, None if name.endswith("norm.weight") else "missing") in (None, False), name
            continue
        bits = 4 if Q(tensor.tensor_type) == Q.Q4_K else 8
        assert entry.get(module, {"bits": 8, "group_size": 32}) == {"bits": bits, "group_size": 32}, name
        values = mx.dequantize(stored[name], stored[f"{module}.scales"].astype(mx.float32),
                               stored[f"{module}.biases"].astype(mx.float32), group_size=32, bits=bits)  # fmt: skip
        if Q(tensor.tensor_type) in EXACT_TYPES:
            np.testing.assert_array_equal(np.array(values), np.array(floats[name]), err_msg=name)
        else:
            want = np.array(floats[name])  # requantized at 8 bits: within one step of the widest group's range
            np.testing.assert_allclose(np.array(values), want, rtol=0, atol=2 * np.abs(want).max() / 255, err_msg=name)
    ids = [[2] + np.random.default_rng(3).integers(3, CONFIG["vocab_size"], 11).tolist()]
    want = models.load(str(dense), tokenizer=False).logits(ids)
    with switches.override(GEMMA_ZOO_CPU_QUANT="packed"):
        loaded = models.load(str(packed), tokenizer=False)
    assert isinstance(loaded.graph.embed_tokens, zoo_packed.PackedEmbedding)
    got = loaded.logits(ids)
    assert float(mx.abs(got - want).max()) <= 0.05 * float(mx.abs(want).max())


@pytest.mark.slow
@pytest.mark.skipif(not extension.status().available, reason=f"packed kernels unavailable: {extension.describe()}")
def test_real_q4_k_m_file_packed_matches_float32(folder, ids, reference_logits, capsys):
    """The zoo's ``gemma-3-270m-q4km``: every exactly repacked tensor equals the float32 folder's
    (the GGUF's dequantized values: the embedding, six projections a layer and the nine Q4_K ffn_down), and it loads onto the packed kernels and scores close to float32
    (only ffn_down's Q6_K layers, requantized at 8 bits, differ)."""
    packed = ZOO["gemma-3-270m-q4km"]()
    assert ZOO["gemma-3-270m-q4km"]() == packed and packed.parent == folder.parent
    stored, floats = mx.load(str(packed / "model.safetensors")), mx.load(str(folder / "model.safetensors"))
    reader, metadata = read_gguf(gemma3_270m_gguf())
    exact = 0
    for tensor in reader.tensors:
        if Q(tensor.tensor_type) in EXACT_TYPES:
            name = hf_tensor_name(tensor.name, int(metadata["gemma3.block_count"]))
            module = name.removesuffix(".weight")
            bits = 4 if Q(tensor.tensor_type) == Q.Q4_K else 8
            values = mx.dequantize(stored[name], stored[f"{module}.scales"].astype(mx.float32),
                                   stored[f"{module}.biases"].astype(mx.float32), group_size=32, bits=bits)  # fmt: skip
            assert mx.array_equal(values, floats[name]).item(), name
            exact += 1
    with switches.override(GEMMA_ZOO_CPU_QUANT="packed"):
        model = models.load("gemma-3-270m-q4km", tokenizer=False)
    assert isinstance(model.graph.embed_tokens, zoo_packed.PackedEmbedding)
    kl, kl_max, top1 = qt.kl_and_top1(reference_logits, model.logits([ids]))
    chunked = qt.kl_and_top1(reference_logits, _chunked(model, ids, zoo_packed.KERNEL_ROWS))  # every product in the kernel
    with capsys.disabled():
        print(f"\n[gemma-3-270m-q4km] {exact} tensors exact; {len(ids)} positions: KL mean {kl:.5f} max {kl_max:.4f} nats, "
              f"top-1 {top1:.4f}; in chunks of {zoo_packed.KERNEL_ROWS}: KL mean {chunked[0]:.5f} max {chunked[1]:.4f}, top-1 {chunked[2]:.4f}")  # fmt: skip
    assert exact == 1 + 18 * 6 + 9 and kl <= 0.01 and top1 >= 0.95
    assert abs(chunked[0] - kl) <= 1e-4 and abs(chunked[2] - top1) <= 1 / len(ids)
