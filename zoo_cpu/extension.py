"""The zoo's C++ extension (``zoo_cpu._packed``, sources in ``zoo_cpu/src``), loaded once or refused with the reason.

``setup.py`` builds it on Linux x86-64 against the MLX of the build environment and records that
MLX's version (and why, when it could not build) in ``_build.json`` beside it. The extension calls
into ``libmlx.so``, whose C++ ABI changes between MLX releases, so it is loaded only where it was
built for the MLX that is installed now; anywhere else ``status()`` says why and how to rebuild,
and the zoo runs MLX's own ops (``docs/speed.md``, README "MLX versions").
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

BUILD_FILE = Path(__file__).with_name("_build.json")  # written by setup.py's build step
MODULE = "zoo_cpu._packed"
REBUILD = (
    "rebuild it for this MLX with `pip install --no-build-isolation --no-deps --force-reinstall -e .` "
    "in the checkout (nanobind==3.1.0 and cmake installed; `.` instead of `-e .` for a plain install)"
)


@dataclass(frozen=True)
class Status:
    """Whether the extension runs in this process: ``module`` (None when not) and ``note``."""

    module: object | None
    note: str

    @property
    def available(self) -> bool:
        return self.module is not None


_status: Status | None = None


def status() -> Status:
    """The extension, loaded once, or why it cannot run here."""
    global _status
    if _status is None:
        _status = _load()
    return _status


def _load() -> Status:
    if sys.platform == "darwin":
        return Status(None, "not built on macOS (MLX uses Metal and Accelerate there)")  # pragma: no cover - macOS only
    if mx.metal.is_available() or mx.cuda.is_available():
        return Status(None, "MLX's GPU build is installed: the zoo's CPU kernels are for MLX's CPU build")  # pragma: no cover - MLX's Metal or CUDA build only
    if not BUILD_FILE.is_file():
        return Status(None, f"not built ({BUILD_FILE.name} is missing: reinstall with `pip install -e .`)")
    info = json.loads(BUILD_FILE.read_text(encoding="utf-8"))
    if not info.get("built"):
        return Status(None, f"not built at install time: {info.get('reason', 'no reason recorded')}")
    if info.get("mlx") != mx.__version__:
        return Status(None, f"built for MLX {info.get('mlx')}, but MLX {mx.__version__} is installed, so it is not loaded; {REBUILD}")
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        return Status(None, f"the built extension does not load ({e}); {REBUILD}")
    isas = module.available_isas()
    return Status(module, f"{isas[0]}, {module.threads()} threads (MLX {module.built_for_mlx()})")


def available() -> bool:
    """Whether the extension runs in this process."""
    return status().available


def module():
    """The loaded extension; ``RuntimeError`` naming why when it does not run here."""
    s = status()
    if not s.available:
        raise RuntimeError(f"the zoo's CPU kernels are unavailable: {s.note}")
    return s.module


def describe() -> str:
    """One line for ``--verbose``: whether the kernels run on this CPU, and why not."""
    s = status()
    return f"C++ kernels: {s.note}" if s.available else f"C++ kernels off: {s.note}"
