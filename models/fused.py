"""Compiled decode-step pieces: the per-head RMSNorm and RoPE of queries and keys, fused by ``mx.compile``.

On the CPU, ``mx.fast.rms_norm`` and ``mx.fast.rope`` have no kernel of their own: each call
expands into a dozen small MLX ops (squares, sums, rsqrt, broadcasts; and for RoPE the positions,
the cos/sin of every frequency, the rotation and the concatenation). A Gemma 3 270M decode step
has ~3,600 graph nodes, a third of them from these two calls on q and k, and on a 2-core CPU each
node costs a few microseconds of scheduling. ``norm_rope`` runs the same ops through one compiled
function per (shape, dtype, RoPE kind): MLX fuses the element-wise chains into generated C++
kernels (compiled once by the system C++ compiler and cached in ``$TMPDIR/mlx``; without a
compiler MLX runs the traced ops unfused, so results never depend on it).

Measured on the 2-core box with the real 270M (``docs/speed.md``): decode 20.8 -> 24 tok/s;
compiling the rest of the layer (o_proj, norms, MLP, residuals) bought nothing more, and
compiling prefill chunks bought nothing (their time is in the matmuls), so only single-position
calls (decode) take this path. The weights are arguments, not captured constants, so a model whose
weights change after a first call stays correct. ``GEMMA_ZOO_COMPILE=0`` turns the path off.
"""

from __future__ import annotations

import os

import zoo_blas  # noqa: F401  (before mlx)

import mlx.core as mx

from cache import cpu_math

ENV = "GEMMA_ZOO_COMPILE"
STREAMS_ENV = "GEMMA_ZOO_STREAMS"


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def streams_enabled() -> bool:
    """Few-row products split across CPU streams (``GEMMA_ZOO_STREAMS=0`` turns it off)."""
    return os.environ.get(STREAMS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _norm(x: mx.array, weight: mx.array | None, eps: float, plus_one: bool) -> mx.array:
    """Gemma's RMSNorm exactly as the graphs compute it: in float32, rounded once to ``x``'s dtype."""
    if weight is not None:
        weight = weight.astype(mx.float32)
        if plus_one:
            weight = 1.0 + weight
    return mx.fast.rms_norm(x.astype(mx.float32), weight, eps).astype(x.dtype)


def _norm_rope(x, weight, offset, freqs, eps, plus_one, dims, base):
    y = _norm(x, weight, eps, plus_one)
    return mx.fast.rope(y, dims, traditional=False, base=base, scale=1.0, offset=offset, freqs=freqs)


def _norm_rotate(x, weight, cos, sin, eps, plus_one):
    return cpu_math.rotate_half(_norm(x, weight, eps, plus_one), cos, sin)


_compiled = mx.compile(_norm_rope)
_compiled_cpu = mx.compile(_norm_rotate)


def norm_rope(x: mx.array, norm, rope, offset: int, plus_one: bool) -> mx.array:
    """``rope(norm(x), offset)`` for ``x [B, heads, L, D]``; compiled for single positions.

    ``norm`` is a Gemma RMSNorm module (``weight`` and ``eps``; Gemma 2/3 scale by ``1 + weight``:
    ``plus_one``), ``rope`` a ``graphs.layers.RoPE``: on the CPU it rotates by its cos/sin tables,
    elsewhere through ``mx.fast.rope``. Other shapes, or ``GEMMA_ZOO_COMPILE=0``, call the modules
    as they are.
    """
    if x.shape[-2] != 1 or not enabled():
        return rope(norm(x), offset)
    weight = norm.get("weight") if hasattr(norm, "get") else None
    if cpu_math.active():
        return _compiled_cpu(x, weight, *rope.tables(offset, 1), norm.eps, plus_one)
    return _compiled(x, weight, mx.array(offset, dtype=mx.int32), rope._periods, norm.eps, plus_one, rope.head_dim, rope._base)


# ---------------------------------------------------------------------------------------- the output head
# A decode step on the CPU runs on one MLX stream, one core; the BLAS runs a matrix-vector product
# on one thread, and one core reads ~25 GB/s where two read ~50 (2-core box). The head (the tied
# 262,144-row embedding, 63% of a 270M's bytes per token) is therefore split in two halves along
# the hidden axis, each a contiguous block of the head's [H, V] storage, multiplied on its own CPU
# stream and summed: measured 26 -> 14 ms per token for the 270M head.
HEAD_SPLIT_MAX_ROWS = 8  # wider products (a prefill's full logits) are GEMMs the BLAS threads itself

_streams: list = []


def cpu_streams(n: int) -> list:
    """``n`` CPU streams: the default one and ``n - 1`` more, made once per process."""
    while len(_streams) < n - 1:
        _streams.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_streams[: n - 1]]


class HeadBlocks:
    """Row blocks of the head's transposed ``[H, V]`` storage (evaluated views, no copy), and the
    ``[V, H]`` weight array they were cut from (a replaced weight makes them stale: not used)."""

    def __init__(self, weight: mx.array, transposed: mx.array, parts: int = 2):
        H = transposed.shape[0]
        bounds = [round(i * H / parts) for i in range(parts + 1)]
        self.weight = weight
        self.blocks = [(a, b, transposed[a:b]) for a, b in zip(bounds, bounds[1:])]
        mx.eval([w for _, _, w in self.blocks])


def head_product(owner, h: mx.array) -> mx.array:
    """``h @ W.T`` for the head of ``owner`` (``lm_head`` or the tied ``embed_tokens``), split across
    CPU streams when ``models.precision`` prepared ``owner._head_blocks`` and ``h`` is a few rows."""
    module = owner["lm_head"] if "lm_head" in owner else owner["embed_tokens"]
    blocks = getattr(owner, "_head_blocks", None)
    rows = h.size // h.shape[-1]
    if blocks is None or rows > HEAD_SPLIT_MAX_ROWS or module.get("weight") is not blocks.weight or not streams_enabled():
        return module(h) if "lm_head" in owner else module.as_linear(h)
    parts = []
    for stream, (a, b, w) in zip(cpu_streams(len(blocks.blocks)), blocks.blocks):
        with mx.stream(stream):
            parts.append(h[..., a:b] @ w)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    if "bias" in module:
        out = out + module.bias
    return out


# ---------------------------------------------------------------------------------------- the MLP
_parallel_mlp_class = None


def parallel_mlp(mlp) -> None:
    """Let a ``graphs.layers.GeGLUMLP`` use both cores in decode: for a few rows its gate and up
    projections run on two CPU streams (each core streams one weight). Wider inputs (prefill) are
    GEMMs the BLAS threads itself. Same parameters, same ops and results; only the class of this
    one instance changes (to a subclass made here on first use: ``graphs`` imports this module, so
    not at import)."""
    global _parallel_mlp_class
    from graphs.layers import GeGLUMLP, gelu_gated

    if _parallel_mlp_class is None:

        class ParallelGeGLUMLP(GeGLUMLP):
            def __call__(self, x: mx.array) -> mx.array:
                if not streams_enabled() or x.size // x.shape[-1] > HEAD_SPLIT_MAX_ROWS:
                    return super().__call__(x)
                with mx.stream(cpu_streams(2)[1]):
                    up = self.up_proj(x)
                gate = self.gate_proj(x)
                return self.down_proj(gelu_gated(up, gate))

        _parallel_mlp_class = ParallelGeGLUMLP
    if type(mlp) is GeGLUMLP:
        mlp.__class__ = _parallel_mlp_class
