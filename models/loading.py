"""``load()``: resolve a model, read its config and weights, build the graph, attach the tokenizer.

One loader serves every architecture in ``models.registry``; the registry says which object
(``Model`` or ``DiffusionModel``) wraps the graph. ``load_graph`` is the part the convert command
shares: the graph with its checkpoint loaded, before any device preparation.

The tokenizer is loaded with ``trust_remote_code=False``: a folder is data, and a
``tokenizer_config.json`` whose ``auto_map`` names a ``.py`` file in it would otherwise make
transformers ask on stdin whether to run that file. Its vocabulary must fit the model's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

from graphs.config import ConfigError
from weights import load_safetensors, read_config, resolve_model_path
from weights.safetensors_io import checkpoint_shapes
from weights.resolve import folder_file
from weights.quantize import QuantizationPolicy, QuantizationReport, plan_load, quantize_model

from models.generation.generate import GenerationOptionError, checkpoint_sampling
from models.checks import TOKENIZER_FILES, TokenizerLoadError, VocabularyMismatchError, tokenizer_vocabulary_size
from models.precision import AUTO, DevicePlan, Precision, cast_weights, choose, choose_plan, prepare
from models.registry import Architecture, architecture_for
from models.zoo import zoo_folder


@dataclass
class LoadedGraph:
    """A graph with its checkpoint loaded (and quantized on load when asked)."""

    graph: Any
    config: Any
    raw_config: dict
    architecture: Architecture
    precision: Precision
    quantization: QuantizationReport | None


def model_folder(name_or_path: str) -> Path:
    """The local folder of a zoo name, a local folder or a Hub repo id."""
    return zoo_folder(str(name_or_path)) or resolve_model_path(str(name_or_path))


# Side files the tokenizer and the generation defaults are read from; each must lie inside the folder.
SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def check_side_files(folder: Path) -> None:
    """Refuse (``OutsideFolderError``, by name) a side file that is a symlink out of ``folder``:
    transformers and mlx-lm would follow it."""
    for name in SIDE_FILES:
        if (folder / name).is_symlink() or (folder / name).exists():
            folder_file(folder, name)


def read_generation_config(folder: Path) -> dict:
    path = folder_file(folder, "generation_config.json")
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: invalid JSON ({err})") from err


def check_sampling_defaults(folder: Path, generation_config: dict) -> None:
    """Refuse at load, by file and key, sampling defaults no request could use (``top_p: 1.5``)."""
    try:
        checkpoint_sampling(generation_config)
    except GenerationOptionError as err:
        raise ValueError(f"{folder / 'generation_config.json'}: {err}") from None


def load_tokenizer(folder: Path, vocab_size: int | None, eos_token_ids=None):
    """The folder's tokenizer wrapped by mlx-lm (streaming detokenizer), or None when the folder has
    no tokenizer file (``TOKENIZER_FILES``; a ``tokenizer_config.json`` alone holds no vocabulary).

    Never runs code from the folder (``trust_remote_code=False``, which mlx-lm passes on to
    ``AutoTokenizer.from_pretrained``). Raises ``TokenizerLoadError`` when the files cannot be
    loaded and ``VocabularyMismatchError`` when the tokenizer has more ids than ``vocab_size``.
    """
    present = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not present:
        return None
    check_side_files(folder)
    try:
        tokenizer = load_mlx_lm_tokenizer(folder, tokenizer_config_extra={"trust_remote_code": False}, eos_token_ids=eos_token_ids)
    except (ValueError, OSError, ImportError) as err:
        if "custom code" in str(err) or "trust_remote_code" in str(err):
            raise TokenizerLoadError(
                f"{folder}: the tokenizer needs code from the folder (auto_map in tokenizer_config.json names a .py "
                "file). Code shipped inside a checkpoint folder is never run (trust_remote_code=False); set "
                "tokenizer_class in tokenizer_config.json to a class transformers provides"
            ) from err
        raise TokenizerLoadError(f"{folder}: the tokenizer ({', '.join(present)}) could not be loaded: {err}") from err
    size = tokenizer_vocabulary_size(tokenizer)
    if vocab_size is not None and size > vocab_size:
        raise VocabularyMismatchError(
            f"{folder}: the tokenizer has {size} ids but the model's vocabulary (config.json vocab_size) has "
            f"{vocab_size}; ids past {vocab_size - 1} would read outside the embedding table, so these tokenizer "
            "files do not belong to this checkpoint"
        )
    return tokenizer


def vocab_size_of(config) -> int:
    """The rows of the model's embedding table: ``vocab_size`` of the config or of its text part."""
    return getattr(config, "text", config).vocab_size


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FINAL_NORM = re.compile(r"(?:^|\.)norm\.weight$")


def check_sizes(config, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    """Refuse a config that declares more than the checkpoint's tensors (``shapes``, from the
    headers) hold: more layers, a larger vocabulary, hidden size or MLP, more attention heads, more
    or wider MoE experts. Run before the graph is built, which allocates what the config says: a million layers
    ran the process out of memory (``std::bad_alloc``) before the missing weights were noticed.
    Raises ``ConfigError`` naming the key, its value and what the checkpoint holds."""
    parts = (("text", getattr(config, "text", config)), ("vision", getattr(config, "vision", None)),
             ("audio", getattr(config, "audio", None)))  # fmt: skip
    for part, sizes in parts:
        if sizes is None:
            continue
        if part == "text":
            mine = {k: v for k, v in shapes.items() if "vision" not in k and "audio" not in k}
        else:
            mine = {k: v for k, v in shapes.items() if part in k}
        layers = {int(m.group(1)) for m in map(_LAYER.search, mine) if m}
        held = {"num_hidden_layers": (max(layers) + 1 if layers else None, "layers")}  # key: (limit, what it counts)
        if part == "text":
            held["vocab_size"] = (_largest(mine, lambda k: k.endswith("embed_tokens.weight")), "embedding rows")
            final_norm = _largest(mine, lambda k: _FINAL_NORM.search(k) is not None and "layers." not in k)
            held["hidden_size"] = (final_norm, "values in the final norm")
            head_dim, rows = getattr(sizes, "head_dim", None), _largest(mine, lambda k: k.endswith("q_proj.weight"))
            held["num_attention_heads"] = (None if rows is None or not head_dim else rows // head_dim,
                                           f"heads of head_dim {head_dim} in their widest q_proj")  # fmt: skip
            held["intermediate_size"] = (_largest(mine, lambda k: _DENSE_MLP.search(k) is not None), "rows in the widest MLP gate/up projection")
            experts = {k: v for k, v in mine.items() if ".experts." in k and len(v) == 3}
            held["num_experts"] = (max((v[0] for v in experts.values()), default=None), "experts")
            held["moe_intermediate_size"] = (max((v[1] // (2 if k.endswith(("gate_up_proj", "gate_up_proj.weight")) else 1)
                                                  for k, v in experts.items() if _EXPERT_IN.search(k)), default=None),
                                             "rows per expert in the gate/up projections")  # fmt: skip
        for key, (limit, what) in held.items():
            value = getattr(sizes, key, None)
            if limit is not None and isinstance(value, int) and value > limit:
                raise ConfigError(f"{source}: {key} is {value}, but the checkpoint's {part} weights hold {limit} {what}")


_DENSE_MLP = re.compile(r"\.mlp\.(gate|up)_proj\.weight$")  # a dense MLP's input projections (not the experts')
_EXPERT_IN = re.compile(r"\.experts\.(gate_up_proj|switch_glu\.(gate|up)_proj)(\.weight)?$")  # [E, (2x) Im, H]


def _largest(shapes: Mapping[str, Sequence[int]], chosen) -> int | None:
    """The largest first dimension among the tensors ``chosen`` picks by name, or None."""
    rows = [shape[0] for key, shape in shapes.items() if chosen(key) and shape]
    return max(rows) if rows else None


def load_graph(
    folder: Path,
    dtype=AUTO,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_policy: QuantizationPolicy | None = None,
    sharding=None,
    plan: DevicePlan | None = None,
) -> LoadedGraph:
    """Build the graph for ``folder`` and load its checkpoint (cast per ``models.precision.choose``
    under ``plan``); with ``sharding`` (``models.parallel``), only this rank's part of it."""
    raw = read_config(folder)
    source = str(folder / "config.json")
    weights, _ = load_safetensors(folder) if sharding is None else sharding.read(folder, raw)
    precision = choose(dtype, weights, plan)
    weights = cast_weights(weights, precision)
    quantization = plan_load(raw, weights, source, q_bits, q_group_size, q_policy)
    architecture = architecture_for(raw, source, weights.keys())
    config = architecture.parse_config(raw)
    check_sizes(config, checkpoint_shapes(folder), source)
    graph = architecture.build_graph(config)
    if sharding is None:
        architecture.load_weights(graph, weights)
    else:
        sharding.load(graph, architecture, weights)
    del weights  # the graph holds what it needs; the rest (e.g. float weights quantized away) can go
    report = quantize_model(graph, quantization) if quantization is not None else None
    graph.eval()
    return LoadedGraph(graph, config, raw, architecture, precision, report)


def load(
    name_or_path: str,
    dtype=AUTO,
    tokenizer: bool = True,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_policy: QuantizationPolicy | None = None,
    sharding=None,
    plan: str | None = None,
):
    """Load a model by zoo name (``models.zoo.ZOO``), local folder or Hub repo id: a ``Model``, a
    ``DiffusionModel`` for DiffusionGemma checkpoints, or an ``EmbeddingModel`` for a bidirectional
    encoder with a sentence-transformers head (EmbeddingGemma).

    ``dtype`` casts floating weights (the scales of a quantized checkpoint are floating too);
    ``"auto"`` (default) lets ``models.precision`` choose for the plan (float32 under the CPU plan
    with a fast BLAS, the checkpoint's dtype elsewhere) and ``None`` keeps the checkpoint's dtypes.
    ``plan`` (``"cpu"``, ``"accelerator"``, ``"auto"``; None: ``GEMMA_ZOO_PLAN``, by default
    ``auto``, which picks by MLX's default device) is the device plan (``models.precision.DevicePlan``). The
    tokenizer, with mlx-lm's streaming detokenizer, is attached unless ``tokenizer=False`` or the
    folder has none (``load_tokenizer``); without one, ids still go in and come out.
    Pre-quantized MLX checkpoints load as stored; ``q_bits`` (4 or 8) and ``q_group_size`` (32, 64
    or 128; default 64), or a whole ``q_policy``, quantize a full-precision checkpoint on load
    (``docs/quantization.md``). ``models.precision.prepare`` then applies the plan. ``sharding`` (``models.parallel.sharding_for``) loads this rank's part of a
    model split over MLX's distributed group (``docs/distributed.md``).
    """
    folder = model_folder(name_or_path)
    device_plan = choose_plan(plan)
    loaded = load_graph(folder, dtype, q_bits, q_group_size, q_policy, sharding, device_plan)
    device_notes = prepare(loaded.graph, loaded.precision, device_plan, encoder=loaded.architecture.generation == "embedding")
    if sharding is not None:
        loaded.graph = sharding.connect(loaded.graph)
    generation_config = read_generation_config(folder)
    wrapper = None
    if tokenizer:
        vocab_size = None if loaded.architecture.generation == "embedding" else vocab_size_of(loaded.config)
        wrapper = load_tokenizer(folder, vocab_size, generation_config.get("eos_token_id"))
    if loaded.architecture.generation == "diffusion":
        from models.diffusion_model import DiffusionModel

        model = DiffusionModel(loaded.graph, loaded.config, wrapper, generation_config, folder)
    elif loaded.architecture.generation == "embedding":
        from models.embedding_model import EmbeddingModel

        model = EmbeddingModel(loaded.graph, loaded.config, wrapper, folder, loaded.raw_config["model_type"])
    elif loaded.architecture.processors == "gemma4_unified":
        from models.unified_model import UnifiedModel

        check_sampling_defaults(folder, generation_config)
        model = UnifiedModel(loaded.graph, loaded.config, wrapper, generation_config, folder, loaded.raw_config["model_type"])
    else:
        from models.model import Model

        check_sampling_defaults(folder, generation_config)
        model = Model(loaded.graph, loaded.config, wrapper, generation_config, folder, loaded.raw_config["model_type"])
    model.plan, model.precision, model.device_notes = device_plan, loaded.precision, device_notes  # stated by --verbose
    return model
