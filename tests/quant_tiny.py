"""Helpers of the quantized-weights tests: tiny checkpoints, the quantize-dequantize reference, KL / top-1.

The reference for a quantized graph is the same full-precision graph with every weight that the
quantized graph holds packed replaced by ``dequantize(quantize(w))`` at that module's own bits and
group size: the two must agree to float rounding (the only difference is the quantized kernel's
accumulation order). Any wrong module choice, bit width, group size, scale layout or key mapping
shows as a gross difference. Import only from tests that have done ``pytest.importorskip("torch")``.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from weights.quantize import quantized_modules


def leaves(graph: nn.Module) -> dict[str, nn.Module]:
    return dict(tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module))


def qdq_reference(dense_graph: nn.Module, quantized_graph: nn.Module) -> nn.Module:
    """``dense_graph`` with each weight the quantized graph packs replaced by its quantize-dequantize round trip."""
    modules = leaves(dense_graph)
    for path, params in quantized_modules(quantized_graph).items():
        module = modules[path]
        packed = mx.quantize(module.weight, params.group_size, params.bits, mode=params.mode)
        module.weight = mx.dequantize(*packed, group_size=params.group_size, bits=params.bits, mode=params.mode)
    return dense_graph


def max_relative_difference(got: mx.array, want: mx.array) -> float:
    """``max |got - want| / max |want|``: float rounding is about 1e-6 to 1e-5 of the logit scale
    (the quantized kernel and the dense BLAS product accumulate in different orders)."""
    return float(mx.abs(got - want).max() / mx.abs(want).max())


def log_softmax(logits) -> np.ndarray:
    """The float64 log-softmax over the last axis of MLX or numpy logits: a reference's precision
    (MLX's float32 ``logsumexp`` over a 262,144-word row is off by up to ~1e-5, more for a peaked one)."""
    x = np.array(logits.astype(mx.float32) if isinstance(logits, mx.array) else logits, dtype=np.float64)
    top = x.max(-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(-1, keepdims=True)))


def kl_and_top1(reference_logits: mx.array, logits: mx.array) -> tuple[float, float, float]:
    """(mean KL(reference || quantized) in nats, max KL, top-1 agreement) over every position."""
    p_log, q_log = log_softmax(reference_logits).reshape(-1, reference_logits.shape[-1]), log_softmax(logits).reshape(-1, logits.shape[-1])
    kl = (np.exp(p_log) * (p_log - q_log)).sum(-1)
    top1 = float((p_log.argmax(-1) == q_log.argmax(-1)).mean())
    return float(kl.mean()), float(kl.max()), top1


def token_ids(seed: int, length: int, vocab: int) -> list[list[int]]:
    return [[2] + np.random.default_rng(seed).integers(3, vocab, length - 1).tolist()]


def write_side_files(folder: Path) -> dict[str, bytes]:
    """Stand-in tokenizer and template files (the tiny checkpoints have none), to check they are copied."""
    files = {
        "tokenizer.json": b'{"version": "1.0", "note": "stand-in"}',
        "tokenizer_config.json": b'{"chat_template": null}',
        "chat_template.jinja": b"{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "NOTICE.md": b"notice",
    }
    for name, data in files.items():
        (Path(folder) / name).write_bytes(data)
    return files
