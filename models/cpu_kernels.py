"""Installs the C++ extension's prefill kernels (``kernels.prefill``) into ``cache.cpu_math``.

``cache`` imports nothing of the project, so it cannot reach the extension itself; ``models``
may import both, and does this once when the package is imported, before any graph runs. Where
the extension is not built (macOS, MLX's GPU build, no compiler at install time), nothing is
installed and ``cache`` keeps its compiled MLX chains; ``describe()`` says which runs.
"""

from __future__ import annotations

from cache import cpu_math
from kernels import prefill


def install() -> None:
    """Put ``kernels.prefill`` under ``cache.cpu_math`` when the extension runs here."""
    cpu_math.install(prefill if prefill.available() else None)


def describe() -> str:
    """One line for ``--verbose``: whether a prefill's attention and GeGLU gate take the fused kernels."""
    if cpu_math.native() is not None:
        return f"prefill attention and GeGLU gate: fused kernels on both cores ({cpu_math.NATIVE_ENV}=0: compiled chains)"
    if not prefill.available():
        return f"prefill attention and GeGLU gate: compiled chains (the C++ extension is not built: {prefill.status().note})"
    return "prefill attention and GeGLU gate: compiled chains"
