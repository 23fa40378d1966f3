"""Reading part of a checkpoint: the tensors one rank of a split model holds, and only their bytes.

A rank of a tensor- or pipeline-parallel model (``models.parallel``) holds some tensors whole, a
slice of others along one axis (attention heads, MLP columns, vocabulary rows, expert rows, the
per-layer-input columns of its layers) and none of the rest. ``read_parts`` asks a plan what to do
with each tensor of the checkpoint, by key and stored shape (read off the headers alone), and:

- reads a whole tensor through ``mx.load`` (lazily, as ``load_safetensors`` does);
- reads a slice through a read-only ``numpy.memmap`` of its byte range: only the pages holding the
  slice are touched, and the array handed to MLX is the slice alone, so a rank's memory is its
  share of the weights, not the checkpoint (a row slice is one contiguous run of bytes);
- skips a tensor (``SKIP``): nothing is read; a file none of whose tensors is wanted is opened
  for its header only;
- stands in for a tensor (``STAND_IN``): a lazy ``mx.zeros`` of its shape and dtype that is never
  evaluated, for parts a rank builds but never runs (the vision tower off rank 0, dropped after
  the strict load).

The files go through the same checks as ``load_safetensors`` (inside the folder, sound headers,
the index honoured), and bytes are reinterpreted only as the dtype the header states.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Union

import mlx.core as mx
import numpy as np

from .safetensors_io import CheckpointError, checkpoint_files, check_index, tensor_entries

SKIP = "skip"
STAND_IN = "stand-in"

# safetensors dtype -> (numpy dtype of the stored bytes, MLX dtype); bf16 is read as its 16-bit pattern.
_DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32), "U16": (np.uint16, mx.uint16),
    "I16": (np.int16, mx.int16), "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
    "U64": (np.uint64, mx.uint64), "I64": (np.int64, mx.int64), "BOOL": (np.bool_, mx.bool_),
}  # fmt: skip


_FLOATS = ("F32", "F16", "BF16")


class ShardError(ValueError):
    """A tensor that cannot be cut the way a parallel plan asks (the message names key, shape and cut)."""


@dataclass(frozen=True)
class Part:
    """The part of a tensor a rank reads: along ``axis``, the concatenation of ``ranges``, each a
    ``(start, stop)`` pair of fractions of that axis (``(Fraction(1, 2), Fraction(1))`` is the second
    half). Fractions let one part fit a float weight and its packed twin alike (a packed
    ``.weight`` holds 32/bits values a word, ``.scales`` and ``.biases`` one a group); a cut that
    does not land on a whole index is a ``ShardError``.

    ``transposed``: a 2-D float part is handed over as the transposed view of a contiguous copy of
    its transpose, the layout the CPU keeps an output head in (``graphs.speedups.VocabularyHead``),
    whose relayout then finds it done instead of holding a second copy of the table (packed
    quantized tensors are read as stored)."""

    axis: int
    ranges: tuple[tuple[Fraction, Fraction], ...]
    transposed: bool = False

    def bounds(self, key: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """The index ranges of this part in a tensor of ``shape``."""
        if not shape or not -len(shape) <= self.axis < len(shape):
            raise ShardError(f"{key}: shape {list(shape)} has no axis {self.axis} to cut")
        length = shape[self.axis]
        bounds = []
        for start, stop in self.ranges:
            lo, hi = start * length, stop * length
            if lo.denominator != 1 or hi.denominator != 1:
                raise ShardError(
                    f"{key}: shape {list(shape)} cannot be cut at {start}..{stop} of axis {self.axis} "
                    f"({length} entries); a quantized tensor needs every cut on a whole group"
                )
            bounds.append((int(lo), int(hi)))
        return bounds

    def shape(self, key: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this part of a tensor of ``shape``."""
        cut = list(shape)
        cut[self.axis] = sum(hi - lo for lo, hi in self.bounds(key, shape))
        return tuple(cut)


Decision = Union[Part, None, str]  # a Part, None (whole), SKIP or STAND_IN


def read_parts(
    folder: str | os.PathLike, part_of: Callable[[str, tuple[int, ...]], Decision]
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors ``part_of(key, shape)`` asks for (``load_safetensors``'s result, cut), and for
    every key of the checkpoint the file it is in (skipped ones included)."""
    folder = Path(folder)
    files, expected = checkpoint_files(folder)
    weights: dict[str, mx.array] = {}
    sources: dict[str, str] = {}
    for name, path in files.items():
        data_start, entries = tensor_entries(path)
        decisions = {key: part_of(key, tuple(shape)) for key, (_, shape, _, _) in entries.items()}
        whole = mx.load(str(path)) if any(d is None for d in decisions.values()) else {}
        for key, decision in decisions.items():
            if key in sources:
                raise CheckpointError(f"Tensor {key!r} is in both {sources[key]} and {name} (in {folder}).")
            sources[key] = name
            dtype, shape, start, _ = entries[key]
            if decision is None:
                weights[key] = whole[key]
            elif decision == STAND_IN:
                weights[key] = mx.zeros(shape, dtype=_dtype(path, key, dtype)[1])
            elif isinstance(decision, Part):
                weights[key] = _read_part(path, key, dtype, tuple(shape), data_start + start, decision)
            elif decision != SKIP:
                raise TypeError(f"read_parts: the plan answered {decision!r} for {key!r}")
    check_index(folder, expected, sources)
    return weights, sources


def _dtype(path: Path, key: str, dtype: str) -> tuple[type, mx.Dtype]:
    if dtype not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {key!r} has dtype {dtype}, which cannot be read in parts")
    return _DTYPES[dtype]


def _read_part(path: Path, key: str, dtype: str, shape: tuple[int, ...], offset: int, part: Part) -> mx.array:
    """``part`` of the tensor stored at byte ``offset`` of ``path``, read through a memory map."""
    stored, mlx_dtype = _dtype(path, key, dtype)
    bounds = part.bounds(key, shape)
    mapped = np.memmap(path, dtype=stored, mode="r", offset=offset, shape=shape)
    try:
        pieces = []
        for lo, hi in bounds:
            index = [slice(None)] * len(shape)
            index[part.axis] = slice(lo, hi)
            pieces.append(mapped[tuple(index)])
        values = np.concatenate(pieces, axis=part.axis) if len(pieces) > 1 else np.ascontiguousarray(pieces[0])
    finally:
        del mapped
    transposed = part.transposed and values.ndim == 2 and dtype in _FLOATS
    if transposed:
        values = np.ascontiguousarray(values.T)
    array = mx.array(values)
    array = array.view(mlx_dtype) if array.dtype != mlx_dtype else array
    return array.T if transposed else array
