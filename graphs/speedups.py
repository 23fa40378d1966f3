"""CPU speed-up parts the graphs are built with; ``models.precision``'s plan switches them on.

Each part computes exactly what the plain layer computes (same ops, same numbers up to summation
order) and only changes where or how the work runs:

- ``norm_rope``: the per-head RMSNorm + RoPE of a single decode position through one compiled
  function (``mx.compile`` fuses a dozen small element-wise ops that the CPU would otherwise
  schedule one by one). ``GEMMA_ZOO_COMPILE=0`` calls the modules as they are.
- ``VocabularyHead``: the output head ``h @ W.T`` (``lm_head`` or the tied ``embed_tokens``); after
  ``split_head`` its weight is stored as a view of the contiguous transpose; one row (a decode step)
  runs as row blocks on separate CPU streams, one core each, summed; ``HEAD_KERNEL_ROWS`` rows (a
  speculative verify block, a batch's decode step) through the extension's few-row kernel on that
  transpose (``zoo_cpu.prefill.linear``), which reads the weight once where the BLAS's GEMM packs
  all of it first.
- ``GeGLUMLP.use_streams`` (``graphs.layers``): the gate and up products of a few rows on two streams.

Products of more than ``FEW_ROWS`` rows (prefill) are GEMMs the BLAS threads itself: unsplit.
``docs/speed.md`` has the measurements behind each part.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from zoo_cpu import backend, fast_math, prefill, switches

FEW_ROWS = 8  # products with more rows than this are left to the BLAS's own threads
# Rows of a head product that take the few-row kernel where the prefill kernels run: from 2 to 32
# rows it beat the BLAS's product with the transposed head (1.3x at 2 rows, 3-5x at 4 to 8, 1.1x at
# 32 on the 270M's head: docs/speed.md, "The output head").
HEAD_KERNEL_ROWS = (2, 32)

_streams: list = []


def cpu_streams(n: int) -> list:
    """``n`` CPU streams: the default one and ``n - 1`` more, made once per process. They are
    thread-local (MLX streams belong to the thread that made them), so a model loaded on one thread
    can run on another, as a server's generation thread does."""
    while len(_streams) < n - 1:
        _streams.append(mx.new_thread_local_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_streams[: n - 1]]


def few_rows(x: mx.array) -> bool:
    return x.size // x.shape[-1] <= FEW_ROWS


# ---------------------------------------------------------------------------------------- q/k norm + RoPE
def _norm(x: mx.array, weight: mx.array | None, eps: float, plus_one: bool) -> mx.array:
    """Gemma's RMSNorm exactly as the graphs compute it: in float32, rounded once to ``x``'s dtype."""
    if weight is not None:
        weight = weight.astype(mx.float32)
    return fast_math.rms_norm(x, weight, eps, shift=1.0 if plus_one and weight is not None else 0.0)


def _norm_rope(x, weight, offset, freqs, eps, plus_one, dims, base):
    y = _norm(x, weight, eps, plus_one)
    return mx.fast.rope(y, dims, traditional=False, base=base, scale=1.0, offset=offset, freqs=freqs)


def _norm_rotate(x, weight, cos, sin, eps, plus_one):
    return fast_math.rotate_half(_norm(x, weight, eps, plus_one), cos, sin)


# mx.compile keeps one trace per input shape and dtype, not per backend, and a trace calls the
# kernels that were active when it was made; so each backend gets its own compiled function, made
# from its own wrapper (MLX keys its traces by the Python callable, so two compilations of one
# function would share them).
_compiled_by_backend: dict = {}


def _compiled(fn):
    """``fn`` compiled for the active backend (``zoo_cpu.backend``)."""
    key = (fn, backend.active())
    if key not in _compiled_by_backend:
        _compiled_by_backend[key] = mx.compile(functools.partial(fn))
    return _compiled_by_backend[key]


def norm_rope(x: mx.array, norm, rope, offset: int | tuple[int, ...], plus_one: bool) -> mx.array:
    """``rope(norm(x), offset)`` for ``x [B, heads, L, D]``; compiled for single positions.

    ``norm`` is a Gemma RMSNorm module (``weight`` and ``eps``; Gemma 2/3 scale by ``1 + weight``:
    ``plus_one``), ``rope`` a ``graphs.layers.RoPE``. The weights are arguments, not captured
    constants, so replacing them after a first call stays correct.
    """
    if x.shape[-2] != 1 or not switches.enabled("GEMMA_ZOO_COMPILE"):
        return rope(norm(x), offset)
    weight = norm.get("weight") if hasattr(norm, "get") else None
    if fast_math.active():
        return _compiled(_norm_rotate)(x, weight, *rope.tables(offset, 1), norm.eps, plus_one)
    return _compiled(_norm_rope)(
        x, weight, mx.array(offset, dtype=mx.int32), rope.periods, norm.eps, plus_one, rope.head_dim, rope.base
    )  # fmt: skip


# ---------------------------------------------------------------------------------------- the output head
class HeadBlocks:
    """The head's contiguous transposed ``[H, V]`` storage, its row blocks for ``parts`` > 1 CPU streams
    (evaluated views, no copy), and the ``[V, H]`` weight they were cut from (a replaced weight makes
    them stale: then unused)."""

    def __init__(self, weight: mx.array, transposed: mx.array, parts: int):
        H = transposed.shape[0]
        bounds = [round(i * H / parts) for i in range(parts + 1)]
        self.weight, self.transposed = weight, transposed
        self.blocks = [(a, b, transposed[a:b]) for a, b in zip(bounds, bounds[1:])] if parts > 1 else []
        mx.eval([w for _, _, w in self.blocks])


class VocabularyHead:
    """Mixin for graphs whose logits are ``h @ W.T``, ``W`` the ``lm_head`` or the tied ``embed_tokens``."""

    head_blocks: HeadBlocks | None = None

    def head_module(self) -> nn.Module:
        return self["lm_head"] if "lm_head" in self else self["embed_tokens"]

    def split_head(self, parts: int) -> str | None:
        """Store the head's ``[V, H]`` weight as a view of its contiguous ``[H, V]`` transpose (and
        with ``parts`` > 1 cut it into row blocks) for ``head_product``; what was done, or None when
        the head is quantized or not float32 (left as it is)."""
        module = self.head_module()
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or "weight" not in module:
            return None
        weight = module.weight
        if weight.dtype != mx.float32 or weight.ndim != 2:
            return None
        transposed = mx.contiguous(weight.T)
        mx.eval(transposed)
        module.weight = transposed.T  # the same values, a strided view: lookups and saving are unchanged
        self.head_blocks = HeadBlocks(module.weight, transposed, parts)
        name = "lm_head" if "lm_head" in self else "tied embed_tokens"
        where = f", split across {parts} CPU streams" if parts > 1 else ""
        return f"output head ({name}, {weight.shape[0]}x{weight.shape[1]}) stored transposed{where}"

    def head_product(self, h: mx.array) -> mx.array:
        """``h @ W.T`` (plus the head's bias) on the transposed storage: ``HEAD_KERNEL_ROWS`` rows
        through the few-row kernel where the backend runs the prefill kernels, one row in row blocks
        on CPU streams when split; anything else as the module computes it."""
        module = self.head_module()
        blocks = self.head_blocks
        if blocks is None or module.get("weight") is not blocks.weight:
            return module(h) if "lm_head" in self else module.as_linear(h)
        rows = h.size // h.shape[-1]
        if HEAD_KERNEL_ROWS[0] <= rows <= HEAD_KERNEL_ROWS[1] and h.dtype == mx.float32 and backend.active().prefill:
            out = prefill.linear(h, blocks.transposed, transposed=True)
        elif blocks.blocks and few_rows(h):
            parts = []
            for stream, (a, b, w) in zip(cpu_streams(len(blocks.blocks)), blocks.blocks):
                with mx.stream(stream):
                    parts.append(h[..., a:b] @ w)
            out = parts[0]
            for p in parts[1:]:
                out = out + p
        else:
            return module(h) if "lm_head" in self else module.as_linear(h)
        if "bias" in module:
            out = out + module.bias
        return out
