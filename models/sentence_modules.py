"""Read a sentence-transformers checkpoint folder's head: ``modules.json``, the module configs, the task prompts.

sentence-transformers saves a model as a list of modules (``modules.json``): the transformer at the
folder's root, then ``Pooling``, ``Dense`` and ``Normalize`` in their own sub-folders, each with a
``config.json`` (and the dense weights as ``model.safetensors``). ``sentence_head`` turns those
files into a ``graphs.sentence_head.SentenceHeadConfig`` and its weights; ``SentenceSettings``
carries the prompts of ``config_sentence_transformers.json`` and the token limit of
``sentence_bert_config.json``. Anything the head does not compute is refused by file and key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphs.sentence_head import ACTIVATIONS, POOLING_MODES, DenseSpec, SentenceHead, SentenceHeadConfig
from weights import load_safetensors
from weights.modules import load_mapped
from weights.resolve import folder_file

MODULE_TYPES = ("Transformer", "Pooling", "Dense", "Normalize")
# Legacy boolean keys of a Pooling config.json -> the pooling mode each switches on.
LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


class SentenceModulesError(ValueError):
    """A sentence-transformers file the head cannot use (the message names the file, key and value)."""


@dataclass(frozen=True)
class SentenceSettings:
    """The task prompts (name -> text prepended to the input), the default prompt name, and the token limit."""

    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None


def is_sentence_transformers(folder: Path) -> bool:
    return (folder / "modules.json").is_file()


def sentence_head(folder: Path, hidden_size: int, dtype) -> SentenceHead:
    """The head ``modules.json`` describes after the transformer, its dense weights loaded (cast to ``dtype``)."""
    modules = _read_json(folder, "modules.json")
    if not isinstance(modules, list) or not modules:
        raise SentenceModulesError(f"{folder / 'modules.json'}: expected a non-empty list of modules, got {modules!r}")
    kinds = []
    for entry in sorted(modules, key=lambda m: m.get("idx", 0) if isinstance(m, dict) else 0):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1] if isinstance(entry, dict) else ""
        if kind not in MODULE_TYPES:
            raise SentenceModulesError(f"{folder / 'modules.json'}: module {entry!r} has a type the zoo does not run; it runs {MODULE_TYPES}")
        kinds.append((kind, str(entry.get("path", ""))))
    if kinds[0][0] != "Transformer" or kinds[1][0] != "Pooling" or any(k == "Transformer" for k, _ in kinds[1:]):
        raise SentenceModulesError(f"{folder / 'modules.json'}: expected a Transformer, then Pooling, then Dense/Normalize; got {[k for k, _ in kinds]}")
    pooling = _pooling_mode(folder, kinds[1][1])
    dense, dense_paths, normalize, width = [], [], False, hidden_size
    for kind, path in kinds[2:]:
        if normalize:
            raise SentenceModulesError(f"{folder / 'modules.json'}: {kind} after Normalize is not supported")
        if kind == "Normalize":
            normalize = True
            continue
        spec = _dense_spec(folder, path)
        if spec.in_features != width:
            raise SentenceModulesError(f"{folder / path / 'config.json'}: in_features is {spec.in_features}, but its input has {width} values")
        dense.append(spec)
        dense_paths.append(path)
        width = spec.out_features
    head = SentenceHead(SentenceHeadConfig(pooling, tuple(dense), normalize))
    mapped = {}
    for i, path in enumerate(dense_paths):
        folder_file(folder, f"{path}/model.safetensors")  # inside the folder, a regular file
        weights, _ = load_safetensors(folder / path, dtype)
        mapped.update({f"dense.{i}.{k.removeprefix('linear.')}": v for k, v in weights.items()})
    if dense:
        load_mapped(head, mapped, "sentence-transformers Dense weights")
    head.eval()
    return head


def head_files(folder: Path) -> list[str]:
    """The sentence-transformers files of ``folder`` beyond the transformer's (paths relative to it),
    for a conversion to carry: ``modules.json``, the prompt and limit configs, each module folder's files."""
    if not is_sentence_transformers(folder):
        return []
    names = [n for n in ("modules.json", "config_sentence_transformers.json", "sentence_bert_config.json") if (folder / n).is_file()]
    modules = _read_json(folder, "modules.json")
    for entry in modules if isinstance(modules, list) else []:
        path = str(entry.get("path", "")) if isinstance(entry, dict) else ""
        if path and (folder / path).is_dir():
            names += sorted(f"{path}/{p.name}" for p in (folder / path).iterdir() if p.is_file())
    return names


def sentence_settings(folder: Path) -> SentenceSettings:
    """The prompts of ``config_sentence_transformers.json`` and ``max_seq_length`` of ``sentence_bert_config.json`` (each optional)."""
    prompts, default, limit = {}, None, None
    if (folder / "config_sentence_transformers.json").is_file():
        raw = _read_json(folder, "config_sentence_transformers.json")
        prompts = raw.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
            raise SentenceModulesError(f"{folder / 'config_sentence_transformers.json'}: prompts must map names to strings, got {prompts!r}")
        default = raw.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise SentenceModulesError(f"{folder / 'config_sentence_transformers.json'}: default_prompt_name {default!r} is not one of the prompts {sorted(prompts)}")
    if (folder / "sentence_bert_config.json").is_file():
        limit = _read_json(folder, "sentence_bert_config.json").get("max_seq_length")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise SentenceModulesError(f"{folder / 'sentence_bert_config.json'}: max_seq_length must be a positive int, got {limit!r}")
    return SentenceSettings(prompts, default, limit)


def _pooling_mode(folder: Path, path: str) -> str:
    name = Path(path) / "config.json"
    raw = _read_json(folder, str(name))
    if "pooling_mode" in raw:
        modes = raw["pooling_mode"]
        modes = [modes] if isinstance(modes, str) else list(modes) if isinstance(modes, list) else [modes]
    else:
        modes = [mode for key, mode in LEGACY_POOLING.items() if raw.get(key)] or ["mean"]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise SentenceModulesError(f"{folder / name}: pooling mode {modes!r} is not supported; one of {POOLING_MODES}")
    if raw.get("include_prompt", True) is not True:
        raise SentenceModulesError(f"{folder / name}: include_prompt {raw['include_prompt']!r} is not supported (the prompt is pooled)")
    return modes[0]


def _dense_spec(folder: Path, path: str) -> DenseSpec:
    name = Path(path) / "config.json"
    raw = _read_json(folder, str(name))
    activation = raw.get("activation_function", "torch.nn.modules.activation.Tanh")  # sentence-transformers' default
    if activation not in ACTIVATIONS:
        raise SentenceModulesError(f"{folder / name}: activation_function {activation!r} is not supported; one of {sorted(ACTIVATIONS)}")
    if raw.get("use_residual"):
        raise SentenceModulesError(f"{folder / name}: use_residual is not supported")
    try:
        return DenseSpec(int(raw["in_features"]), int(raw["out_features"]), bool(raw.get("bias", True)), activation)
    except (KeyError, TypeError, ValueError) as e:
        raise SentenceModulesError(f"{folder / name}: in_features and out_features must be ints ({e})") from e


def _read_json(folder: Path, name: str) -> Any:
    path = folder_file(folder, name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SentenceModulesError(f"{path}: cannot be read as JSON ({e})") from e

