"""``python -m models.convert``: write an MLX checkpoint folder, quantized or not, from any zoo model.

    python -m models.convert --model SRC --out DIR --q-bits 4 --q-group-size 64 [--dtype bfloat16]

The source is anything ``models.load`` reads (zoo name, folder, Hub id; full precision, or an MLX
conversion to re-save). It is loaded into our graph (so every key mapping and check applies),
quantized under ``weights.quantize.QuantizationPolicy`` and written as:

* ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` shards, always with
  ``model.safetensors.index.json``; keys in the layout the MLX peers use for the architecture
  (mlx-lm ``gemma4_text`` / ``gemma3_text``: ``model.*``; ``gemma4`` / ``gemma3``:
  ``language_model.model.*`` with mlx-vlm's ``vision_tower.*`` / ``embed_vision.*``;
  ``diffusion_gemma``: transformers' / mlx-vlm's ``model.decoder.*`` with fused ``experts.gate_up_proj``);
* ``config.json``: the source's, plus the ``quantization`` entry (and its copy ``quantization_config``,
  as mlx-lm writes) with per-module overrides keyed by the written module paths, plus the few flat
  keys mlx-lm's Gemma classes read where transformers 5 writes another form (checked to parse to
  the same config in our loader);
* tokenizer files, chat template, generation config and licence/notice files, copied;
* ``README.md``: a model card saying what was quantized, how, and what stayed in full precision.

The output never touches the source and never half-exists: an output folder that is, contains or
lies inside the source folder (symlinks resolved) is refused; the folder is written under
``.<name>.partial-<pid>`` beside the target and renamed into place only when complete, so an
interrupted or failed run (disk full: ``ConversionWriteError``, an ``OSError`` naming the folder)
leaves the target as it was. ``overwrite`` replaces only an empty folder or one an earlier
conversion wrote (our model card, and only files a conversion writes), after the new one is
complete. Side files are copied only from inside the source folder (``weights.resolve.folder_file``).
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import get_total_parameters

from weights import read_config
from weights.quantize import (
    LOAD_BITS,
    LOAD_GROUP_SIZES,
    CheckpointQuantization,
    QuantizationPolicy,
    QuantizationReport,
    QuantParams,
    quantized_modules,
    read_quantization,
)
from weights.resolve import folder_file, remove_stale_staging, staging_name

from models.loading import load_graph, model_folder
from models.sentence_modules import head_files

INDEX_FILE = "model.safetensors.index.json"
MODEL_CARD = "README.md"
# The model card's provenance line; an existing folder whose card has it is a previous conversion.
CARD_MARKER = "Converted with `python -m models.convert` (gemma-mlx-zoo)"
DEFAULT_MAX_SHARD = "5GB"
# Copied as they are when the source has them.
COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
COPIED_PATTERNS = ("LICENSE*", "NOTICE*", "GEMMA_TERMS*", "*.upstream.md")
_SHARD_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}


class ConversionWriteError(OSError):
    """The output folder could not be written (disk full, no permission); nothing was changed."""


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


# ---------------------------------------------------------------------------------------- key layouts
class Layout:
    """Our graph's parameter names -> the written checkpoint's keys (and module paths)."""

    def __init__(self, key: Callable[[str], str]):
        self._key = key

    def key(self, name: str) -> str:
        return self._key(name)

    def module_path(self, path: str) -> str:
        return self.key(path + ".weight").removesuffix(".weight")

    def export(self, params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        return {self.key(name): value for name, value in params.items()}


def _prefixed(text_prefix: str, head_prefix: str, graph_prefix: str = "") -> Callable[[str], str]:
    """``graph_prefix + X`` -> ``text_prefix + X`` (``lm_head.*`` -> ``head_prefix + *``); other names unchanged."""

    def key(name: str) -> str:
        if not name.startswith(graph_prefix):
            return name
        inner = name[len(graph_prefix) :]
        if inner.startswith("lm_head."):
            return head_prefix + inner[len("lm_head.") :]
        return text_prefix + inner

    return key


_EXPERT = re.compile(r"(layers\.\d+\.experts)\.switch_glu\.(gate|up|down)_proj\.(weight|scales|biases)")
_ENCODER_SCALAR = re.compile(r"layers\.(\d+)\.encoder_layer_scalar")


class DiffusionLayout(Layout):
    """transformers' / mlx-vlm's ``diffusion_gemma`` keys: the decoder stack, the encoder's scalars, the
    encoder's vision parts, and the experts fused back into ``gate_up_proj`` ([gate; up] along the
    rows, which packed weights, scales and biases all split the same way)."""

    def __init__(self):
        super().__init__(self._diffusion_key)

    @staticmethod
    def _diffusion_key(name: str) -> str:
        if (m := _ENCODER_SCALAR.fullmatch(name)) is not None:
            return f"model.encoder.language_model.layers.{m.group(1)}.layer_scalar"
        if name.startswith(("vision_tower.", "embed_vision.")):
            return "model.encoder." + name
        if (m := _EXPERT.fullmatch(name)) is not None:
            fused = "gate_up" if m.group(2) in ("gate", "up") else "down"
            return f"model.decoder.{m.group(1)}.{fused}_proj.{m.group(3)}"
        return "model.decoder." + name

    def export(self, params: Mapping[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name, value in params.items():
            m = _EXPERT.fullmatch(name)
            if m is None or m.group(2) == "down":
                out[self.key(name)] = value
            elif m.group(2) == "gate":
                up = params[name.replace(".switch_glu.gate_proj.", ".switch_glu.up_proj.")]
                out[self.key(name)] = mx.concatenate([value, up], axis=1)
        return out


def layout_for(model_type: str, graph: nn.Module) -> Layout:
    from graphs.diffusion_gemma import DiffusionGemmaModel
    from graphs.gemma4_multimodal import Gemma4MultimodalModel

    if isinstance(graph, DiffusionGemmaModel):
        return DiffusionLayout()
    if isinstance(graph, Gemma4MultimodalModel):
        return Layout(_prefixed("language_model.model.", "language_model.lm_head.", "language_model."))
    if model_type in ("gemma4", "gemma3"):  # the text part of a multimodal config: mlx-lm's gemma4 / gemma3 layout
        return Layout(_prefixed("language_model.model.", "language_model.lm_head."))
    return Layout(_prefixed("model.", "lm_head."))


# ---------------------------------------------------------------------------------------- config
def mlx_lm_config(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``raw`` plus the flat keys mlx-lm's Gemma classes read where transformers 5 writes another form.

    mlx-lm's ``gemma4_text`` reads ``global_head_dim`` / ``num_global_key_value_heads`` (transformers
    writes ``per_layer_config``); its ``gemma3_text`` reads ``sliding_window_pattern``, ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` (transformers writes ``layer_types`` and
    ``rope_parameters``). mlx-vlm's ``gemma4_unified`` reads its text config with the same Gemma 4
    class. Keys are added only when absent, and only when our parser reads the result as the same
    config. Returns the config and the added keys.
    """
    config = json.loads(json.dumps(raw))
    model_type = config.get("model_type")
    text = config.get("text_config") if model_type in ("gemma4", "gemma3", "gemma4_unified") else config
    if not isinstance(text, dict):
        return config, []
    if model_type in ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text"):
        from graphs.gemma4_text_config import FULL, Gemma4TextConfig
        from graphs.gemma4_unified_config import unified_text_config

        # mlx-vlm's gemma4_unified reads its text config through the same Gemma 4 class.
        parse = unified_text_config if model_type.startswith("gemma4_unified") else Gemma4TextConfig.from_dict
        before = parse(config)
        full = [i for i, t in enumerate(before.layer_types) if t == FULL]
        extra = {}
        if full and len({before.layer_head_dims[i] for i in full}) == 1:
            extra["global_head_dim"] = before.layer_head_dims[full[0]]
        if full and before.attention_k_eq_v and len({before.layer_kv_heads[i] for i in full}) == 1:
            extra["num_global_key_value_heads"] = before.layer_kv_heads[full[0]]
    elif model_type in ("gemma3", "gemma3_text"):
        from graphs.gemma3_text_config import FULL, SLIDING, Gemma3TextConfig

        parse = Gemma3TextConfig.from_dict
        before = parse(config)
        extra = {
            "rope_theta": before.rope_parameters[FULL]["rope_theta"],
            "rope_local_base_freq": before.rope_parameters[SLIDING]["rope_theta"],
        }
        if before.rope_parameters[FULL]["rope_type"] == "linear":
            extra["rope_scaling"] = {"rope_type": "linear", "factor": before.rope_parameters[FULL]["factor"]}
        pattern = _mlx_lm_pattern(before.layer_types, FULL)
        if pattern is not None:
            extra["sliding_window_pattern"] = pattern
    else:
        return config, []
    added = [k for k in extra if text.get(k) is None]
    for k in added:
        text[k] = extra[k]
    if added and parse(config) != before:
        for k in added:
            del text[k]
        added = []
    if text is not config and config.get("vocab_size") is None:
        # mlx-lm's gemma4 / gemma3 ModelArgs overwrite text_config.vocab_size with the top-level one (default 262144 / 262208).
        config["vocab_size"] = before.vocab_size
        added.append("vocab_size")
    return config, added


def _mlx_lm_pattern(layer_types, full: str) -> int | None:
    """The period p with layer i full iff ``i % p == p - 1`` (how mlx-lm's gemma3 places full layers), if any."""
    for p in range(1, len(layer_types) + 1):
        if all((t == full) == (i % p == p - 1) for i, t in enumerate(layer_types)):
            return p
    return None


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


# ---------------------------------------------------------------------------------------- writing
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


def side_files(source: Path) -> list[str]:
    """The tokenizer, template, config and licence files of ``source`` to copy, each checked to lie
    inside it (a symlink out of the folder is refused by name, never copied)."""
    names = [n for n in COPIED_FILES if (source / n).is_file()]
    for pattern in COPIED_PATTERNS:
        names += sorted(p.name for p in source.glob(pattern) if p.is_file() and p.name not in names)
    names += head_files(source)  # an embedding model's sentence-transformers head, kept as it is
    for name in names:
        folder_file(source, name, f"convert: side file {source / name}")
    return names


def copy_side_files(source: Path, out: Path, names: list[str] | None = None) -> list[str]:
    names = side_files(source) if names is None else names
    for name in names:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder_file(source, name, f"convert: side file {source / name}"), out / name)
    return list(names)


# ---------------------------------------------------------------------------------------- convert
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
    graph, report = loaded.graph, loaded.quantization
    layout = layout_for(raw.get("model_type"), graph)

    params = dict(tree_flatten(graph.parameters()))
    tensors = layout.export(params)
    config, added = mlx_lm_config(raw)
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
    created = [p for p in (target.parent, *target.parent.parents) if not p.exists()]
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_name(target)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _check_space(out, target, need, output_state(out, target, True, quiet=True))
        staging.mkdir()
        files = write_shards(staging, tensors, max_shard_bytes)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        files += ["config.json"] + copy_side_files(folder, staging, side)
        result = ConversionResult(
            out, files, total, get_total_parameters(graph), entry, report, 0.0, notes=_notes(config, added),
        )  # fmt: skip
        (staging / MODEL_CARD).write_text(model_card(str(model), raw, graph, layout, result, stored), encoding="utf-8")
        result.files.append(MODEL_CARD)
    except ConversionWriteError:
        _remove_empty(created)
        raise
    except OSError as e:
        error = _write_error(e, out, target, need, output_state(out, target, True, quiet=True))
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise error from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise
    try:
        _move_into_place(staging, out, target, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise
    result.seconds = time.perf_counter() - start
    return result


# ---------------------------------------------------------------------------------------- output folder
def check_apart(source: Path, out: Path, target: Path) -> None:
    """Refuse an output folder that is, contains or lies inside the source folder (symlinks resolved),
    or that holds a file the source links to (a Hub snapshot's blobs): replacing it would lose the source."""
    src = source.resolve()
    why = None
    if target == src:
        why = "is the source folder"
    elif target in src.parents:
        why = f"contains the source folder {source}"
    elif src in target.parents:
        why = f"lies inside the source folder {source}"
    else:
        for entry in sorted(source.iterdir()):
            real = entry.resolve()
            if real == target or target in real.parents:
                why = f"holds {real}, the source's {entry.name}"
                break
    if why is not None:
        raise ValueError(f"convert: the output folder {out} {why}; choose an output outside the source")


def output_state(out: Path, target: Path, overwrite: bool, quiet: bool = False) -> str:
    """What ``target`` is now: "new" (absent), "empty", or "previous" (an earlier conversion's output).

    A non-empty folder is refused (``FileExistsError`` naming ``out``) unless ``overwrite`` is set
    and it is a previous conversion output: it has our model card and holds only files a conversion
    writes. ``quiet`` returns "other" instead of raising.
    """
    if not target.exists():
        return "new"
    why = None
    if not target.is_dir():
        why = f"convert: {out} exists and is not a folder"
    elif not any(target.iterdir()):
        return "empty"
    elif not overwrite:
        why = f"convert: {out} exists and is not empty (pass overwrite=True / --overwrite to replace an earlier conversion)"
    elif (reason := _not_a_conversion(target)) is not None:
        why = (f"convert: refusing to overwrite {out}: {reason}, so it is not an earlier output of python -m models.convert "
               "(overwrite replaces only those); move it away or choose another output folder")  # fmt: skip
    if why is None:
        return "previous"
    if quiet:
        return "other"
    raise FileExistsError(why)


def _not_a_conversion(folder: Path) -> str | None:
    card = folder / MODEL_CARD
    if card.is_symlink() or not card.is_file():
        return f"it has no {MODEL_CARD} model card"
    with open(card, encoding="utf-8", errors="replace") as f:
        if CARD_MARKER not in f.read(1 << 16):
            return f"its {MODEL_CARD} is not a model card this command wrote"
    others = sorted(p.name for p in folder.iterdir() if p.is_symlink() or not p.is_file() or not _written_name(p.name))
    if others:
        return f"it holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}, which a conversion does not write"
    return None


def _written_name(name: str) -> bool:
    return (
        name in (INDEX_FILE, "config.json", MODEL_CARD, *COPIED_FILES)
        or _SHARD_FILE.fullmatch(name) is not None
        or any(fnmatch.fnmatchcase(name, pattern) for pattern in COPIED_PATTERNS)
    )


def _move_into_place(staging: Path, out: Path, target: Path, overwrite: bool) -> None:
    """Rename the complete ``staging`` folder to ``target``; a previous output is moved aside first,
    put back if the rename fails, and removed only once the new folder is in place."""
    state = output_state(out, target, overwrite)  # again: the folder may have changed while converting
    if state != "previous":
        if state == "empty":
            target.rmdir()
        os.rename(staging, target)
        return
    old = staging_name(target, "old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _remove_empty(created: list[Path]) -> None:
    """Remove the parent folders this run created (deepest first), so a failed run leaves no trace."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return


def _free_bytes(target: Path) -> int | None:
    try:
        return shutil.disk_usage(target.parent).free
    except OSError:
        return None


def _check_space(out: Path, target: Path, need: int, state: str) -> None:
    free = _free_bytes(target)
    if free is not None and free < need:
        reason = f"not enough free disk space (about {_megabytes(need)} needed, {_megabytes(free)} free)"
        raise ConversionWriteError(_unchanged(out, reason, state))


def _write_error(e: OSError, out: Path, target: Path, need: int, state: str) -> ConversionWriteError:
    """The error for a failed write: what failed (disk full named as such) and that ``out`` is unchanged."""
    free = _free_bytes(target)
    if getattr(e, "errno", None) == errno.ENOSPC or (free is not None and free < (16 << 20)):
        reason = "no space left on device" + (f" ({_megabytes(free)} free, about {_megabytes(need)} needed)" if free is not None else "")
    else:
        reason = str(e) or type(e).__name__
    error = ConversionWriteError(_unchanged(out, reason, state) + " (partial files removed)")
    error.errno = getattr(e, "errno", None)
    return error


def _unchanged(out: Path, reason: str, state: str) -> str:
    kept = {
        "new": f"{out} was not created",
        "empty": f"{out} is still empty",
        "previous": f"{out} still holds the earlier conversion",
    }.get(state, f"{out} is as it was")
    return f"convert: could not write {out}: {reason}. Nothing was changed: {kept}"


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _notes(config: Mapping[str, Any], added: list[str]) -> list[str]:
    notes = []
    if added:
        reader = "mlx-vlm" if config.get("model_type") == "gemma4_unified" else "mlx-lm"
        notes.append(f"Added for {reader} (same model in our loader): {', '.join(added)}.")
    text = config.get("text_config") if config.get("model_type") in ("gemma4", "gemma3", "gemma4_unified") else config
    text = text or {}
    model_type = config.get("model_type")
    if model_type == "diffusion_gemma":
        notes.append("mlx-lm has no DiffusionGemma; mlx-vlm's diffusion_gemma reads this layout (not tested here: mlx-vlm is not installed).")
    elif model_type == "gemma4" and config.get("vision_config"):
        notes.append("mlx-lm loads the text model of this folder (it drops the vision tower); mlx-vlm's gemma4 reads the "
                     "whole layout (not tested here: mlx-vlm is not installed).")  # fmt: skip
    elif model_type == "gemma4_unified":
        notes.append("mlx-lm has no gemma4_unified; mlx-vlm 0.7.10's gemma4_unified loads this folder (checked by hand, "
                     "docs/unified.md; not in the tests: mlx-vlm is not installed).")  # fmt: skip
    if text.get("attention_bias"):
        notes.append("attention_bias is set: mlx-lm's Gemma classes have no attention biases and cannot load this folder.")
    if text.get("use_bidirectional_attention") in ("all", True):
        notes.append(f"use_bidirectional_attention={text['use_bidirectional_attention']!r}: mlx-lm runs it causally (different outputs).")
    if model_type in ("gemma3", "gemma3_text") and text.get("final_logit_softcapping"):
        notes.append("final_logit_softcapping is set: mlx-lm's gemma3_text does not apply it (different outputs).")
    if model_type in ("gemma3", "gemma3_text") and text.get("sliding_window_pattern") is None:
        notes.append("layer_types has no fixed period: mlx-lm's gemma3_text cannot place the full-attention layers.")
    return notes


def model_card(source: str, raw: Mapping[str, Any], graph: nn.Module, layout: Layout, result: ConversionResult,
               stored: CheckpointQuantization | None) -> str:  # fmt: skip
    """README.md: provenance, what was quantized and how, what stayed in full precision, how to load."""
    lines = ["---", "library_name: mlx", "tags:", "- mlx", "- gemma-mlx-zoo"]
    if result.quantization:
        lines.append("- quantized")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not Path(source).exists():
        lines.append(f"base_model: {source}")
    lines += ["---", "", f"# {result.out.name}", ""]
    lines.append(
        f"{CARD_MARKER} from `{source}` "
        f"(`model_type` {raw.get('model_type')!r}, graph `{type(graph).__name__}`)."
    )
    lines += ["", "## Quantization", ""]
    quantized = quantized_modules(graph)
    scale_dtypes = sorted({str(m.scales.dtype).removeprefix("mlx.core.") for _, m in _quantized_leaves(graph)})
    if not quantized:
        lines.append("None: every weight is stored in full precision.")
    else:
        entry = result.quantization or {}
        lines.append(
            f"Default: {entry.get('bits')}-bit {entry.get('mode', 'affine')} quantization in groups of "
            f"{entry.get('group_size')} along each weight's input axis, MLX's packed format (uint32 weights "
            f"with `.scales` and `.biases` in {', '.join(scale_dtypes)})."
        )
        if result.report is None and stored is not None:
            lines.append("The source was already quantized; its packed weights are written as they were.")
        lines += ["", "| kind | layers | quantization |", "|---|---|---|"]
        kinds = Counter()
        for path, params in quantized.items():
            kind = result.report.quantized[path][1] if result.report and path in result.report.quantized else _kind(path)
            kinds[(kind, str(params))] += 1
        for (kind, params), count in sorted(kinds.items()):
            lines.append(f"| {kind} | {count} | {params} |")
        kept = result.report.kept if result.report else {}
        if kept:
            lines += ["", "Kept in full precision:", ""]
            reasons = Counter(kept.values())
            for reason, count in sorted(reasons.items()):
                example = next(layout.module_path(p) for p, r in kept.items() if r == reason)
                lines.append(f"- {count} layer(s), {reason} (e.g. `{example}`)")
        lines += ["", "Norms, layer scalars and the router's scales are vectors and are stored as they are.",
                  "Per-module exceptions are listed under their written paths in `config.json` → `quantization`."]  # fmt: skip
    lines += ["", "## Size", "", f"{result.total_bytes / 1e6:.1f} MB of weights, {result.parameters / 1e6:.1f} M parameters, "
              f"{result.bits_per_weight:.2f} bits per weight."]  # fmt: skip
    if result.notes:
        lines += ["", "## Compatibility", ""] + [f"- {n}" for n in result.notes]
    lines += ["", "## Use", "", "```python", "import models", "", f'model = models.load("{result.out}")', "```", ""]
    lines += ["On CPU, MLX's quantized matmul is much faster with float32 scales than with bfloat16 ones:",
              '`models.load(path, dtype="float32")` casts the scales (the packed weights stay packed).', ""]  # fmt: skip
    return "\n".join(lines)


def _quantized_leaves(graph: nn.Module):
    return [(p, m) for p, m in tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module) if "scales" in m]


def _kind(path: str) -> str:
    if path.endswith("router.proj"):
        return "router"
    if "embed" in path.split(".")[-1] or path.endswith("lm_head"):
        return "embedding"
    return "experts" if "switch_glu" in path else "linear"


# ---------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """The command line; an error prints one ``error: ...`` line (no traceback) and returns 1 (130 when interrupted)."""
    p = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a zoo name, a local folder or a Hub repo id")
    p.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    p.add_argument("--q-bits", type=int, choices=LOAD_BITS, help="quantize the weights to this many bits")
    p.add_argument("--q-group-size", type=int, choices=LOAD_GROUP_SIZES, help="quantization group size (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast floating weights (and so the scales) first")
    p.add_argument("--embed-bits", type=int, choices=LOAD_BITS, help="bits for the embeddings and the LM head (default: --q-bits)")
    p.add_argument("--quantize-vision", action="store_true", help="quantize the vision tower too (default: full precision)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, help="largest shard file (default 5GB)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier output of this command (only such a folder, and only once the new one is complete)")  # fmt: skip
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")
    args = p.parse_args(argv)
    if args.q_bits is None and (args.embed_bits is not None or args.quantize_vision or args.q_group_size is not None):
        p.error("--q-group-size, --embed-bits and --quantize-vision need --q-bits")
    try:
        policy = None
        if args.q_bits is not None and (args.embed_bits is not None or args.quantize_vision):
            policy = QuantizationPolicy(args.q_bits, args.q_group_size or 64, embed_bits=args.embed_bits, quantize_vision=args.quantize_vision)
        result = convert(
            args.model, args.out,
            q_bits=None if policy else args.q_bits, q_group_size=None if policy else args.q_group_size,
            dtype=args.dtype, q_policy=policy, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
        )  # fmt: skip
    except KeyboardInterrupt:
        if args.traceback:
            raise
        print(f"error: interrupted; nothing was changed ({args.out} is as it was)", file=sys.stderr)
        return 130
    except Exception as e:
        if args.traceback:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    q = result.quantization
    what = f"{q['bits']}-bit, group {q['group_size']}" if q else "not quantized"
    print(
        f"wrote {result.out}: {len(result.files)} files, {result.total_bytes / 1e6:.1f} MB "
        f"({result.bits_per_weight:.2f} bits per weight, {what}) in {result.seconds:.1f} s"
    )
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _one_line(e: BaseException) -> str:
    """``e`` on one line; errors we do not raise ourselves keep their type name (``KeyError: 'x'``)."""
    text = " ".join(str(e).split())
    if isinstance(e, (OSError, ValueError)) and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
