"""The C++ extension's prefill kernels (``kernels.prefill``) in the zoo's graphs.

- ``install()``: ``cache`` imports nothing of the project, so it cannot reach the extension itself;
  ``models`` may import both, and installs the attention, GeGLU gate, RoPE and RMSNorm kernels and
  the decode kernels (``kernels.decode``) into ``cache.cpu_math`` once, when the package is
  imported, before any graph runs.
- ``apply(graph)``: a loaded graph's float32 ``nn.Linear`` layers (not the output head) become
  ``kernels.prefill.Linear``: the same parameters, whose products of many rows (a prefill's
  projections) take the extension's GEMM (``models.precision.prepare`` calls it).

Where the extension is not built (macOS, MLX's GPU build, no compiler at install time), nothing
is installed or replaced and ``cache`` keeps its compiled MLX chains; the note says which runs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from cache import cpu_math
from graphs.speedups import VocabularyHead
from kernels import decode, prefill


def install() -> None:
    """Put ``kernels.prefill`` and ``kernels.decode`` under ``cache.cpu_math`` when the extension runs here."""
    cpu_math.install(*((prefill, decode) if prefill.available() else (None, None)))


def apply(graph: nn.Module) -> list[str]:
    """``kernels.prefill.Linear`` in place of ``graph``'s float32 ``nn.Linear`` layers but the output
    head; the notes saying what runs (the prefill kernels' line and the decode kernels' line, each
    left out off the CPU or with its switch off)."""
    decoding = [
        f"decode kernels: RMSNorm (+ residual), attention heads, single-query attention, GeGLU gate one graph node "
        f"each ({decode.SWITCH}=0: MLX's ops)"
    ] if decode.on() else []  # fmt: skip
    if not prefill.on():
        if prefill.available() or not cpu_math.active():
            return decoding
        return [f"prefill kernels off: the C++ extension is not built ({prefill.status().note})"]
    heads = {id(m.head_module()) for _, m in graph.named_modules() if isinstance(m, VocabularyHead)}
    leaves = tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module)
    layers = [
        (path, m) for path, m in leaves
        if type(m) is nn.Linear and id(m) not in heads and m.weight.dtype == mx.float32 and m.weight.ndim == 2
    ]  # fmt: skip
    graph.update_modules(tree_unflatten([(path, prefill.Linear.of(m)) for path, m in layers]))
    return [
        f"prefill kernels on both cores: attention, GeGLU gate, RoPE, RMSNorm, {len(layers)} projections of more than "
        f"{prefill.LINEAR_MIN_ROWS} rows ({prefill.SWITCH}=0: MLX's ops)",
        *decoding,
    ]

