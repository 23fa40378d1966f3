"""The weight files of a converted folder: safetensors shards of at most a given size, and their index."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Mapping

import mlx.core as mx

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "5GB"
SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"convert: cannot read the shard size {text!r} (e.g. 5GB, 500MB, 100KB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper() if m.group(2) else None])


def write_shards(out: Path, tensors: Mapping[str, mx.array], max_shard_bytes: int) -> list[str]:
    """Shards of at most ``max_shard_bytes`` (a larger tensor gets one of its own) and the index."""
    shards: list[dict[str, mx.array]] = []
    size = 0
    for key in sorted(tensors):
        value = tensors[key]
        if not shards or (size + value.nbytes > max_shard_bytes and shards[-1]):
            shards.append({})
            size = 0
        shards[-1][key] = value
        size += value.nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, shard in zip(names, shards):
        try:
            mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        except RuntimeError as e:  # MLX reports failed writes (a full disk) as RuntimeError
            raise OSError(f"MLX could not write {name} ({e})") from e
        weight_map.update({key: name for key in shard})
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return names + [INDEX_FILE]
