"""How a cache stores one position's keys or values, and how it attends over what it stores.

Storage is a tuple of arrays ("planes") whose position axis is -2: one plane for full precision,
three (packed, scales, biases) for MLX's affine quantization. ``pack`` turns keys or values into
planes and ``unpack`` turns planes back (named so as not to collide with the ``decode`` read). The
caches' layout code (growth, compaction, trims) works on planes and never needs to know which codec
it holds.
"""

from __future__ import annotations

import mlx.core as mx

from .attention import (
    FIRST_ROW, attend, attend_quantized_query_run, attend_query_rows, attend_query_run, fold_queries, masked_softmax,
    prefill_reads_dequantized, unfold_queries,
)  # fmt: skip

Planes = tuple  # tuple[mx.array, ...], position axis -2


def run_of(planes: Planes, start: mx.array, size: int) -> Planes:
    """Rows ``[start, start + size)`` of each plane, ``start`` a scalar int32 array (a compiled
    decode step's read: one trace serves every row)."""
    return tuple(mx.slice(p, start.reshape(1), axes=(2,), slice_size=(*p.shape[:2], size, *p.shape[3:])) for p in planes)


class Codec:
    """What both codecs share: attending a run of stored rows. ``layout`` is what rows must share
    to be attended in one call (``attend_rows``): the codec and its settings."""

    layout: tuple = ()

    def attend_run(self, q: mx.array, keys: Planes, values: Planes, start: mx.array, size: int, scale: float,
                   mask) -> mx.array:
        """``attend`` over rows ``[start, start + size)`` of the stored planes."""
        return self.attend(q, run_of(keys, start, size), run_of(values, start, size), scale, mask)

    def attend_rows(self, q: mx.array, runs: list, scale: float) -> mx.array | None:
        """Row ``r`` of ``q`` (one query each) over ``runs[r]`` = (key planes, value planes, first
        row, rows) of its own cache, unmasked, in one call; None where the kernel does not take it."""
        keys, values, starts, sizes = zip(*runs)
        return attend_query_rows(q, list(keys), list(values), list(starts), list(sizes), scale, *self.layout[1:])


class Dense(Codec):
    """Keys and values as they come, attended by ``attention.attend`` (MLX's fused kernel off the CPU)."""

    quantized = False
    layout = ("dense",)

    def check(self, read: str, k: mx.array, v: mx.array) -> None:
        pass

    def check_planes(self, where: str, name: str, planes) -> tuple[Planes, tuple]:
        """Stored planes from outside (a state): raise ``ValueError`` unless they are one floating
        ``[B, H, rows, D]`` array; return them and ``(B, H, rows, D, dtype)``."""
        (x,) = _plane_arrays(where, name, planes, ("array",))
        if not mx.issubdtype(x.dtype, mx.floating):
            raise ValueError(f"{where}: {name} must have a floating dtype, got {x.dtype}")
        B, H, n, D = x.shape
        return (x,), (B, H, n, D, x.dtype)

    def pack(self, x: mx.array) -> Planes:
        """Keys or values ``[B, H, L, D]`` as stored planes."""
        return (x,)

    def zeros(self, like: mx.array, rows: int) -> Planes:
        B, H, _, D = like.shape
        return (mx.zeros((B, H, rows, D), dtype=like.dtype),)

    def unpack(self, planes: Planes) -> mx.array:
        """Stored planes back to keys or values ``[B, H, L, D]``."""
        return planes[0]

    def attend(self, q: mx.array, keys: Planes, values: Planes, scale: float, mask) -> mx.array:
        return attend(q, keys[0], values[0], scale, mask)

    def attend_run(self, q: mx.array, keys: Planes, values: Planes, start: mx.array, size: int, scale: float,
                   mask) -> mx.array:
        """One float32 query per row on the CPU: the decode kernel reads the run in place (no slice
        of the planes); anything else slices the run and attends it."""
        out = attend_query_run(q, keys[0], values[0], start, size, scale, mask)
        return out if out is not None else super().attend_run(q, keys, values, start, size, scale, mask)


class Quantized(Codec):
    """MLX affine quantization along the head dim (``mx.quantize``). A single float32 query goes
    through the zoo's quantized decode kernel where it runs (``zoo_cpu.decode.attention_quantized``:
    a block of rows dequantized at a time, never the history). A prefill chunk's many queries on
    the CPU plan read the run dequantized, through the float prefill kernel
    (``prefill_reads_dequantized``). Anything else goes through two ``mx.quantized_matmul``
    products around an fp32 softmax.

    Written here rather than taken from mlx-lm's ``quantized_scaled_dot_product_attention`` because
    that one reshapes its output with the key head dim (wrong when values have another width) and
    rebuilds the causal mask itself; ours takes the cache's mask as is.
    """

    quantized = True
    BITS = (2, 3, 4, 5, 6, 8)
    GROUP_SIZES = (32, 64, 128)

    def __init__(self, bits: int, group_size: int):
        if bits not in self.BITS:
            raise ValueError(f"kv_bits must be one of {self.BITS}, got {bits}")
        if group_size not in self.GROUP_SIZES:
            raise ValueError(f"kv_group_size must be one of {self.GROUP_SIZES}, got {group_size}")
        self.bits, self.group_size = int(bits), int(group_size)
        self.layout = ("quantized", self.bits, self.group_size)

    def check(self, read: str, k: mx.array, v: mx.array) -> None:
        for name, x in (("k", k), ("v", v)):
            if x.shape[-1] % self.group_size:
                raise ValueError(
                    f"{read}: {name} head dim {x.shape[-1]} is not a multiple of kv_group_size {self.group_size}"
                )

    def check_planes(self, where: str, name: str, planes) -> tuple[Planes, tuple]:
        """Stored planes from outside (a state): raise ``ValueError`` unless they are (packed uint32,
        scales, biases) of one ``[B, H, rows]`` and a head dim D that fits ``bits`` and
        ``group_size``; return them and ``(B, H, rows, D, dtype)``."""
        packed, scales, biases = _plane_arrays(where, name, planes, ("packed", "scales", "biases"))
        if packed.dtype != mx.uint32:
            raise ValueError(f"{where}: {name} packed plane must be uint32, got {packed.dtype}")
        if not mx.issubdtype(scales.dtype, mx.floating) or biases.dtype != scales.dtype:
            raise ValueError(f"{where}: {name} scales and biases must share a floating dtype, got {scales.dtype}, {biases.dtype}")
        D, rest = divmod(packed.shape[3] * 32, self.bits)
        if rest or D % self.group_size or scales.shape[3] != D // self.group_size or biases.shape[3] != scales.shape[3]:
            raise ValueError(
                f"{where}: {name} planes {[tuple(p.shape) for p in (packed, scales, biases)]} do not fit "
                f"{self.bits} bits and group size {self.group_size}"
            )
        B, H, n, _ = packed.shape
        return (packed, scales, biases), (B, H, n, D, scales.dtype)

    def pack(self, x: mx.array) -> Planes:
        """Quantize ``[B, H, L, D]`` along D: (packed uint32, scales, biases)."""
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.bits))

    def zeros(self, like: mx.array, rows: int) -> Planes:
        B, H, _, D = like.shape
        return (
            mx.zeros((B, H, rows, D * self.bits // 32), dtype=mx.uint32),
            mx.zeros((B, H, rows, D // self.group_size), dtype=like.dtype),
            mx.zeros((B, H, rows, D // self.group_size), dtype=like.dtype),
        )

    def unpack(self, planes: Planes) -> mx.array:
        """Dequantize (packed, scales, biases) back to ``[B, H, L, D]``."""
        return mx.dequantize(*planes, group_size=self.group_size, bits=self.bits)

    def attend_run(self, q: mx.array, keys: Planes, values: Planes, start: mx.array, size: int, scale: float,
                   mask) -> mx.array:
        """One float32 query per row on the CPU: the quantized decode kernel reads the run's codes in
        place; anything else slices the run and attends it."""
        out = attend_quantized_query_run(q, keys, values, start, size, scale, mask, self.bits, self.group_size)
        return out if out is not None else super().attend_run(q, keys, values, start, size, scale, mask)

    def attend(self, q: mx.array, keys: Planes, values: Planes, scale: float, mask) -> mx.array:
        if q.shape[2] == 1:
            out = attend_quantized_query_run(q, keys, values, FIRST_ROW, keys[0].shape[2], scale, mask, self.bits,
                                             self.group_size)  # fmt: skip
            if out is not None:
                return out
        elif prefill_reads_dequantized(q, keys):
            return attend(q, self.unpack(keys), self.unpack(values), scale, mask)
        # GQA by folding each kv head's query heads into rows: the stored planes are used as they
        # are, never broadcast (a broadcast would copy the whole history once per query head).
        quantized = dict(group_size=self.group_size, bits=self.bits)
        rows = fold_queries(q, scale, keys[0].shape[1])
        scores = mx.quantized_matmul(rows, *keys, transpose=True, **quantized)
        probs = masked_softmax(scores, mask, q.shape[2]).astype(q.dtype)
        return unfold_queries(mx.quantized_matmul(probs, *values, transpose=False, **quantized), q.shape[1])


def _plane_arrays(where: str, name: str, planes, names: tuple) -> tuple:
    """``planes`` as a tuple of rank-4 ``mx.array``s, one per name, sharing ``[B, H, rows]``."""
    if not isinstance(planes, (tuple, list)) or len(planes) != len(names):
        got = f"{len(planes)} planes" if isinstance(planes, (tuple, list)) else type(planes).__name__
        raise ValueError(f"{where}: {name} must be a tuple of {len(names)} planes {names}, got {got}")
    for plane, x in zip(names, planes):
        if not isinstance(x, mx.array) or x.ndim != 4:
            got = f"shape {tuple(x.shape)}" if isinstance(x, mx.array) else type(x).__name__
            raise ValueError(f"{where}: {name} {plane} plane must be a rank-4 mx.array [B, H, rows, ...], got {got}")
    if len({tuple(x.shape[:3]) for x in planes}) != 1:
        raise ValueError(f"{where}: {name} planes disagree on [B, H, rows]: {[tuple(x.shape) for x in planes]}")
    return tuple(planes)
