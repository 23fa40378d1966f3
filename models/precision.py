"""The device plan a model is loaded under, and the compute-precision policy within it.

``DevicePlan`` (``choose_plan``) is the one place that asks which device MLX computes on: ``"cpu"``
on MLX's CPU device, ``"accelerator"`` elsewhere (Metal, CUDA), unless ``models.load(plan=...)``,
``--plan`` or ``GEMMA_ZOO_PLAN`` says otherwise. Everything that differs between the two follows
from that value: the weights' dtype (``choose``), which CPU math and kernels run
(``zoo_cpu.backend``), the layouts ``prepare`` applies, and whether generation queues the next step
before reading a token. The accelerator plan runs on MLX's CPU device too (MLX's fused ops have CPU
implementations), which is how the tests prove the path Metal and CUDA take without one.

``models.load(..., dtype="auto")`` (the default) asks ``choose()``:

- **the accelerator plan** (Metal, CUDA): the checkpoint's dtype (bf16 stays bf16).
- **CPU with a fast BLAS** (``zoo_cpu.blas``: MKL or OpenBLAS on Linux, Accelerate on macOS): float32.
  MLX's CPU matmuls reach the BLAS only in float32 (one ``cblas_sgemm`` per product); bf16 and
  fp16 products run MLX's own loops, several times slower, so a bf16 checkpoint is upcast on load
  (``docs/speed.md`` has the measurements).
- **CPU with MLX's bundled reference BLAS** (``GEMMA_ZOO_BLAS=off``, or no fast BLAS installed):
  the checkpoint's dtype. There the reference sgemm is slower than MLX's bf16 loops.

Upcasting doubles what the float weights take, so tables the model only *gathers rows from*
(Gemma 4's per-layer embeddings, most of E2B's parameters) keep the checkpoint's dtype: their
rows are cast as they are read. And when the upcast model would not fit in half of the machine's
memory, the checkpoint's dtype is kept and the reason stated. Quantized weights (integer tensors)
are left to ``apply_quantized_policy`` (on the CPU: the packed kernels, else dequantized to float32).

An explicit ``dtype`` ("float32", "bfloat16", "float16") casts every float weight, as before;
``dtype=None`` keeps the checkpoint's dtypes untouched.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Mapping

import zoo_cpu  # noqa: F401  (before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from graphs.layers import FusedProducts, GeGLUMLP, SelfAttention
from graphs.speedups import VocabularyHead
from models import cpu_kernels
from zoo_cpu import backend, extension, packed, switches
from zoo_cpu.backend import Backend

AUTO = "auto"
# Parameters only ever gathered from (never a matmul operand): kept in the checkpoint's dtype.
GATHER_ONLY = ("embed_tokens_per_layer",)
# Upcast only when the upcast weights take at most this share of physical memory.
MEMORY_SHARE = 0.5


@dataclass(frozen=True)
class Precision:
    """What ``load`` does with float weights: cast to ``dtype`` (None: keep), except ``keep``."""

    dtype: mx.Dtype | None
    reason: str
    keep: tuple[str, ...] = field(default=())
    auto: bool = False  # chosen by the policy (``dtype="auto"``), not asked for

    def describe(self) -> str:
        """One line for ``--verbose``."""
        name = "checkpoint dtype" if self.dtype is None else str(self.dtype).removeprefix("mlx.core.")
        return f"precision: {name} ({self.reason})"


def fast_cpu_blas() -> bool:
    """True where MLX's float32 CPU matmuls go through a fast BLAS."""
    if sys.platform == "darwin":
        return True  # pragma: no cover - macOS only: Accelerate
    return bool(zoo_cpu.blas.info()["loaded"])


PLAN_SWITCH = "GEMMA_ZOO_PLAN"
PLANS = ("cpu", "accelerator")


@dataclass(frozen=True)
class DevicePlan:
    """How a loaded model computes, chosen once at load.

    ``"cpu"``: float weights in float32 where a fast BLAS runs them (``choose``); the zoo's CPU
    backend (vectorised math, the C++ kernels where built: ``zoo_cpu.backend.for_cpu``); CPU
    layouts applied at load (packed quantized layers, the output head and MLPs over CPU streams,
    the prefill GEMM's layers); each generated token read before the next step is built.
    ``"accelerator"``: what Metal and CUDA run: the checkpoint's dtype, MLX's fused attention,
    norms and RoPE (``zoo_cpu.backend.MLX``), the graph as built, the next step queued before the
    token is read (mlx-lm's overlap).
    """

    name: str
    reason: str
    backend: Backend

    @property
    def cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def overlap(self) -> bool:
        """Whether generation queues the next step before reading the token (on 2 CPU cores the
        host's graph building competes with the compute, so the CPU plan reads first)."""
        return not self.cpu

    def describe(self) -> str:
        """One line for ``--verbose``."""
        return f"plan: {self.name} ({self.reason})"


def choose_plan(plan: str | None = None) -> DevicePlan:
    """The plan ``plan`` names (``"cpu"``, ``"accelerator"``, ``"auto"``), or ``GEMMA_ZOO_PLAN``'s
    when None; ``"auto"`` picks by MLX's default device. ``ValueError`` for any other name."""
    if plan is None:
        name, reason = switches.value(PLAN_SWITCH), f"{PLAN_SWITCH}, {switches.source(PLAN_SWITCH)}"
    else:
        name, reason = plan, "asked for"
    if name == "auto":
        device = mx.default_device()
        name, reason = ("cpu" if device.type == mx.cpu else "accelerator"), f"the default device is {device}"
    if name not in PLANS:
        raise ValueError(f"plan={plan!r} is not a device plan; use one of {', '.join(PLANS)} or auto")
    return DevicePlan(name, reason, backend.for_cpu() if name == "cpu" else backend.MLX)


def choose(dtype=AUTO, weights: Mapping[str, mx.array] | None = None, plan: DevicePlan | None = None) -> Precision:
    """The precision for a model whose checkpoint tensors are ``weights`` (only sizes and dtypes
    are read), under ``plan`` (``choose_plan()`` when None)."""
    if dtype is None:
        return Precision(None, "dtype=None: the checkpoint's dtypes")
    if dtype != AUTO:
        from weights import parse_dtype

        return Precision(parse_dtype(dtype), "--dtype")
    plan = plan or choose_plan()
    if not plan.cpu:
        return Precision(None, f"{plan.name} plan: the checkpoint's dtype", auto=True)
    if not fast_cpu_blas():
        return Precision(None, "CPU without a fast BLAS: MLX's bf16 loops beat the reference sgemm", auto=True)
    if any(a.dtype == mx.uint32 for a in (weights or {}).values()):
        return Precision(None, "quantized checkpoint: its layers follow the CPU quantized policy", auto=True)
    floats = [(k, a) for k, a in (weights or {}).items() if mx.issubdtype(a.dtype, mx.floating)]
    if floats and all(a.dtype == mx.float32 for _, a in floats):
        return Precision(mx.float32, "CPU: float32 matmuls go through the BLAS; the checkpoint is float32", auto=True)
    upcast = sum(a.size * 4 for k, a in floats if not _kept(k, GATHER_ONLY))
    kept = sum(a.nbytes for k, a in floats if _kept(k, GATHER_ONLY))
    total = upcast + kept
    memory = physical_memory()
    if memory and total > MEMORY_SHARE * memory:
        return Precision(
            None,
            f"CPU: float32 would take {total / 2**30:.1f} GiB, over {MEMORY_SHARE:.0%} of "
            f"{memory / 2**30:.0f} GiB; keeping the checkpoint's dtype (slower matmuls)",
            auto=True,
        )
    return Precision(
        mx.float32,
        "CPU: bf16/fp16 weights upcast on load, float32 matmuls go through the BLAS"
        + (f"; gather-only tables ({', '.join(GATHER_ONLY)}) kept as stored" if kept else ""),
        GATHER_ONLY,
        auto=True,
    )


def cast_weights(weights: dict[str, mx.array], precision: Precision) -> dict[str, mx.array]:
    """``weights`` with float tensors cast to ``precision.dtype`` (those matching ``keep`` left alone)."""
    if precision.dtype is None:
        return weights
    return {
        k: a.astype(precision.dtype)
        if mx.issubdtype(a.dtype, mx.floating) and a.dtype != precision.dtype and not _kept(k, precision.keep)
        else a
        for k, a in weights.items()
    }


def cast_module(module: nn.Module, precision: Precision, exact: frozenset[str] = frozenset()) -> None:
    """Cast a built graph's float parameters in place (for graphs made without ``cast_weights``),
    except those matching ``precision.keep`` and the parameters named in ``exact``."""
    if precision.dtype is None:
        return

    def cast(path, a):
        if mx.issubdtype(a.dtype, mx.floating) and not _kept(path, precision.keep) and path not in exact:
            return a.astype(precision.dtype)
        return a

    module.update(tree_map_with_path(cast, module.parameters()))


# ---------------------------------------------------------------------------------------- after loading
QUANT_SWITCH = "GEMMA_ZOO_CPU_QUANT"
STREAMS_SWITCH = "GEMMA_ZOO_STREAMS"
CPU_STREAMS = 2  # decode's few-row products split over this many CPU streams


def prepare(graph: nn.Module, precision: Precision, plan: DevicePlan | None = None, encoder: bool = False) -> list[str]:
    """``plan`` (``choose_plan()`` when None) applied to a loaded graph; returns what is in effect, one line each.

    Under the CPU plan with a fast BLAS: quantized layers follow ``quantized_policy`` (the packed kernels
    where they were built, else dequantized to float32), the output head is stored transposed
    (``VocabularyHead.split_head``) and, unless ``GEMMA_ZOO_STREAMS=0``, split over CPU streams with
    every GeGLU MLP whose products are not packed (``GeGLUMLP.use_streams``; the kernels split their
    rows over the cores themselves). An ``encoder`` (a graph that only runs whole texts, EmbeddingGemma)
    has its float32 projections fused too (``fuse_products``). Under the accelerator plan, or without
    a fast BLAS, the graph is left as built. The plan's backend (``zoo_cpu.backend``) is selected for the process here.
    """
    plan = plan or choose_plan()
    backend.select(plan.backend)
    notes = [plan.describe(), *(plan.backend.describe() if plan.cpu else [])]
    if switches.enabled("GEMMA_ZOO_COMPILE"):
        notes.append("decode q/k norm + RoPE compiled (GEMMA_ZOO_COMPILE=0: as plain ops)")
    if switches.enabled("GEMMA_ZOO_COMPILE_STEP"):
        notes.append("decode steps compiled whole (GEMMA_ZOO_COMPILE_STEP=0: the graph's ops built every step)")
    if not plan.cpu or not fast_cpu_blas():
        return notes
    if precision.auto:  # an explicit dtype is the user's choice for the scales too
        note = apply_quantized_policy(graph)
        if note:
            notes.append(note)
    notes += cpu_kernels.apply(graph, plan.backend)  # float32 projections of a prefill on the extension's GEMM
    streams = CPU_STREAMS if switches.enabled(STREAMS_SWITCH) else 1
    heads = [m for _, m in graph.named_modules() if isinstance(m, VocabularyHead)]
    notes += [note for note in (head.split_head(streams) for head in heads) if note]
    note = fuse_products(graph, dense=encoder)
    if note:
        notes.append(note)
    split = 0
    for _, mlp in graph.named_modules():
        if isinstance(mlp, GeGLUMLP) and mlp.fused is None:
            own = 1 if isinstance(mlp.up_proj, packed.PackedLinear) else streams  # a second stream only competes
            mlp.use_streams(own)
            split += own > 1
    if split:
        notes.append(f"{split} MLPs: decode gate and up products on {streams} CPU streams ({STREAMS_SWITCH}=0: one)")
    mx.clear_cache()  # buffers freed by the casts, dequantization and relayout go back to the system
    return notes


def fuse_products(graph: nn.Module, dense: bool = False) -> str | None:
    """Each attention layer's query/key/value projections and each GeGLU MLP's up/gate as one
    product (``fuse()``, ``graphs.layers.FusedProducts``) where they are packed layers, and with
    ``dense`` where they are float layers too: fewer, larger products, the same numbers. Float
    layers of a decoder stay apart (fused, measured no faster than their two-stream MLPs in decode:
    docs/speed.md); an encoder's wide products gain a little (docs/embedding.md). What was fused, or None."""
    done = 0
    for _, module in graph.named_modules():
        if isinstance(module, (SelfAttention, GeGLUMLP)):
            parts = module.fusable()
            if len(parts) > 1 and (dense or isinstance(parts[0], packed.PackedLinear)) and not FusedProducts.mismatch(parts):
                module.fuse()
                done += 1
    return f"{done} fused products (attention q/k/v, MLP up/gate)" if done else None


def quantized_policy(graph: nn.Module) -> tuple[str, str]:
    """``(choice, why)`` for the quantized layers of ``graph`` on this CPU (``$GEMMA_ZOO_CPU_QUANT``).

    MLX's CPU ``quantized_matmul`` is a scalar loop. ``auto`` takes the packed kernels
    (``zoo_cpu.packed``: the 4/8-bit weights read at memory bandwidth, products equal to the dequantized
    ones up to summation order) where the extension was built; without them it dequantizes to
    float32 for the BLAS (the same products, at 4 bytes a weight) when that fits in
    ``MEMORY_SHARE`` of the machine's memory, else keeps the packed weights with float32 scales
    (small and slow). ``docs/speed.md`` has the measurements.
    """
    choice = switches.value(QUANT_SWITCH)
    if choice != "auto":
        return choice, f"{QUANT_SWITCH}={choice}"
    status = extension.status()
    if status.available:
        return "packed", f"products through the packed kernels: {status.note}"
    choice, why = _memory_rule(graph, _quantized_leaves(graph))
    return choice, f"packed 4/8-bit kernels off: {status.note}; {why}"


def _memory_rule(graph: nn.Module, leaves: list[tuple[str, nn.Module]]) -> tuple[str, str]:
    """``dequantize`` when ``leaves`` dequantized (and the float weights) fit in ``MEMORY_SHARE`` of memory, else ``fp32-scales``."""
    dense = sum(_dense_bytes(m) for _, m in leaves) + float_bytes(graph, quantized=False)
    memory = physical_memory()
    if memory and dense > MEMORY_SHARE * memory:
        return "fp32-scales", (
            f"dequantized it would take {dense / 2**30:.1f} GiB, over {MEMORY_SHARE:.0%} of {memory / 2**30:.0f} GiB"
        )
    return "dequantize", f"MLX's CPU quantized matmul is a scalar loop; float32 goes through the BLAS ({dense / 2**30:.2f} GiB)"


def apply_quantized_policy(graph: nn.Module) -> str | None:
    """Pack, dequantize or rescale the quantized layers of ``graph`` for the CPU; None when it has none."""
    leaves = _quantized_leaves(graph)
    if not leaves:
        return None
    choice, why = quantized_policy(graph)
    if choice == "as-stored":
        return f"quantized layers: as stored ({why})"
    notes, packed_layers = [], []
    if choice == "packed":
        if not extension.available():
            raise RuntimeError(f"{QUANT_SWITCH}=packed, but the packed 4/8-bit kernels are off: {extension.status().note}")
        packed_layers, leaves = _packed_layers(graph, leaves)
        scales = sorted({str(m.scales.dtype).removeprefix("mlx.core.") for _, m in packed_layers})
        notes.append(f"{len(packed_layers)} packed with {'/'.join(scales) or 'float32'} scales ({why})")
        if leaves:  # layers the kernels do not take (MoE experts, other bit widths or modes)
            if switches.value(QUANT_SWITCH) == "packed":  # asked for: every layer stays packed
                choice, why = "fp32-scales", f"{QUANT_SWITCH}=packed; no kernel for these: MLX's quantized matmul"
            else:
                choice, why = _memory_rule(graph, leaves)
    if leaves and choice == "dequantize":
        for path, module in leaves:
            _set_module(graph, path, _dequantized(module))
    # Everything else computes in float32 too (norms, embeddings, scales and biases of layers MLX's
    # quantized matmul runs: it is several times slower with bf16 scales), so activations stay
    # float32. The kernels read a packed layer's scales and biases as stored.
    kept = frozenset(f"{path}.{name}" for path, _ in packed_layers for name in ("scales", "biases"))
    cast_module(graph, Precision(mx.float32, "", GATHER_ONLY), exact=kept)
    mx.eval(graph.parameters())
    if leaves and choice == "fp32-scales":
        notes.append(f"{len(leaves)} kept packed with float32 scales ({why})")
    elif leaves:
        notes.append(f"{len(leaves)} dequantized to float32 on load ({why})")
    return "quantized layers: " + "; ".join(notes)


def _packed_layers(graph: nn.Module, leaves: list[tuple[str, nn.Module]]) -> tuple[list, list]:
    """Put ``zoo_cpu.packed.PackedLinear`` / ``PackedEmbedding`` in place of the layers the kernels take;
    ``(the packed (path, module) pairs, the leaves left)``."""
    done, left = [], []
    for path, module in leaves:
        if isinstance(module, nn.QuantizedEmbedding) and packed.unpackable(module) is None:
            done.append((path, packed.PackedEmbedding.of(module)))
        elif isinstance(module, nn.QuantizedLinear) and packed.unpackable(module) is None:
            done.append((path, packed.PackedLinear.of(module)))
        else:
            left.append((path, module))
    for path, module in done:
        _set_module(graph, path, module)
    return done, left


def _quantized_leaves(graph: nn.Module) -> list[tuple[str, nn.Module]]:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    leaves = tree_flatten(graph.leaf_modules(), is_leaf=nn.Module.is_module)
    return [(path, m) for path, m in leaves if isinstance(m, kinds)]


def _dense_weight(module: nn.Module) -> mx.array:
    """The float32 weight; half-precision scales and biases are widened first (dequantizing with
    them would round every weight to half precision)."""
    scales, biases = module.scales, module.get("biases")
    if mx.issubdtype(scales.dtype, mx.floating):
        scales = scales.astype(mx.float32)
        biases = None if biases is None else biases.astype(mx.float32)
    return mx.dequantize(
        module.weight, scales, biases, group_size=module.group_size, bits=module.bits,
        mode=getattr(module, "mode", "affine"),
    ).astype(mx.float32)


def _dense_bytes(module: nn.Module) -> int:
    *lead, words = module.weight.shape
    count = words * 32 // module.bits
    for n in lead:
        count *= n
    return 4 * count


def _dequantized(module: nn.Module) -> nn.Module:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    weight = _dense_weight(module)
    if isinstance(module, nn.QuantizedEmbedding):
        dense = nn.Embedding(1, 1)
    elif isinstance(module, QuantizedSwitchLinear):
        experts, out_dims, in_dims = weight.shape
        dense = SwitchLinear(in_dims, out_dims, experts, bias="bias" in module)
    else:
        dense = nn.Linear(1, 1, bias="bias" in module)
    dense.weight = weight
    if "bias" in module:
        dense.bias = module.bias.astype(mx.float32)
    return dense


def _set_module(root: nn.Module, path: str, module: nn.Module) -> None:
    *parents, last = path.split(".")
    node = root
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node[int(last)] = module
    else:
        setattr(node, last, module)


def float_bytes(module: nn.Module, quantized: bool = True) -> int:
    """Bytes of ``module``'s parameters (``quantized=False``: leaving out quantized layers)."""
    skip = {id(m) for _, m in _quantized_leaves(module)} if not quantized else set()
    total = 0
    for _, m in tree_flatten(module.leaf_modules(), is_leaf=nn.Module.is_module):
        if id(m) in skip:
            continue
        total += sum(a.nbytes for _, a in tree_flatten(m.parameters()))
    return total


def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _kept(name: str, keep: tuple[str, ...]) -> bool:
    return any(part in name for part in keep)
