"""The C++ extension's prefill GEMM (``zoo_cpu.prefill``) in a loaded graph's projections.

``apply(graph, chosen)``: where the chosen backend runs the prefill kernels, a loaded graph's
float32 ``nn.Linear`` layers (not the output head) become ``zoo_cpu.prefill.Linear``: the same
parameters, whose products of several rows (a prefill, a batch's decode step) take the extension's GEMM
(``models.precision.prepare`` calls it). Elsewhere (macOS, MLX's GPU build, no compiler at install
time, the switches off) the graph is left as built.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from graphs.speedups import VocabularyHead
from zoo_cpu import prefill
from zoo_cpu.backend import Backend


def apply(graph: nn.Module, chosen: Backend) -> list[str]:
    """``zoo_cpu.prefill.Linear`` in place of ``graph``'s float32 ``nn.Linear`` layers but the output
    head, where ``chosen`` runs the prefill kernels; the note saying how many."""
    if not chosen.prefill:
        return []
    heads = {id(m.head_module()) for _, m in graph.named_modules() if isinstance(m, VocabularyHead)}
    leaves = tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module)
    layers = [
        (path, m) for path, m in leaves
        if type(m) is nn.Linear and id(m) not in heads and m.weight.dtype == mx.float32 and m.weight.ndim == 2
    ]  # fmt: skip
    graph.update_modules(tree_unflatten([(path, prefill.Linear.of(m)) for path, m in layers]))
    return [f"projections on the extension: {len(layers)} (up to 8 rows as dot products, more as a GEMM)"]
