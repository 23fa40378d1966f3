"""Which of the zoo's CPU parts compute a forward: one value, chosen at load.

``Backend`` names the three layers of ``zoo_cpu`` a graph can run on top of MLX's ops:

- ``fast_math``: ``fast_math``'s vectorised exp (softmax), tanh (GELU, softcap), RoPE by tables and
  attention in query blocks (MLX's CPU ``exp``/``tanh``/``cos`` are scalar loops);
- ``prefill``: the extension's float32 kernels for a prompt's attention, projections, GELU gate,
  RoPE and RMSNorm on both cores, and the output head's product for 2 to 32 rows;
- ``decode``: the extension's decode-step kernels (norms, attention heads, single-query attention
  and a batch's rows of them, GELU gate as one graph node each).

``for_cpu()`` is the CPU plan's choice (each on unless its ``GEMMA_ZOO_*`` switch says off, the
extension's only where it runs); ``MLX`` (all off) is the accelerator plan's. ``models.load``'s
device plan makes that choice once and ``select``s it; the graphs and caches read ``active()``, one
attribute of one value, instead of asking the device and the switches again. The selection is per
process: the model loaded last decides (either backend computes the same values; only the speed
differs). Until a model is loaded (graphs and caches used directly), ``active()`` is the backend
of the plan ``GEMMA_ZOO_PLAN`` names (``MLX`` for ``accelerator``, else ``for_cpu()``) as of its first call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from . import extension, switches

FAST_MATH, PREFILL, DECODE = "GEMMA_ZOO_FAST_MATH", "GEMMA_ZOO_PREFILL_KERNELS", "GEMMA_ZOO_DECODE_KERNELS"


@dataclass(frozen=True)
class Backend:
    """Which CPU parts run (see the module docstring); hashable, so a compiled step keys its trace on it."""

    fast_math: bool = False
    prefill: bool = False
    decode: bool = False

    def __post_init__(self):
        if (self.prefill or self.decode) and not self.fast_math:
            raise ValueError(f"{self}: the extension's kernels compute fast_math's arithmetic and need it on")
        if (self.prefill or self.decode) and not extension.available():
            raise ValueError(f"{self}: {extension.describe()}")

    @property
    def kernels(self) -> bool:
        """Whether any of the extension's kernels run (prefill or decode)."""
        return self.prefill or self.decode

    def describe(self) -> list[str]:
        """What runs, one line each, for ``--verbose``."""
        if not self.fast_math:
            return ["CPU math: MLX's own ops" + (f" ({FAST_MATH}=0)" if not switches.enabled(FAST_MATH) else "")]
        lines = [
            "CPU kernels: vectorised exp (softmax), tanh (GELU, softcap), RoPE tables, attention in query blocks "
            f"where the prefill kernels do not take it (unmasked reads: per kv head) ({FAST_MATH}=0: MLX's ops)"
        ]
        if self.prefill:
            lines.append(
                "prefill kernels on both cores: attention, GeGLU gate, RoPE, RMSNorm, projections, the output head "
                f"for 2-32 rows ({PREFILL}=0: MLX's ops)"
            )
        elif not extension.available():
            lines.append(f"prefill and decode kernels off: {extension.describe()}")
        if self.decode:
            lines.append(
                "decode kernels: RMSNorm (+ residual), attention heads, single-query attention (a batch's rows in one "
                f"call), GeGLU gate one graph node each ({DECODE}=0: MLX's ops)"
            )
        return lines


MLX = Backend()  # MLX's own ops throughout: what an accelerator runs


def for_cpu() -> Backend:
    """The CPU plan's backend under the current switches."""
    if not switches.enabled(FAST_MATH):
        return MLX
    built = extension.available()
    return Backend(True, built and switches.enabled(PREFILL), built and switches.enabled(DECODE))


_selected: Backend | None = None


def active() -> Backend:
    """The selected backend (at the first call when none was selected: ``GEMMA_ZOO_PLAN``'s, see above)."""
    global _selected
    if _selected is None:
        _selected = MLX if switches.value("GEMMA_ZOO_PLAN") == "accelerator" else for_cpu()
    return _selected


def select(backend: Backend | None) -> None:
    """Make ``backend`` the one the graphs run on (None: the default again at the next ``active()``)."""
    global _selected
    _selected = backend


@contextlib.contextmanager
def using(backend: Backend) -> Iterator[Backend]:
    """``backend`` selected inside the block, the earlier selection restored after it (tests, benchmarks)."""
    global _selected
    before = _selected
    _selected = backend
    try:
        yield backend
    finally:
        _selected = before
