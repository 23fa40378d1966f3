"""Loading mapped arrays into an MLX module: the last step every key mapping ends with.

The key mappings (``weights.*_keys``) take the receiving graph's parameter shapes and return
``{parameter name: array}``; this module reads those shapes and loads the result strictly, turning
modules whose arrays arrive packed (``.scales``/``.biases``) into quantized ones first.
"""

from __future__ import annotations

from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from weights.quantize import prepare_quantized


def parameter_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of ``module``: the ``expected`` argument of every key mapping."""
    return {name: tuple(array.shape) for name, array in tree_flatten(module.parameters())}


def load_mapped(module: nn.Module, mapped: Mapping[str, mx.array], owner: str) -> None:
    """Load ``mapped`` into ``module`` strictly (every parameter, nothing else); ``owner`` names the mapping in errors."""
    prepare_quantized(module, dict(mapped), owner)
    module.load_weights(list(mapped.items()), strict=True)
