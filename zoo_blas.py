"""A fast BLAS for MLX's Linux CPU build, loaded before ``mlx.core`` is first imported.

The ``mlx[cpu]`` wheel links ``libmlx.so`` against a bundled *reference* BLAS (``mlx_cpu.libs/
libblas-*.so``, a few GFLOP/s). Every float32 matmul MLX runs on the CPU is one ``cblas_sgemm``
call, resolved when ``libmlx.so`` is loaded. The dynamic linker searches the process's global
scope before a library's own dependencies, so a BLAS loaded earlier with ``RTLD_GLOBAL`` supplies
``cblas_sgemm`` (and the LAPACK routines) instead: no file of MLX is touched and nothing is rebuilt.

``preload()`` does that once per process. Every package of the zoo (``cache``, ``graphs``,
``models``, ``weights``, ``examples``) imports this module first, before anything imports MLX. It
is a top-level module, not part of a package, because a package's ``__init__`` would import MLX
(and the other packages) before the preload could run.

What is loaded (``$GEMMA_ZOO_BLAS``, read once, at the first import of a zoo package):

- ``auto`` (default): Intel oneMKL from the ``mkl`` wheel (the ``fast-cpu`` extra, installed by
  default on Linux x86-64), else the system OpenBLAS (Debian's ``libopenblas0``), else nothing;
- ``mkl`` or ``openblas``: that one, or nothing (with the reason) when it is not installed;
- ``off`` (or ``0``, ``none``): MLX's bundled BLAS, exactly as without this module;
- a path to a shared library: that library (it must export ``cblas_sgemm``).

Nothing is loaded on macOS (MLX uses Accelerate), on other CPUs than x86-64, on MLX's CUDA build,
on an MLX built without the bundled BLAS, or when ``mlx.core`` was already imported by someone
else (then it is too late; ``describe()`` says so). ``describe()`` is the line ``--verbose`` prints.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

ENV = "GEMMA_ZOO_BLAS"
OFF = ("off", "0", "none", "false", "no", "reference")

# MKL's OpenMP threads spin for 200 ms after each parallel region by default. On a 2-core box that
# spinning takes the cores from MLX's own thread between two matmuls (norms, RoPE, attention), so a
# decode step gets slower; 0 puts them to sleep at once. Applied only when the user has not set it.
MKL_DEFAULTS = {"KMP_BLOCKTIME": "0"}

_state: dict | None = None


def preload() -> dict:
    """Load the fast BLAS if this process should have one; idempotent. Returns ``info()``."""
    global _state
    if _state is None:
        _state = _preload()
    return dict(_state)


def info() -> dict:
    """``{"name", "version", "path", "loaded", "reason"}`` of the BLAS MLX's float32 matmuls use."""
    return preload()


def describe() -> str:
    """One line for ``--verbose``: which BLAS MLX's CPU matmuls go through, and why."""
    s = info()
    name = s["name"] + (f" {s['version']}" if s.get("version") else "")
    return f"BLAS: {name} ({s['reason']})"


# ---------------------------------------------------------------------------------------- internals
def _preload() -> dict:
    setting = os.environ.get(ENV, "auto").strip()
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return _none("MLX's own BLAS", f"{sys.platform}/{platform.machine()}: nothing to replace")
    build = _mlx_build()
    if build != "cpu":
        return _none("MLX's own BLAS", build)
    present = _already_mapped()
    if present:
        return {"name": present[0], "version": None, "path": present[1], "loaded": True,
                "reason": "already in the process before the zoo loaded one (LD_PRELOAD?)"}
    if setting.lower() in OFF:
        return _none("MLX's bundled reference BLAS", f"{ENV}={setting}")
    if "mlx.core" in sys.modules:
        return _none("MLX's bundled reference BLAS",
                     "mlx.core was imported before the zoo, too late to load a fast BLAS; import a zoo package first")
    candidates = _candidates(setting)
    if not candidates:
        return _none("MLX's bundled reference BLAS",
                     f"{ENV}={setting}: not installed" if setting.lower() != "auto" else
                     'no fast BLAS installed; pip install "gemma-mlx-zoo[fast-cpu]" or apt-get install libopenblas0')
    errors = []
    for name, path in candidates:
        if name == "Intel oneMKL":
            for key, value in MKL_DEFAULTS.items():
                os.environ.setdefault(key, value)
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            lib.cblas_sgemm  # noqa: B018  (the symbol MLX needs; AttributeError if absent)
        except (OSError, AttributeError) as err:
            errors.append(f"{path}: {err}")
            continue
        return {"name": name, "version": _version(name, lib), "path": str(path), "loaded": True,
                "reason": f"loaded before mlx.core; {ENV}=off turns it off"}
    return _none("MLX's bundled reference BLAS", "; ".join(errors))


def _none(name: str, reason: str) -> dict:
    return {"name": name, "version": None, "path": None, "loaded": False, "reason": reason}


def _mlx_build() -> str:
    """``"cpu"`` for the ``mlx[cpu]`` wheel with its bundled BLAS, else why there is nothing to do."""
    for dist in ("mlx-cuda-12", "mlx-cuda-13", "mlx-cuda"):
        if _has_dist(dist):
            return "MLX's CUDA build"
    try:
        files = metadata.files("mlx-cpu") or []
    except metadata.PackageNotFoundError:
        return "no mlx-cpu wheel (MLX built from source, or not installed)"
    if any("mlx_cpu.libs/libblas" in str(f) for f in files):
        return "cpu"
    return "this mlx-cpu wheel has no bundled reference BLAS"


def _has_dist(name: str) -> bool:
    try:
        metadata.distribution(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _candidates(setting: str) -> list[tuple[str, Path | str]]:
    key = setting.lower()
    if key == "auto":
        return _mkl() + _openblas()
    if key == "mkl":
        return _mkl()
    if key == "openblas":
        return _openblas()
    path = Path(setting).expanduser()
    return [(path.name, path)] if path.is_file() else []


def _mkl() -> list[tuple[str, Path]]:
    """``libmkl_rt`` from the ``mkl`` wheel (it installs into ``<prefix>/lib``)."""
    try:
        files = metadata.files("mkl") or []
    except metadata.PackageNotFoundError:
        return []
    found = sorted(
        (Path(metadata.distribution("mkl").locate_file(f)) for f in files if Path(str(f)).name.startswith("libmkl_rt.so")),
        key=lambda p: len(p.name),
    )
    return [("Intel oneMKL", p.resolve()) for p in found[-1:] if p.exists()]


def _openblas() -> list[tuple[str, str]]:
    name = ctypes.util.find_library("openblas")
    return [("OpenBLAS", name)] if name else []


def _version(name: str, lib) -> str | None:
    try:
        if name == "Intel oneMKL":
            buf = ctypes.create_string_buffer(256)
            lib.mkl_get_version_string(buf, len(buf))
            text = buf.value.decode(errors="replace")
            # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build ..."
            return text.split("Version", 1)[-1].split("Product")[0].strip(" -") or None
        if name == "OpenBLAS":
            lib.openblas_get_config.restype = ctypes.c_char_p
            return lib.openblas_get_config().decode(errors="replace").split()[1]
    except (AttributeError, IndexError, OSError):
        pass
    return None


def _already_mapped() -> tuple[str, str] | None:
    """A fast BLAS already in this process (e.g. through ``LD_PRELOAD``), from ``/proc/self/maps``."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for marker, name in (("libmkl_rt", "Intel oneMKL"), ("libopenblas", "OpenBLAS")):
        for line in maps.splitlines():
            if marker in line:
                return name, line.split()[-1]
    return None


preload()
