"""Loading mapped arrays into an MLX module: the last step every key mapping ends with.

The key mappings (``weights.*_keys``) take the receiving graph's parameter shapes and return
``{parameter name: array}``; this module reads those shapes and loads the result strictly, turning
modules whose arrays arrive packed (``.scales``/``.biases``) into quantized ones first.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from weights.quantize import is_quantized_entry, prepare_quantized


def parameter_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of ``module``: the ``expected`` argument of every key mapping."""
    return {name: tuple(array.shape) for name, array in tree_flatten(module.parameters())}


def detect_prefix(owner: str, weights: Mapping[str, mx.array], prefixes: Sequence[str], marker: str, part: str) -> str:
    """The first of ``prefixes`` under which ``marker`` (a key every ``part`` has) is in ``weights``."""
    for prefix in prefixes:
        if prefix + marker in weights:
            return prefix
    looked_for = [prefix + marker for prefix in prefixes]
    raise ValueError(f"{owner}: no {part} weights in the checkpoint (looked for {looked_for}); first keys: {sorted(weights)[:5]}")


def check_entry(owner: str, key: str, name: str, value: mx.array, expected: Mapping[str, Sequence[int]], part: str = "graph") -> None:
    """Checkpoint entry ``key``, mapped to parameter ``name``, must be one of ``expected`` with its
    shape (a packed quantized weight, scales or biases passes: the strict load checks those)."""
    if is_quantized_entry(name, value, expected):
        return
    if name not in expected:
        raise ValueError(f"{owner}: unexpected key {key!r} (no parameter {name!r} in the {part})")
    want = tuple(expected[name])
    if tuple(value.shape) != want:
        raise ValueError(f"{owner}: {key!r} has shape {list(value.shape)} in the checkpoint, the {part} expects {list(want)}")


def check_complete(owner: str, mapped: Mapping[str, mx.array], expected: Mapping[str, Sequence[int]], part: str = "", prefix: str = "") -> None:
    """Every parameter of ``expected`` must be in ``mapped``; the error names the first 20 missing
    (as checkpoint keys: ``prefix`` + name)."""
    missing = sorted(set(expected) - set(mapped))
    if missing:
        shown = ", ".join(repr(prefix + name) for name in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        what = f"{part} parameters" if part else "parameters"
        raise ValueError(f"{owner}: the checkpoint lacks {len(missing)} {what}: {shown}{more}")


def load_mapped(module: nn.Module, mapped: Mapping[str, mx.array], owner: str) -> None:
    """Load ``mapped`` into ``module`` strictly (every parameter, nothing else); ``owner`` names the mapping in errors."""
    prepare_quantized(module, dict(mapped), owner)
    module.load_weights(list(mapped.items()), strict=True)
