"""GGUF tensors as MLX affine-quantized weights (packed uint32 codes, per-group scales and biases).

Three of llama.cpp's block types are MLX's affine layout (``w = scale * code + bias`` per group of
32 along the input axis) in other clothes, so they are repacked without rounding anything: the
codes are copied and ``mx.dequantize`` of the result gives exactly the float32 values
``gguf.quants.dequantize`` gives (the bit layouts below are read off gguf-py's own decoders):

- ``Q8_0`` (fp16 ``d``, 32 int8 ``q``; ``d * q``): 8 bits, code ``q + 128``, scale ``d``, bias ``-128 d``;
- ``Q5_0`` (fp16 ``d``, 32 low nibbles in 16 bytes plus a uint32 of high bits; ``d * (q - 16)``):
  8 bits, code ``q``, scale ``d``, bias ``-16 d``;
- ``Q4_K`` (super-blocks of 256: fp16 ``d`` and ``dmin``, eight 6-bit sub-block scales ``sc`` and
  mins ``m``, 4-bit ``q``; ``d sc q - dmin m``): 4 bits, scale ``d sc``, bias ``-dmin m`` per 32.

The scales and biases of Q8_0 and Q5_0 are fp16 numbers times a power of two, so they are stored
in float16; Q4_K's products of an fp16 number and a 6-bit integer need up to 17 significant bits,
so they are stored in float16 only where every one of them fits, else in float32. Every other
weight type (Q6_K's 16-value sub-blocks with their own int8 scales do not sit on a 32-group
grid) is dequantized and requantized by ``mx.quantize`` at 8 bits, group 32, with float16 scales
and biases (on the 270M's Q6_K layers float32 ones score the same: docs/quantization.md) unless
they lie past float16's range.
Float tensors (F32 / F16 / BF16) have nothing to pack and are refused (``convert_gguf`` writes
them as float arrays).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

GROUP = 32
REQUANTIZED_BITS = 8
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


@dataclass(frozen=True)
class PackedTensor:
    """One weight in MLX's affine layout: ``weight`` uint32 ``(out, in * bits / 32)``, ``scales`` and
    ``biases`` ``(out, in / group_size)``; ``exact`` when no value was rounded on the way."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    exact: bool

    def dequantized(self) -> mx.array:
        """The float32 values (scales and biases widened first, so half-precision ones round nothing)."""
        return mx.dequantize(
            self.weight, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
            group_size=self.group_size, bits=self.bits,
        )


def pack_tensor(tensor, dense: np.ndarray | None = None) -> PackedTensor:
    """The packed form of a quantized GGUF tensor (a ``gguf.GGUFReader`` tensor).

    ``dense`` is its float32 values in ``(out, in)`` layout, needed (and only read) for the types
    that are requantized; a float tensor is refused (it has nothing to pack).
    """
    kind = GGMLQuantizationType(tensor.tensor_type)
    if kind in FLOAT_TYPES:
        raise ValueError(f"GGUF packing: tensor {tensor.name!r} is {kind.name}, a float tensor with nothing to pack")
    if kind not in EXACT_TYPES:
        if dense is None:
            raise ValueError(f"GGUF packing: tensor {tensor.name!r} is {kind.name}, requantized from its values: pass them")
        weight, scales, biases = mx.quantize(mx.array(dense, dtype=mx.float32), group_size=GROUP, bits=REQUANTIZED_BITS)
        widest = max(mx.abs(scales).max().item(), mx.abs(biases).max().item())
        if widest <= float(np.finfo(np.float16).max):
            scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
        return PackedTensor(weight, scales, biases, REQUANTIZED_BITS, GROUP, exact=False)
    block_bytes, block_values, unpack = _FORMATS[kind]
    data = np.asarray(tensor.data, dtype=np.uint8)
    rows = data.shape[0]
    if data.ndim != 2 or data.shape[1] % block_bytes:
        raise ValueError(f"GGUF packing: tensor {tensor.name!r} ({kind.name}) has rows of {data.shape[1:]} bytes, not whole blocks")
    blocks = data.reshape(rows, -1, block_bytes)
    codes, scales, biases, bits = unpack(blocks)
    columns = blocks.shape[1] * block_values
    return PackedTensor(
        _pack_codes(codes.reshape(rows, columns), bits),
        mx.array(scales.reshape(rows, columns // GROUP)),
        mx.array(biases.reshape(rows, columns // GROUP)),
        bits, GROUP, exact=True,
    )


def _q8_0(blocks: np.ndarray):
    d = blocks[..., :2].copy().view(np.float16)
    codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, _scaled(d, -128), 8


def _q5_0(blocks: np.ndarray):
    d = blocks[..., :2].copy().view(np.float16)
    high = blocks[..., 2:6].copy().view("<u4")  # bit i is value i's fifth bit
    qs = blocks[..., 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # values 0..15, then 16..31
    fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return low | (fifth << 4), d, _scaled(d, -16), 8


def _q4_k(blocks: np.ndarray):
    rows, supers, _ = blocks.shape
    flat = blocks.reshape(rows * supers, -1)
    d = flat[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = flat[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(flat[:, 4:16])
    scales = d * sc.astype(np.float32)
    biases = -(dmin * m.astype(np.float32))
    qs = flat[:, 16:].reshape(-1, 4, 1, 32)  # 32 bytes hold sub-block 2j (low nibbles) and 2j + 1 (high)
    codes = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(rows, supers * 256)
    return codes, *_narrowest(scales, biases), 4


def _scaled(d: np.ndarray, factor: int) -> np.ndarray:
    """``factor * d`` in float16: exact, a power-of-two multiple (or one times a 5-bit integer) of an fp16 value."""
    product = d.astype(np.float32) * np.float32(factor)
    if not np.array_equal(product.astype(np.float16).astype(np.float32), product):
        raise ValueError("GGUF packing: a block scale times its offset does not fit float16")
    return product.astype(np.float16)


def _narrowest(scales: np.ndarray, biases: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases (one dtype for both) in float16 when every one of them is exact there, else as given."""
    both = np.concatenate([scales.ravel(), biases.ravel()])
    with np.errstate(over="ignore"):  # past float16's range: inf, not equal, so float32
        exact = np.array_equal(both.astype(np.float16).astype(np.float32), both)
    return (scales.astype(np.float16), biases.astype(np.float16)) if exact else (scales, biases)


def _pack_codes(codes: np.ndarray, bits: int) -> mx.array:
    """Codes (uint8, ``(out, in)``) packed as MLX does: value ``j`` of each uint32 in bits ``j*bits ...``."""
    per_word = 32 // bits
    rows, columns = codes.shape
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).reshape(1, 1, per_word)
    words = (codes.reshape(rows, columns // per_word, per_word).astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)
    return mx.array(words)


# The exactly repacked types: bytes a block, values a block, the block decoder.
_FORMATS = {
    GGMLQuantizationType.Q8_0: (34, 32, _q8_0),
    GGMLQuantizationType.Q5_0: (22, 32, _q5_0),
    GGMLQuantizationType.Q4_K: (144, 256, _q4_k),
}
EXACT_TYPES = frozenset(_FORMATS)
