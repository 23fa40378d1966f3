"""Build hook: ship ``zoo_blas``'s import hook (a ``.pth`` file) in site-packages; the rest is pyproject.toml.

The file lets ``import mlx.core`` come before ``import models`` and still get the fast CPU BLAS
(see ``zoo_blas``'s docstring). Its line comes from ``zoo_blas.HOOK_FILE`` / ``pth_line()``, read
from the source without importing the module (importing it would load the BLAS into the build).

A wheel (``pip install .``) takes it from ``build_lib``. A PEP 660 editable wheel
(``pip install -e .``) is made from an unpacked folder that setuptools passes to ``install`` as
``install_lib`` (files left in ``build_lib`` are dropped there), so in editable mode it goes there.
"""

import ast
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def hook_file() -> tuple[str, str]:
    """``(file name, line)`` of the import hook, from ``zoo_blas.py``'s definitions."""
    tree = ast.parse((ROOT / "zoo_blas.py").read_text(encoding="utf-8"))
    wanted = {"HOOK_FILE", "HOOK_SOURCE", "pth_line"}
    nodes = [
        node for node in tree.body
        if (isinstance(node, ast.Assign) and {getattr(t, "id", None) for t in node.targets} & wanted)
        or (isinstance(node, ast.FunctionDef) and node.name in wanted)
    ]
    scope: dict = {}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "zoo_blas.py", "exec"), scope)
    return scope["HOOK_FILE"], scope["pth_line"]()


class BuildPyWithHook(build_py):
    """``build_py``, plus the import hook's ``.pth`` at the root of the (editable or regular) wheel."""

    def run(self):
        super().run()
        name, line = hook_file()
        folder = self._hook_folder()
        if folder is None:
            self.warn(f"no folder for {name}: the zoo's BLAS import hook is not installed")
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, name).write_text(line, encoding="utf-8")

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs.append(str(Path(self.build_lib, hook_file()[0])))
        return outputs

    def _hook_folder(self):
        if getattr(self, "editable_mode", False):
            return self.get_finalized_command("install").install_lib
        return self.build_lib


setup(cmdclass={"build_py": BuildPyWithHook})
