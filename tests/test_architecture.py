"""The direction of every import between the project's packages, read from the source with ``ast``.

    examples -> models -> {graphs, weights, cache, kernels};  graphs -> cache

``graphs`` never imports ``models`` or ``weights``; ``weights`` imports neither ``graphs`` nor
``models`` (it hands arrays by name and takes plain values); ``cache`` imports nothing of the
project; ``kernels`` (the packed-weight extension) imports nothing of the project either and is
used by ``models``' device plan; no library package imports ``examples``, ``benchmarks`` or ``tests``. The two top-level
modules ``zoo_blas`` and ``zoo_switches`` (the BLAS preload and the switch table) sit below
everything and import no package of the project. Every import counts, including those inside
functions (lazy imports still make the dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cache", "graphs", "weights", "kernels", "models", "examples", "benchmarks", "tests")
BASE_MODULES = ("zoo_blas", "zoo_switches")
LIBRARY = ("cache", "graphs", "weights", "kernels", "models")
# What each top-level unit may import of the project (itself always allowed).
ALLOWED: dict[str, set[str]] = {
    "zoo_switches": set(),
    "zoo_blas": {"zoo_switches"},
    "cache": {*BASE_MODULES},
    "graphs": {"cache", *BASE_MODULES},
    "weights": {*BASE_MODULES},
    "kernels": {*BASE_MODULES},
    "models": {"graphs", "weights", "cache", "kernels", *BASE_MODULES},
    "examples": {"models", "cache", *BASE_MODULES},
    "benchmarks": {*LIBRARY, "examples", *BASE_MODULES},
    "tests": {*LIBRARY, "examples", "benchmarks", *BASE_MODULES},
}
PROJECT = set(PACKAGES) | set(BASE_MODULES)


def unit_of(path: Path) -> str:
    """The top-level package (or base module) a source file belongs to."""
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imported_units(source: str, path: Path) -> list[tuple[int, str, str]]:
    """``(line, imported top-level unit, the import as written)`` for every project import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            names = [(alias.name, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                package = path.relative_to(ROOT).parent.parts
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names = [(target, f"from {'.' * node.level}{node.module or ''} import ...")]
        else:
            continue
        for module, written in names:
            top = module.split(".")[0]
            if top in PROJECT:
                found.append((node.lineno, top, written))
    return found


def violations(path: Path, source: str | None = None) -> list[str]:
    """``file:line: unit -> imported (written)`` for each import the rules above forbid."""
    unit = unit_of(path)
    allowed = ALLOWED.get(unit)
    if allowed is None:
        return []
    source = path.read_text() if source is None else source
    return [
        f"{path.relative_to(ROOT)}:{line}: {unit} -> {top} is forbidden ({written})"
        for line, top, written in imported_units(source, path)
        if top != unit and top not in allowed
    ]


def project_files() -> list[Path]:
    files = [ROOT / f"{name}.py" for name in BASE_MODULES]
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return [f for f in files if f.is_file()]


def test_every_import_follows_the_dependency_direction():
    problems = [line for path in project_files() for line in violations(path)]
    assert not problems, "imports against the dependency direction:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "file,source,arrow",
    [
        ("graphs/gemma4_text.py", "from models.precision import AUTO\n", "graphs -> models"),
        ("graphs/layers.py", "def f():\n    import weights.quantize\n", "graphs -> weights"),
        ("weights/gemma4_keys.py", "from graphs.gemma4_text_config import Gemma4TextConfig\n", "weights -> graphs"),
        ("cache/base.py", "from graphs import layers\n", "cache -> graphs"),
        ("graphs/layers.py", "import kernels\n", "graphs -> kernels"),
        ("kernels/__init__.py", "from models import precision\n", "kernels -> models"),
        ("models/loading.py", "from examples import chat\n", "models -> examples"),
        ("graphs/gemma3_text.py", "from ..models import zoo\n", "graphs -> models"),
    ],
)
def test_an_injected_forbidden_import_is_named(file, source, arrow):
    """The checker itself: a forbidden import names the file, the line and the arrow."""
    (problem,) = violations(ROOT / file, "import math\n" + source)
    line = source.count("\n", 0, source.index("import")) + 2
    assert problem.startswith(f"{file}:{line}: {arrow} is forbidden"), problem


def test_allowed_imports_pass():
    assert violations(ROOT / "models/loading.py", "from graphs import layers\nfrom cache import Read\nimport zoo_switches\n") == []
    assert violations(ROOT / "graphs/layers.py", "from .speedups import few_rows\nfrom cache import Read\n") == []
