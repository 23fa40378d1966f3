"""The direction of every import between the project's packages, read from the source with ``ast``.

    examples -> models -> {graphs, weights, cache};  graphs -> cache;  everything -> zoo_cpu

``graphs`` never imports ``models`` or ``weights``; ``weights`` imports neither ``graphs`` nor
``models`` (it hands arrays by name and takes plain values); ``cache`` imports nothing of the
project but ``zoo_cpu``, the CPU backend (BLAS loading, switch table, C++ extension, CPU math),
which sits below everything and imports no other package of the project; no library package
imports ``examples``, ``benchmarks`` or ``tests``. Every import counts, including those inside
functions (lazy imports still make the dependency). Every top-level package or module of the
checkout must be one the rules know, so a new one cannot slip in around them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zoo_cpu", "cache", "graphs", "weights", "models", "examples", "benchmarks", "tests")
LIBRARY = ("zoo_cpu", "cache", "graphs", "weights", "models")
# Top-level files of the checkout that are not a unit of the rules: the build step.
BUILD_FILES = ("setup.py",)
# What each top-level unit may import of the project (itself always allowed).
ALLOWED: dict[str, set[str]] = {
    "zoo_cpu": set(),
    "cache": {"zoo_cpu"},
    "graphs": {"cache", "zoo_cpu"},
    "weights": {"zoo_cpu"},
    "models": {"graphs", "weights", "cache", "zoo_cpu"},
    "examples": {"models", "cache", "zoo_cpu"},
    "benchmarks": {*LIBRARY, "examples"},
    "tests": {*LIBRARY, "examples", "benchmarks"},
}
PROJECT = set(PACKAGES)


def unit_of(path: Path) -> str:
    """The top-level package a source file belongs to."""
    return path.relative_to(ROOT).parts[0]


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
    files = []
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
        ("zoo_cpu/fast_math.py", "from models import precision\n", "zoo_cpu -> models"),
        ("zoo_cpu/backend.py", "from cache import attention\n", "zoo_cpu -> cache"),
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
    assert violations(ROOT / "models/loading.py", "from graphs import layers\nfrom cache import Read\nfrom zoo_cpu import switches\n") == []
    assert violations(ROOT / "cache/attention.py", "from zoo_cpu import backend\n") == []
    assert violations(ROOT / "graphs/layers.py", "from .speedups import few_rows\nfrom cache import Read\n") == []


def top_level_units(root: Path) -> set[str]:
    """Every top-level Python package or module of ``root`` (hidden folders and build files aside)."""
    units = {p.parent.name for p in root.glob("*/__init__.py")}
    units |= {p.stem for p in root.glob("*.py") if p.name not in BUILD_FILES}
    return {u for u in units if not u.startswith(".")}


def test_every_top_level_package_is_known_to_the_rules():
    unknown = top_level_units(ROOT) - set(PACKAGES)
    assert not unknown, f"top-level packages or modules the import rules do not know: {sorted(unknown)}"


def test_an_unknown_top_level_package_is_caught(tmp_path):
    for name in ("cache", "kernels"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / "zoo_blas.py").write_text("")
    (tmp_path / "setup.py").write_text("")
    assert top_level_units(tmp_path) - set(PACKAGES) == {"kernels", "zoo_blas"}
