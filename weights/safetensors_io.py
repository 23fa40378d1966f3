"""Read a checkpoint's safetensors files (single or sharded) into MLX arrays.

``mx.load`` reads safetensors lazily and its errors on a damaged file do not say which file it was
(``[read] Unable to read 3 bytes from file``), so every file's header is checked here first: a
truncated download or a corrupt header becomes an error naming the file. Sharded checkpoints are
checked against their index, so a missing shard or a key the index promises but no shard holds is
reported by name instead of surfacing later as a missing weight.

Every file is read from inside the checkpoint folder (``weights.resolve.folder_file``): an index
entry that is absolute, has ``..`` or names a symlink out of the folder is refused by name, and an
entry must name a ``.safetensors`` file. Errors about a file that is not a safetensors file never
quote its bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import mlx.core as mx

from .json_depth import nesting_depth
from .resolve import folder_file, regular_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors' own limit; a larger length means the first 8 bytes are not a header length at all.
_MAX_HEADER_BYTES = 100 * 1024 * 1024
# {name: {"shape": [...]}}: no valid header nests deeper (Python's json would recurse without bound).
_MAX_HEADER_DEPTH = 3

_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip

_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class CheckpointError(ValueError):
    """A checkpoint file exists but its content is damaged or disagrees with its index."""


def load_safetensors(
    folder: str | os.PathLike, dtype: str | mx.Dtype | None = None
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """All tensors of the checkpoint in ``folder``, and for each key the file name it came from.

    Reads ``model.safetensors`` or, failing that, the shards listed in ``model.safetensors.index.json``.
    The checkpoint's dtypes are kept (bf16 stays bf16) unless ``dtype`` ("float32", "bfloat16",
    "float16" or an ``mx`` dtype) is given, which floating tensors are cast to; integer tensors
    (quantized weights) are never cast.
    """
    target = parse_dtype(dtype)
    folder = Path(folder)
    files, expected = checkpoint_files(folder)
    weights: dict[str, mx.array] = {}
    sources: dict[str, str] = {}
    for name, path in files.items():
        check_safetensors_file(path)
        for key, array in mx.load(str(path)).items():
            if key in sources:
                raise CheckpointError(f"Tensor {key!r} is in both {sources[key]} and {name} (in {folder}).")
            if target is not None and mx.issubdtype(array.dtype, mx.floating):
                array = array.astype(target)
            weights[key] = array
            sources[key] = name

    check_index(folder, expected, sources)
    return weights, sources


def check_index(folder: Path, expected: dict[str, str], sources: dict[str, str]) -> None:
    """Every tensor the index lists (``expected``: key -> file) must be in that file (``sources``)."""
    for key, name in expected.items():
        if sources.get(key) != name:
            found = f" (it is in {sources[key]})" if key in sources else ""
            raise CheckpointError(
                f"{folder / INDEX_FILE} lists tensor {key!r} in {name}, but {name} does not hold it{found}."
            )


def checkpoint_files(folder: Path) -> tuple[dict[str, Path], dict[str, str]]:
    """The checkpoint's safetensors files ``{file name: path}`` (each inside ``folder`` and present)
    and, for a sharded checkpoint, its index ``{tensor key: file name}`` ({} for a single file)."""
    index = folder / INDEX_FILE
    if (folder / SINGLE_FILE).exists():  # a directory or FIFO of that name is refused by name (regular_file)
        return {SINGLE_FILE: folder_file(folder, SINGLE_FILE)}, {}
    if not index.exists():
        present = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
        raise FileNotFoundError(
            f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}"
            + (f" (safetensors files found: {', '.join(present)})." if present else ".")
        )
    expected = _read_index(folder_file(folder, INDEX_FILE))
    files = {name: folder_file(folder, name, f"{index}: weight_map entry {name!r}") for name in sorted(set(expected.values()))}
    for name, path in files.items():
        if not path.is_file():
            raise FileNotFoundError(f"Shard {name} listed in {index} does not exist.")
    return files, expected


def checkpoint_shapes(folder: str | os.PathLike) -> dict[str, list[int]]:
    """Every tensor's shape as the checkpoint's headers give it (no data is read)."""
    files, _ = checkpoint_files(Path(folder))
    return {key: entry[1] for path in files.values() for key, entry in tensor_entries(path)[1].items()}


def check_safetensors_file(path: str | os.PathLike) -> list[str]:
    """Check a safetensors file's header and length; return its tensor names (``tensor_entries``)."""
    return list(tensor_entries(path)[1])


def tensor_entries(path: str | os.PathLike) -> tuple[int, dict[str, tuple[str, list[int], int, int]]]:
    """Check a safetensors file's header and length; return where its data starts and, for each
    tensor, ``(dtype, shape, start, end)`` (byte offsets into the data).

    Catches what a partial download or a damaged file looks like: a header length that does not fit,
    a header that is not JSON, a tensor whose byte range does not match its shape and dtype, and
    data that ends before the header says it does. Until the header has parsed as a safetensors
    header, errors give only sizes and positions, never the file's bytes (it may be any file).
    """
    path = regular_file(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise CheckpointError(f"{path} is {size} bytes, too short to be a safetensors file.")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > _MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{path} is not a safetensors file (its first 8 bytes are not a header length; the file has {size} bytes)."
            )
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path} is truncated or not a safetensors file: its header claims {header_len} bytes "
                f"but the file has {size}."
            )
        raw = f.read(header_len)
    depth = nesting_depth(raw, _MAX_HEADER_DEPTH)
    if depth > _MAX_HEADER_DEPTH:
        raise CheckpointError(
            f"{path} has a corrupt header or is not a safetensors file (its JSON nests {depth} levels deep; "
            f"a safetensors header has {_MAX_HEADER_DEPTH})."
        )
    try:
        header = json.loads(raw)
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} has a corrupt header or is not a safetensors file (not UTF-8 text at byte {8 + e.start})."
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{path} has a corrupt header or is not a safetensors file (not valid JSON: {e.msg} at byte {8 + e.pos})."
        ) from None
    except ValueError as e:  # an integer past Python's 4300 digits
        raise CheckpointError(f"{path} has a corrupt header ({e}).") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt header (a JSON {type(header).__name__}, not an object).")

    data_bytes = size - 8 - header_len
    entries: dict[str, tuple[str, list[int], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        label = name if len(name) <= 200 else name[:200] + "..."
        try:
            start, end = info["data_offsets"]
            shape, dtype = info["shape"], info["dtype"]
            if not isinstance(dtype, str) or not isinstance(shape, list) or not all(_count(d) for d in (*shape, start, end)):
                raise TypeError
            nbytes = math.prod(shape) * _ITEM_BYTES[dtype] if dtype in _ITEM_BYTES else end - start
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(
                f"{path} has a corrupt header entry for tensor {label!r} (it needs a 'dtype', a 'shape' of "
                "ints >= 0 and two 'data_offsets' that are ints >= 0)."
            ) from None
        stored = dtype
        if dtype not in _ITEM_BYTES:
            dtype = "unknown dtype"
        if end - start != nbytes:
            raise CheckpointError(
                f"{path}: tensor {label!r} ({dtype}, shape {shape}) should take {nbytes} bytes "
                f"but its offsets span {end - start}."
            )
        if end > data_bytes:
            raise CheckpointError(
                f"{path} is truncated: tensor {label!r} ends at data byte {end} but the file holds only "
                f"{data_bytes} bytes of data (incomplete download?)."
            )
        entries[name] = (stored, list(shape), start, end)
    check_layout(path, entries)
    return 8 + header_len, entries


def _count(value) -> bool:
    """An int >= 0 (JSON's ``1.0`` and ``true`` are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_layout(path: Path, entries: dict[str, tuple[str, list[int], int, int]]) -> None:
    """Tensors' byte ranges must not overlap: two tensors sharing bytes would load as views of each
    other's data (safetensors itself requires them in ascending order without gaps or overlaps)."""
    previous, previous_end = None, 0
    for name, (_, _, start, end) in sorted(entries.items(), key=lambda item: (item[1][2], item[1][3])):
        if start < previous_end:
            raise CheckpointError(
                f"{path} has a corrupt header: tensor {name[:200]!r} (data bytes {start}-{end}) overlaps tensor "
                f"{previous[:200]!r}, which ends at {previous_end}."
            )
        previous, previous_end = name, end


def parse_dtype(dtype: str | mx.Dtype | None) -> mx.Dtype | None:
    """``None``, an ``mx`` dtype, or one of the names "float32", "bfloat16", "float16"."""
    if dtype is None or isinstance(dtype, mx.Dtype):
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"Unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)} or an mlx.core dtype.")


def _read_index(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> shard file name)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index} is not valid JSON: {e}") from None
    except (KeyError, TypeError):
        raise CheckpointError(f"{index} has no 'weight_map' object.") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard file names.")
    for key, name in weight_map.items():
        if not name.endswith(".safetensors"):
            raise CheckpointError(f"{index}: weight_map entry {name!r} (tensor {key!r}) is not a .safetensors file.")
    return weight_map
