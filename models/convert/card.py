"""The ``README.md`` model card of a converted folder: provenance, what was quantized and how, what
stayed in full precision, the MLX peers' compatibility notes, and how to load it."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import mlx.nn as nn
from mlx.utils import tree_flatten

from weights.layouts import Layout
from weights.quantize import CheckpointQuantization, quantized_modules

from models.convert.folder import CARD_MARKER


def model_card(source: str, raw: Mapping[str, Any], graph: nn.Module, layout: Layout, result,
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
