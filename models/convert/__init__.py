"""``models.convert``: write an MLX checkpoint folder, quantized or not, from any zoo model.

    python -m models.convert --model SRC --out DIR --q-bits 4 --q-group-size 64 [--dtype bfloat16]

The source is anything ``models.load`` reads (zoo name, folder, Hub id; full precision, or an MLX
conversion to re-save). It is loaded into our graph (so every key mapping and check applies),
quantized under ``weights.quantize.QuantizationPolicy`` and written as:

* ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` shards, always with
  ``model.safetensors.index.json`` (``shards``); keys in the export layout of the architecture's
  registry entry (``models.registry``, ``weights.layouts``: mlx-lm's ``model.*`` for ``gemma4_text`` /
  ``gemma3_text``, ``language_model.model.*`` with mlx-vlm's towers for ``gemma4`` / ``gemma3``,
  transformers' / mlx-vlm's ``model.decoder.*`` with fused ``experts.gate_up_proj`` for ``diffusion_gemma``);
* ``config.json``: the source's, plus the ``quantization`` entry (and its copy ``quantization_config``,
  as mlx-lm writes) with per-module overrides keyed by the written module paths, plus the few flat
  keys the entry's MLX peer reads where transformers 5 writes another form (``models.peers``);
* tokenizer files, chat template, generation config and licence/notice files, copied;
* ``README.md``: a model card saying what was quantized, how, and what stayed in full precision (``card``).

The output folder's rules (never the source, never half-written, overwrite only an earlier
conversion, disk space checked first) are ``folder``'s; the command line is ``cli``'s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import get_total_parameters

from weights import read_config
from weights.layouts import Layout
from weights.quantize import QuantizationPolicy, QuantizationReport, QuantParams, quantized_modules, read_quantization
from weights.resolve import remove_stale_staging

from models.convert.card import model_card
from models.convert.folder import MODEL_CARD, ConversionWriteError, check_apart, copy_side_files, output_state, side_files, write_folder
from models.convert.shards import DEFAULT_MAX_SHARD, parse_size, write_shards
from models.loading import load_graph, model_folder

__all__ = ["ConversionResult", "ConversionWriteError", "convert"]


@dataclass
class ConversionResult:
    """What ``convert`` wrote: the folder, the files, the sizes and the quantization decisions."""

    out: Path
    files: list[str]
    total_bytes: int
    parameters: int
    quantization: dict[str, Any] | None
    report: QuantizationReport | None
    seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.total_bytes / self.parameters


def quantization_entry(graph: nn.Module, layout: Layout, default: QuantParams) -> dict[str, Any]:
    """The ``quantization`` config entry of ``graph`` under the written module paths.

    Modules quantized with other params than ``default`` get an override (the router at 8 bits,
    embeddings under ``embed_bits``); modules left in full precision need none (no ``.scales``).
    """
    entry: dict[str, Any] = {"group_size": default.group_size, "bits": default.bits, "mode": default.mode}
    for path, params in quantized_modules(graph).items():
        written = layout.module_path(path)
        if params == default:
            continue
        if written in entry and entry[written] != params.config_entry():
            raise ValueError(f"convert: {written!r} would need two quantizations ({entry[written]} and {params.config_entry()})")
        entry[written] = params.config_entry()
    return entry


def convert(
    model: str,
    out: str | Path,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    dtype: str | None = None,
    q_policy: QuantizationPolicy | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
) -> ConversionResult:
    """Convert ``model`` into an MLX folder at ``out`` (see the module docstring); returns what was written."""
    start = time.perf_counter()
    out = Path(out).expanduser()
    target = out.resolve()
    max_shard_bytes = parse_size(max_shard_size)
    remove_stale_staging(target)  # what a killed run left beside the target (an earlier output it moved aside is put back)
    if not overwrite:
        output_state(out, target, overwrite=False)  # before loading anything
    folder = model_folder(str(model))
    check_apart(folder, out, target)
    output_state(out, target, overwrite)
    side = side_files(folder)
    raw = read_config(folder)
    stored = read_quantization(raw, str(folder / "config.json"))
    loaded = load_graph(folder, dtype, q_bits, q_group_size, q_policy)
    graph, report, architecture = loaded.graph, loaded.quantization, loaded.architecture
    layout = architecture.export_layout()

    tensors = layout.export(dict(tree_flatten(graph.parameters())))
    config, added = architecture.peer.rewrite(raw)
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    entry = None
    default = report.policy.default if report is not None else (stored.default if stored is not None else None)
    if default is not None and quantized_modules(graph):
        entry = quantization_entry(graph, layout, default)
        config["quantization"] = entry
        config["quantization_config"] = entry
    if dtype is not None:
        config["dtype"] = str(dtype)

    total = sum(v.nbytes for v in tensors.values())
    need = total + sum((folder / n).stat().st_size for n in side) + (1 << 20)

    def fill(staging: Path) -> ConversionResult:
        files = write_shards(staging, tensors, max_shard_bytes)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        files += ["config.json"] + copy_side_files(folder, staging, side)
        notes = architecture.peer.compatibility(config, added)
        result = ConversionResult(out, files, total, get_total_parameters(graph), entry, report, 0.0, notes=notes)
        (staging / MODEL_CARD).write_text(model_card(str(model), raw, graph, layout, result, stored), encoding="utf-8")
        result.files.append(MODEL_CARD)
        return result

    result = write_folder(out, target, overwrite, need, fill)
    result.seconds = time.perf_counter() - start
    return result
