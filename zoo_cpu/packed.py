"""Packed 4- and 8-bit weights on MLX's CPU device, at memory bandwidth (the extension's products).

MLX's CPU ``quantized_matmul`` is a scalar loop (112 ms for the 270M's 4-bit head), so without
these the zoo dequantizes quantized checkpoints to float32 on the CPU: quantization would buy disk
space, not speed. The extension (``zoo_cpu.extension``) adds two MLX primitives over MLX's own
affine layout:

- ``packed_matmul(x, w, scales, biases, group_size, bits)``: ``x @ dequantize(w).T`` for a few rows
  of ``x``, reading the packed bytes once (AVX-512 or AVX2 + FMA, chosen at run time, else plain
  C++), rows split over threads. The weights are converted to float in registers and multiplied
  with the float32 activations, so the result is the dequantized float32 product up to summation
  order (``tests/test_packed_kernels.py`` bounds the difference);
- ``packed_dequantize(w, scales, biases, group_size, bits)``: the float32 weight, for products with
  many rows (prefill), which then go through the prefill GEMM or the BLAS.

``PackedLinear`` and ``PackedEmbedding`` are ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``
with the same parameters whose products take these paths (``product``); ``models.precision`` puts
them in place of the quantized layers where the extension runs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import backend, extension, prefill

# Products of more rows than this dequantize their weight and go through the prefill GEMM (or the
# BLAS): on the 270M's layer shapes the kernel is 1.3-5x faster up to 16 rows, even at 24-32 for
# 4-bit and up to 1.4x slower at 32 for 8-bit (docs/speed.md).
KERNEL_ROWS = 16
# The dequantized weight of a many-row product is made in row blocks of at most this many bytes
# (a 262,144-word head would otherwise take a 671 MB temporary).
DENSE_BLOCK_BYTES = 64 << 20
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def packed_matmul(x, w, scales, biases, group_size: int, bits: int, isa: str | None = None) -> mx.array:
    """``x @ dequantize(w, scales, biases).T`` in float32 through the packed kernel."""
    return extension.module().packed_matmul(x, w, scales, biases, group_size, bits, isa or "")


def packed_dequantize(w, scales, biases, group_size: int, bits: int, isa: str | None = None) -> mx.array:
    """The float32 ``[N, K]`` weight of a packed ``[N, K * bits / 32]`` one."""
    return extension.module().packed_dequantize(w, scales, biases, group_size, bits, isa or "")


def product(x: mx.array, w, scales, biases, group_size: int, bits: int) -> mx.array:
    """``x @ dequantize(w).T``: the packed kernel for up to ``KERNEL_ROWS`` rows, else dequantized
    row blocks through the prefill GEMM (float32, while the backend runs the prefill kernels) or the BLAS; in ``x``'s dtype."""
    rows = x.size // x.shape[-1] if x.shape[-1] else 0
    if rows <= KERNEL_ROWS:
        y = packed_matmul(x, w, scales, biases, group_size, bits)
        return y if y.dtype == x.dtype else y.astype(x.dtype)
    N, K = w.shape[0], x.shape[-1]
    step = max(1, DENSE_BLOCK_BYTES // (4 * K))
    gemm = x.dtype == mx.float32 and backend.active().prefill
    parts = []
    for a in range(0, N, step):
        dense = packed_dequantize(w[a : a + step], scales[a : a + step], biases[a : a + step], group_size, bits)
        if gemm:
            parts.append(prefill.linear(x, dense))
        else:
            parts.append(x @ (dense if x.dtype == mx.float32 else dense.astype(x.dtype)).T)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def unpackable(module: nn.Module) -> str | None:
    """Why ``module`` (an ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``) cannot take the kernels, or None."""
    mode = getattr(module, "mode", "affine")
    if mode != "affine":
        return f"mode {mode}"
    if module.bits not in BITS:
        return f"{module.bits}-bit"
    if module.group_size not in GROUP_SIZES:
        return f"group size {module.group_size}"
    return None


SCALE_DTYPES = (mx.float32, mx.bfloat16, mx.float16)  # read by the kernels as stored


def _copy_quantized(new: nn.Module, module: nn.Module, extra: tuple[str, ...]) -> nn.Module:
    """``new`` (made without running its ``__init__``, which would quantize a random matrix) given
    ``module``'s settings and parameters; scales and biases as stored when the kernels read that
    dtype (both the same), else in float32."""
    nn.Module.__init__(new)
    for name in ("group_size", "bits", "mode", *extra):
        setattr(new, name, getattr(module, name))
    new.weight = module.weight
    same = module.scales.dtype == module.biases.dtype and module.scales.dtype in SCALE_DTYPES
    new.scales = module.scales if same else module.scales.astype(mx.float32)
    new.biases = module.biases if same else module.biases.astype(mx.float32)
    if "bias" in module:
        new.bias = module.bias
    new.freeze()
    return new


class PackedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` (same parameters, same saved form) whose product takes ``product``."""

    @classmethod
    def of(cls, module: nn.QuantizedLinear) -> "PackedLinear":
        return _copy_quantized(cls.__new__(cls), module, ())

    def __call__(self, x: mx.array) -> mx.array:
        y = product(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


class PackedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied output head) takes ``product``;
    lookups dequantize the gathered rows with their scales in float32 (half-precision scales would
    otherwise round the rows to that precision)."""

    @classmethod
    def of(cls, module: nn.QuantizedEmbedding) -> "PackedEmbedding":
        return _copy_quantized(cls.__new__(cls), module, ("num_embeddings", "dims"))

    def __call__(self, ids: mx.array) -> mx.array:
        scales, biases = self["scales"][ids], self["biases"][ids]
        return mx.dequantize(
            self["weight"][ids], scales.astype(mx.float32), biases.astype(mx.float32),
            group_size=self.group_size, bits=self.bits, mode=self.mode,
        )  # fmt: skip

    def as_linear(self, x: mx.array) -> mx.array:
        return product(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
