"""Build step: the zoo's C++ extension for MLX's CPU build; the rest is pyproject.toml.

The extension (``zoo_cpu._packed``, C++ in ``zoo_cpu/src``) is built with CMake and nanobind
against the MLX of the build environment (the newest release ``pyproject.toml`` allows, which is
what the same install resolves for the package itself). It calls into ``libmlx.so``, whose C++ ABI
changes between releases, so the build records that MLX's version in ``zoo_cpu/_build.json``; at
run time ``zoo_cpu.extension`` loads it only under the same MLX and otherwise says why and how to
rebuild. It is built on Linux x86-64 only; anywhere else, or when the build cannot run (no C++
compiler, no CMake, a compile error), the package installs without it and ``_build.json`` records
why, which ``--verbose`` prints.

A wheel (``pip install .``) takes it from ``build_lib``. A PEP 660 editable wheel
(``pip install -e .``) is made from an unpacked folder (files left in ``build_lib`` are dropped
there), so in editable mode it is copied into the source folder.
"""

import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


KERNELS = "zoo_cpu._packed"
KERNELS_SOURCE = ROOT / "zoo_cpu" / "src"
BUILD_FILE = "_build.json"


def kernels_skip_reason() -> str | None:
    """Why the kernels are not built here, or None when they should be."""
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in ("x86_64", "amd64"):
        return f"built on Linux x86-64 only (this is {sys.platform} {machine})"
    if shutil.which("cmake") is None:
        return "CMake was not found"
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return "no C++ compiler was found (c++, g++, clang++ or $CXX)"
    for dist in ("mlx-cpu", "nanobind"):
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            return f"{dist} is not installed in the build environment"
    return None


def version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class BuildKernels(build_ext):
    """``build_ext`` for the kernels: CMake, or a recorded reason; never a failed install."""

    def build_extension(self, ext):
        out = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out.mkdir(parents=True, exist_ok=True)
        reason = kernels_skip_reason()
        if reason is None:
            reason = self._cmake(ext, out)
        if reason is not None:
            self.warn(f"the zoo's C++ kernels are not built: {reason}; MLX's own ops run instead")
        info = {"built": reason is None, "reason": reason, "mlx": version_of("mlx-cpu"), "nanobind": version_of("nanobind")}
        (out / BUILD_FILE).write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")

    def _cmake(self, ext, out: Path) -> str | None:
        # The build environment's (pinned) MLX: its headers, libmlx.so and CMake config.
        mlx_root = Path(metadata.distribution("mlx-cpu").locate_file("mlx")).resolve()
        build = Path(self.build_temp).resolve() / "zoo_cpu"
        build.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(KERNELS_SOURCE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-DMLX_ROOT={mlx_root}",
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}",
        ]
        for command in (configure, ["cmake", "--build", str(build), f"-j{os.cpu_count() or 1}"]):
            run = subprocess.run(command, capture_output=True, text=True)
            if run.returncode != 0:
                print(run.stdout[-4000:] + run.stderr[-4000:], file=sys.stderr)
                last = (run.stderr.strip() or run.stdout.strip()).splitlines()[-1:] or ["no output"]
                return f"`{' '.join(command[:2])}` failed ({last[0][:200]})"
        if not Path(self.get_ext_fullpath(ext.name)).is_file():
            return f"CMake did not produce {Path(self.get_ext_fullpath(ext.name)).name}"
        return None

    def _built(self, ext) -> list[Path]:
        """The extension (when built) and its build record, in ``build_lib``."""
        built = Path(self.build_lib) / self.get_ext_filename(self.get_ext_fullname(ext.name))
        return [p for p in (built, built.with_name(BUILD_FILE)) if p.is_file()]

    def copy_extensions_to_source(self):
        """Editable installs: the extension (when built) and its build record into ``zoo_cpu/``."""
        for ext in self.extensions:
            target = ROOT / Path(*ext.name.split(".")[:-1])
            for path in self._built(ext):
                self.copy_file(str(path), str(target / path.name), level=self.verbose)

    def get_outputs(self):
        return [str(p) for ext in self.extensions for p in self._built(ext)]


setup(
    cmdclass={"build_ext": BuildKernels},
    ext_modules=[Extension(KERNELS, sources=[])],
)
