"""Quantized weights: pre-quantized MLX checkpoints, quantization on load, and what a graph holds.

Storage is MLX's, written by mlx-lm and mlx-vlm: a quantized module ``P`` keeps ``P.weight`` packed
into uint32, ``P.scales`` and (affine mode) ``P.biases``; ``config.json`` has a ``quantization``
entry ``{"group_size": 64, "bits": 4, "mode"?: "affine", "<module path>": {...} | false, ...}``
whose default applies to every quantized module it does not name. The modules themselves are
mlx's ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` and mlx-lm's ``QuantizedSwitchLinear``
(MoE experts), made by ``nn.quantize``; nothing here computes a quantized product.

Three steps, each strict and each naming the key it refuses:

1. ``read_quantization`` parses the config entry and ``check_checkpoint`` holds every packed
   tensor of the checkpoint against it (in the checkpoint's own key names), so a config that
   disagrees with its weights is an error, never a silently different model.
2. The key mappings (``weights/*_keys.py``) carry ``.scales``/``.biases`` along with the packed
   ``.weight`` where ``is_quantized_entry`` says the target parameter is a quantizable weight;
   ``prepare_quantized`` then swaps exactly those modules of the graph for their quantized twins
   (group size and bits read off the shapes with mlx-lm's ``infer_quant_config``), and the strict
   ``load_weights`` checks every name and shape.
3. ``quantize_model`` quantizes a loaded full-precision graph under ``QuantizationPolicy``
   (``docs/quantization.md``): embeddings and the tied head, the MoE router, the vision tower and
   layers whose input the group size does not divide each follow a stated rule; every layer kept
   in full precision is logged at debug level with its reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.utils import infer_quant_config

logger = logging.getLogger(__name__)

AFFINE = "affine"
# mx.quantize's modes; the fixed-format ones allow one (bits, group_size) pair and store no biases.
FIXED_FORMAT_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}
MODES = (AFFINE, *FIXED_FORMAT_MODES)
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUP_SIZES = (32, 64, 128)
# What quantization on load and ``models.convert`` offer.
LOAD_BITS = (4, 8)
LOAD_GROUP_SIZES = (32, 64, 128)

_PACKED_SUFFIXES = (".scales", ".biases")
SCALE_DTYPES = ("float32", "float16", "bfloat16")  # QuantizationPolicy.scale_dtype
_PARAM_KEYS = ("group_size", "bits", "mode")
_QUANTIZED_TYPES = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
_VISION_PARTS = ("vision_tower", "embed_vision", "vision_embedder")  # vision_embedder: Gemma 4 unified


class QuantizationError(ValueError):
    """A quantization config, option or packed tensor that is invalid or disagrees with the weights."""


# ---------------------------------------------------------------------------------------- params
@dataclass(frozen=True)
class QuantParams:
    """One module's quantization: ``bits`` per weight in groups of ``group_size`` along the input axis."""

    bits: int
    group_size: int
    mode: str = AFFINE

    def kwargs(self) -> dict[str, Any]:
        """The arguments of ``to_quantized`` / ``nn.quantize``."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def config_entry(self) -> dict[str, Any]:
        """How mlx-lm writes it in ``config.json`` (``mode`` only when it is not affine)."""
        entry: dict[str, Any] = {"group_size": self.group_size, "bits": self.bits}
        if self.mode != AFFINE:
            entry["mode"] = self.mode
        return entry

    def __str__(self) -> str:
        mode = "" if self.mode == AFFINE else f" {self.mode}"
        return f"{self.bits}-bit{mode}, group {self.group_size}"


def check_params(bits: Any, group_size: Any, mode: Any, where: str) -> QuantParams:
    """Validated ``QuantParams``; ``where`` names the config key or option in the error."""
    if mode not in MODES:
        raise QuantizationError(f"{where}: unknown quantization mode {mode!r}; supported: {', '.join(MODES)}")
    for name, value in (("bits", bits), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise QuantizationError(f"{where}: {name} must be an integer, got {value!r}")
    if mode == AFFINE:
        if bits not in AFFINE_BITS:
            raise QuantizationError(f"{where}: bits={bits} is not supported; affine quantization takes {AFFINE_BITS}")
        if group_size not in AFFINE_GROUP_SIZES:
            raise QuantizationError(
                f"{where}: group_size={group_size} is not supported; affine quantization takes {AFFINE_GROUP_SIZES}"
            )
    elif (bits, group_size) != FIXED_FORMAT_MODES[mode]:
        want_bits, want_group = FIXED_FORMAT_MODES[mode]
        raise QuantizationError(
            f"{where}: mode {mode!r} needs bits={want_bits} and group_size={want_group}, got bits={bits}, group_size={group_size}"
        )
    return QuantParams(bits, group_size, mode)


def load_options(q_bits: int | None, q_group_size: int | None, where: str = "quantization on load") -> QuantParams | None:
    """``q_bits`` / ``q_group_size`` of ``models.load`` and ``models.convert``, checked (None: no quantization)."""
    if q_bits is None:
        if q_group_size is not None:
            raise QuantizationError(f"{where}: q_group_size={q_group_size} was given without q_bits")
        return None
    if isinstance(q_bits, bool) or q_bits not in LOAD_BITS:
        raise QuantizationError(f"{where}: q_bits must be one of {LOAD_BITS}, got {q_bits!r}")
    group_size = 64 if q_group_size is None else q_group_size
    if isinstance(group_size, bool) or group_size not in LOAD_GROUP_SIZES:
        raise QuantizationError(f"{where}: q_group_size must be one of {LOAD_GROUP_SIZES}, got {q_group_size!r}")
    return QuantParams(q_bits, group_size)


# ---------------------------------------------------------------------------------------- config entry
@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's ``quantization`` entry: the default and the per-module overrides (None: full precision).

    Override keys are module paths in the checkpoint's own key names (``model.layers.0.mlp.down_proj``).
    """

    default: QuantParams
    overrides: Mapping[str, QuantParams | None] = field(default_factory=dict)

    def params_for(self, module_path: str) -> tuple[QuantParams | None, str]:
        """The params of ``module_path`` and the config key they come from (for error messages)."""
        if module_path in self.overrides:
            return self.overrides[module_path], f"quantization[{module_path!r}]"
        return self.default, "quantization (the default)"

    def to_config(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"group_size": self.default.group_size, "bits": self.default.bits, "mode": self.default.mode}
        for path, params in self.overrides.items():
            entry[path] = False if params is None else params.config_entry()
        return entry


def read_quantization(config: Mapping[str, Any], source: str = "config.json") -> CheckpointQuantization | None:
    """The checkpoint's ``quantization`` entry, validated; None when it has none.

    A transformers-style ``quantization_config`` (AWQ, GPTQ, bitsandbytes, fp8...) is not MLX's
    storage and is refused by name; mlx-lm writes its own entry under both keys, which is fine.
    """
    entry = config.get("quantization")
    if entry is None:
        legacy = config.get("quantization_config")
        if legacy is None:
            return None
        if not isinstance(legacy, Mapping) or "quant_method" in legacy or "bits" not in legacy:
            method = legacy.get("quant_method") if isinstance(legacy, Mapping) else None
            raise QuantizationError(
                f"{source}: 'quantization_config' (quant_method {method!r}) is not an MLX quantization; "
                "only MLX's packed weights with a 'quantization' entry are read (convert the model with "
                "mlx_lm.convert or python -m models.convert from full-precision weights)"
            )
        entry = legacy
    if not isinstance(entry, Mapping):
        raise QuantizationError(f"{source}: 'quantization' must be an object, got {type(entry).__name__}")
    for key in ("group_size", "bits"):
        if key not in entry:
            raise QuantizationError(f"{source}: 'quantization' has no {key!r}")
    default = check_params(entry["bits"], entry["group_size"], entry.get("mode", AFFINE), f"{source}: quantization")
    overrides: dict[str, QuantParams | None] = {}
    for key, value in entry.items():
        if key in _PARAM_KEYS:
            continue
        where = f"{source}: quantization[{key!r}]"
        if value is False:
            overrides[key] = None
        elif value is True:
            overrides[key] = default
        elif isinstance(value, Mapping):
            unknown = sorted(set(value) - set(_PARAM_KEYS))
            if unknown:
                raise QuantizationError(f"{where} has unknown fields {unknown}; a module override takes {_PARAM_KEYS}")
            overrides[key] = check_params(
                value.get("bits", default.bits), value.get("group_size", default.group_size), value.get("mode", default.mode), where
            )
        else:
            raise QuantizationError(
                f"{where} must be a module override (an object with bits/group_size, or true/false), got {value!r}"
            )
    return CheckpointQuantization(default, overrides)


def check_checkpoint(
    weights: Mapping[str, mx.array], quantization: CheckpointQuantization | None, source: str = "checkpoint"
) -> dict[str, QuantParams]:
    """Hold every packed tensor of the checkpoint against its ``quantization`` entry.

    Returns ``{module path: params}`` for the modules stored quantized (checkpoint key names).
    Raises ``QuantizationError`` naming the key on: packed tensors without a config entry, scales
    without a weight (or biases without scales), a module the config keeps in full precision but
    the checkpoint stores packed (or the other way round), and shapes that are not the config's
    bits and group size.
    """
    packed = sorted(key[: -len(".scales")] for key in weights if key.endswith(".scales"))
    packed_set = set(packed)
    for key in sorted(weights):
        if key.endswith(".biases") and key[: -len(".biases")] not in packed_set:
            raise QuantizationError(f"{source}: {key!r} has no {key[: -len('.biases')] + '.scales'!r} beside it")
    for key, value in weights.items():
        if key.endswith(".weight") and value.dtype == mx.uint32 and key[: -len(".weight")] not in packed_set:
            raise QuantizationError(f"{source}: {key!r} is packed (uint32) but has no {key[: -len('.weight')] + '.scales'!r}")
    if packed and quantization is None:
        raise QuantizationError(
            f"{source}: the weights are quantized ({packed[0] + '.scales'!r} and {len(packed) - 1} more) "
            "but config.json has no 'quantization' entry"
        )
    plan: dict[str, QuantParams] = {}
    for path in packed:
        params, where = quantization.params_for(path)
        if params is None:
            raise QuantizationError(
                f"{source}: {where} keeps {path!r} in full precision, but the checkpoint stores it quantized ({path}.scales)"
            )
        _check_packed(weights, path, params, f"{source}: {where}")
        plan[path] = params
    for path, params in (quantization.overrides if quantization else {}).items():
        if params is not None and path not in packed_set:
            weight = weights.get(path + ".weight")
            if weight is not None:
                raise QuantizationError(
                    f"{source}: quantization[{path!r}] quantizes it ({params}), but the checkpoint "
                    f"stores {path}.weight unquantized ({weight.dtype})"
                )
            logger.debug("quantization: config override %r names no module of this checkpoint", path)
    return plan


def _check_packed(weights: Mapping[str, mx.array], path: str, params: QuantParams, where: str) -> None:
    weight = weights.get(path + ".weight")
    scales = weights[path + ".scales"]
    biases = weights.get(path + ".biases")
    if weight is None:
        raise QuantizationError(f"{where}: {path + '.scales'!r} has no {path + '.weight'!r} beside it")
    if weight.dtype != mx.uint32:
        raise QuantizationError(f"{where}: {path + '.weight'!r} has scales, so it must be packed uint32, got {weight.dtype}")
    if params.mode == AFFINE and biases is None:
        raise QuantizationError(f"{where}: affine quantization needs {path + '.biases'!r}, which the checkpoint lacks")
    if params.mode != AFFINE and biases is not None:
        raise QuantizationError(f"{where}: mode {params.mode!r} has no biases, but the checkpoint holds {path + '.biases'!r}")
    packed_width = weight.shape[-1]
    in_dims, rest = divmod(packed_width * 32, params.bits)
    good = (
        rest == 0
        and in_dims % params.group_size == 0
        and tuple(scales.shape) == (*weight.shape[:-1], in_dims // params.group_size)
        and (biases is None or tuple(biases.shape) == tuple(scales.shape))
    )
    if not good:
        shapes = f"{path}.weight {list(weight.shape)}, {path}.scales {list(scales.shape)}"
        if biases is not None:
            shapes += f", {path}.biases {list(biases.shape)}"
        raise QuantizationError(f"{where} says {params}, which does not fit the stored shapes ({shapes}){_guess(weight, scales)}")


def _guess(weight: mx.array, scales: mx.array) -> str:
    """What the shapes would fit, for the error message."""
    fits = []
    for bits in AFFINE_BITS:
        in_dims, rest = divmod(weight.shape[-1] * 32, bits)
        if rest == 0 and scales.shape[-1] and in_dims % scales.shape[-1] == 0 and in_dims // scales.shape[-1] in AFFINE_GROUP_SIZES:
            fits.append(f"{bits}-bit, group {in_dims // scales.shape[-1]}")
    return f"; they fit {' or '.join(fits)}" if fits else ""


# ---------------------------------------------------------------------------------------- loading into a graph
def is_quantized_entry(name: str, value: mx.array, expected: Mapping[str, Any]) -> bool:
    """True when ``name`` is a packed ``.weight``, or the ``.scales``/``.biases``, of a parameter that
    ``expected`` (the full-precision graph's ``{name: shape}``) holds as a float ``.weight``.

    The key mappings accept such entries in place of the float weight; ``prepare_quantized`` then
    swaps the module and the strict load checks the exact shapes. Only the leading (row/expert)
    dimensions are compared here, as the packed last axis depends on bits and group size.
    """
    if name.endswith(".weight"):
        if value.dtype != mx.uint32 or name not in expected:
            return False
        base = name
    elif name.endswith(_PACKED_SUFFIXES):
        base = name[: -len(".scales")] + ".weight"
        if base not in expected:
            return False
    else:
        return False
    want = tuple(expected[base])
    return value.ndim == len(want) and tuple(value.shape[:-1]) == want[:-1]


def prepare_quantized(model: nn.Module, mapped: Mapping[str, mx.array], where: str = "weights") -> dict[str, QuantParams]:
    """Swap every module of ``model`` whose mapped weights are packed for its quantized twin.

    ``mapped`` is ``{graph parameter name: array}`` (a key mapping's output). A module is quantized
    exactly when ``{path}.scales`` is there; bits and group size are read off the shapes (mlx-lm's
    ``infer_quant_config``), so the strict ``load_weights`` that follows checks every shape.
    Returns ``{module path: params}``; ``{}`` for a full-precision checkpoint.
    """
    plan: dict[str, QuantParams] = {}
    for path, module in _leaf_modules(model):
        weight = mapped.get(path + ".weight")
        if path + ".scales" not in mapped:
            if weight is not None and weight.dtype == mx.uint32:
                raise QuantizationError(f"{where}: {path}.weight is packed (uint32) but has no {path}.scales")
            continue
        if isinstance(module, _QUANTIZED_TYPES):
            raise QuantizationError(f"{where}: {path} is already quantized in the graph")
        if not hasattr(module, "to_quantized") or weight is None:
            raise QuantizationError(f"{where}: {path}.scales is in the checkpoint, but {path} ({type(module).__name__}) cannot be quantized")
        try:
            inferred = infer_quant_config(path, module, mapped)
        except ValueError as e:
            raise QuantizationError(f"{where}: {path}: {e}") from None
        params = check_params(inferred["bits"], inferred["group_size"], inferred["mode"], f"{where}: {path}")
        if params.mode == AFFINE and path + ".biases" not in mapped:
            raise QuantizationError(f"{where}: {path} is affine-quantized but {path}.biases is missing")
        plan[path] = params
    if plan:
        nn.quantize(model, class_predicate=lambda path, _: plan[path].kwargs() if path in plan else False)
    return plan


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)


# ---------------------------------------------------------------------------------------- quantize on load
@dataclass(frozen=True)
class QuantizationPolicy:
    """What ``quantize_model`` does with each kind of layer (``docs/quantization.md``).

    * linear layers of the text decoder (attention, MLP, per-layer-input projections, DiffusionGemma's
      self-conditioning MLP) and the MoE experts: ``bits`` in groups of ``group_size``;
    * token embeddings (``embed_tokens``, the per-layer ``embed_tokens_per_layer``), which are also the
      tied LM head, and an untied ``lm_head``: ``embed_bits`` (default: ``bits``) in groups of
      ``embed_group_size`` (default: ``group_size``);
    * the MoE router projection: ``router`` (mlx-lm's choice, 8 bits in groups of 64), or full
      precision with ``router=None``;
    * the vision tower and the multimodal embedder: full precision unless ``quantize_vision``;
    * norms, scalars and the router's scales are not matrices and stay as they are;
    * a layer whose input dimension the group size does not divide (including one smaller than a
      group) stays in full precision, logged at debug level;
    * scales and biases are stored in ``scale_dtype`` ("float32", "float16", "bfloat16"; default:
      each weight's dtype). float16 halves their bytes from float32 at no measurable cost on the
      real 270M; bfloat16's 8-bit mantissa doubles 8-bit's KL there (docs/quantization.md).
    """

    bits: int
    group_size: int
    mode: str = AFFINE
    embed_bits: int | None = None
    router: QuantParams | None = QuantParams(8, 64)
    quantize_vision: bool = False
    embed_group_size: int | None = None
    scale_dtype: str | None = None

    def __post_init__(self) -> None:
        check_params(self.bits, self.group_size, self.mode, "quantization policy")
        if self.embed_bits is not None or self.embed_group_size is not None:
            check_params(self.embed_params.bits, self.embed_params.group_size, self.mode,
                         "quantization policy (embed_bits, embed_group_size)")  # fmt: skip
        if self.scale_dtype not in (None, *SCALE_DTYPES):
            raise ValueError(f"quantization policy: scale_dtype={self.scale_dtype!r}; expected one of {', '.join(SCALE_DTYPES)}")

    @property
    def embed_params(self) -> QuantParams:
        """What the embeddings and the untied head take."""
        bits = self.bits if self.embed_bits is None else self.embed_bits
        group = self.group_size if self.embed_group_size is None else self.embed_group_size
        return QuantParams(bits, group, self.mode)

    @property
    def default(self) -> QuantParams:
        return QuantParams(self.bits, self.group_size, self.mode)

    def decide(self, path: str, module: nn.Module) -> tuple[QuantParams | None, str]:
        """``(params, kind)``, or ``(None, reason)`` for a layer kept in full precision."""
        parts = path.split(".")
        if any(part in _VISION_PARTS for part in parts) and not self.quantize_vision:
            return None, "vision tower / embedder (kept in full precision by the policy)"
        if path.endswith("router.proj"):
            if self.router is None:
                return None, "MoE router (kept in full precision by the policy)"
            params, kind = self.router, "router"
        elif isinstance(module, nn.Embedding) or parts[-1] == "lm_head":
            params, kind = self.embed_params, "embedding"
        elif isinstance(module, SwitchLinear):
            params, kind = self.default, "experts"
        else:
            params, kind = self.default, "linear"
        in_dims = module.weight.shape[-1]
        if in_dims < params.group_size:
            return None, f"input dim {in_dims} is smaller than one group of {params.group_size}"
        if in_dims % params.group_size:
            return None, f"input dim {in_dims} is not a multiple of the group size {params.group_size}"
        return params, kind


@dataclass
class QuantizationReport:
    """What ``quantize_model`` did: ``quantized`` ``{path: (params, kind)}``, ``kept`` ``{path: reason}``."""

    policy: QuantizationPolicy
    quantized: dict[str, tuple[QuantParams, str]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


def quantize_model(model: nn.Module, policy: QuantizationPolicy) -> QuantizationReport:
    """Quantize a loaded full-precision graph in place under ``policy``.

    Scales and biases take the policy's ``scale_dtype``, else each weight's dtype (bf16 weights give
    bf16 scales). Refuses a graph that already holds quantized layers.
    """
    report = QuantizationReport(policy)
    for path, module in _leaf_modules(model):
        if isinstance(module, _QUANTIZED_TYPES):
            raise QuantizationError(f"quantize on load: {path} is already quantized ({module.bits}-bit); the checkpoint is pre-quantized")
        if not hasattr(module, "to_quantized"):
            continue
        params, kind_or_reason = policy.decide(path, module)
        if params is None:
            logger.debug("quantization: keeping %s in full precision: %s", path, kind_or_reason)
            report.kept[path] = kind_or_reason
        else:
            report.quantized[path] = (params, kind_or_reason)
    plan = {path: params for path, (params, _) in report.quantized.items()}
    nn.quantize(model, class_predicate=lambda path, _: plan[path].kwargs() if path in plan else False)
    if policy.scale_dtype is not None:
        dtype = getattr(mx, policy.scale_dtype)
        for path, module in _leaf_modules(model):
            if path in plan:
                module.scales = module.scales.astype(dtype)
                if "biases" in module:
                    module.biases = module.biases.astype(dtype)
    return report


# ---------------------------------------------------------------------------------------- describing a graph
def quantized_modules(model: nn.Module) -> dict[str, QuantParams]:
    """``{module path: params}`` of every quantized layer of ``model``."""
    return {
        path: QuantParams(module.bits, module.group_size, getattr(module, "mode", AFFINE))
        for path, module in _leaf_modules(model)
        if isinstance(module, _QUANTIZED_TYPES)
    }



# ---------------------------------------------------------------------------------------- the loaders' entry
def plan_load(
    config: Mapping[str, Any],
    weights: Mapping[str, mx.array],
    source: str,
    q_bits: int | None = None,
    q_group_size: int | None = None,
    q_policy: QuantizationPolicy | None = None,
) -> QuantizationPolicy | None:
    """What a loader does about quantization, decided before the graph is built.

    A pre-quantized checkpoint is checked against its ``quantization`` entry (errors name the key)
    and loads as stored. ``q_bits`` / ``q_group_size`` (or a whole ``q_policy``) ask for
    quantization on load: the returned policy, for ``quantize_model`` once the full-precision
    weights are in. Asking for it on a checkpoint that is already quantized is an error.
    """
    stored = read_quantization(config, source)
    check_checkpoint(weights, stored, source)
    requested = load_options(q_bits, q_group_size)
    if q_policy is not None:
        if requested is not None:
            raise QuantizationError("give either q_bits/q_group_size or q_policy, not both")
        requested = q_policy.default
    if requested is None:
        return None
    if stored is not None:
        raise QuantizationError(
            f"{source}: the checkpoint is already quantized ({stored.default}); quantization on load "
            "(q_bits) needs full-precision weights"
        )
    return q_policy or QuantizationPolicy(requested.bits, requested.group_size)
