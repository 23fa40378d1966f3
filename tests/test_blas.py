"""zoo_blas: the fast BLAS goes in before MLX (in either import order, through the import hook), can be
switched off, is reported (one warning when it came too late), and changes no result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import zoo_blas

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (the preload happens once per process); its last line is JSON."""
    # The outer setting (e.g. the whole suite run with GEMMA_ZOO_BLAS=off) is not what these tests test.
    full_env = {k: v for k, v in os.environ.items() if k != zoo_blas.ENV}
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, {first}
    import mlx.core as mx
    import zoo_blas
    a = mx.array([[float(i % 7 - 3) for i in range(64)] for _ in range(64)]) / 8
    print(json.dumps({{**zoo_blas.info(), "line": zoo_blas.describe(), "product": (a @ a).tolist()}}))
"""


def fast_blas_available() -> bool:
    return bool(zoo_blas._candidates("auto")) and zoo_blas._mlx_build() == "cpu"


needs_fast_blas = pytest.mark.skipif(not fast_blas_available(), reason="no mlx[cpu] wheel or no fast BLAS installed")


@needs_fast_blas
@pytest.mark.parametrize("package", ["cache", "graphs", "models", "weights", "examples"])
def test_every_package_loads_the_blas_before_mlx(package):
    got = run(PROBE.format(first=package))
    assert got["loaded"], got
    assert "loaded before mlx.core" in got["reason"]
    assert got["line"].startswith(f"BLAS: {got['name']}")


@needs_fast_blas
def test_off_switch_keeps_the_bundled_blas_and_the_same_numbers():
    on = run(PROBE.format(first="models"))
    off = run(PROBE.format(first="models"), {zoo_blas.ENV: "off"})
    assert not off["loaded"] and off["name"] == "MLX's bundled reference BLAS"
    assert f"{zoo_blas.ENV}=off" in off["line"]
    # Small integers / 8: every product and sum is exact in float32, whatever the summation order.
    assert on["product"] == off["product"]


# Code that takes the installed import hook (if any) out of a fresh process, to see what happens without it.
NO_HOOK = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, '__name__', '') != 'GemmaZooBlasHook']"

LATE = """
    import json, warnings
    {pre}
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import mlx.core as mx
        import zoo_blas, models
        zoo_blas.preload(); zoo_blas.info()
    print(json.dumps({{**zoo_blas.info(), "line": zoo_blas.describe(),
                      "warnings": [f"{{w.category.__name__}}: {{w.message}}" for w in caught]}}))
"""


def test_too_late_warns_once_with_the_fix():
    got = run(LATE.format(pre=NO_HOOK))
    assert got["line"].startswith("BLAS: ")
    if not fast_blas_available():
        assert got["warnings"] == [] and got["warning"] is None
        return
    assert not got["loaded"] and "too late" in got["reason"]
    assert "import a zoo package (or zoo_blas) before mlx.core" in got["line"]  # the fix, in --verbose's line
    assert got["warnings"] == [f"SlowBlasWarning: {got['warning']}"]  # exactly one, however often it is asked
    assert "Fix: import a zoo package" in got["warning"] and f"{zoo_blas.ENV}=off" in got["warning"]
    if got["hook"] is None:
        assert "import hook" in got["warning"] and "pip install -e ." in got["warning"]


def test_off_means_no_preload_and_no_warning_in_any_order():
    for pre in (NO_HOOK, ""):  # without and with the installed hook (when there is one)
        got = run(LATE.format(pre=pre), {zoo_blas.ENV: "off"})
        assert not got["loaded"] and got["reason"] == f"{zoo_blas.ENV}=off"
        assert got["warnings"] == [] and got["warning"] is None


# ---------------------------------------------------------------------------------------- the import hook
def hook_site(tmp_path: Path) -> Path:
    """A site folder holding the hook file exactly as the build writes it."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / zoo_blas.HOOK_FILE).write_text(zoo_blas.pth_line(), encoding="utf-8")
    return folder


def with_hook(folder: Path) -> str:
    """Take out an installed hook, then let ``site`` run the hook file of ``folder``, as at start-up."""
    return f"{NO_HOOK}; import site; site.addsitedir({str(folder)!r})"


@needs_fast_blas
def test_hook_loads_the_blas_when_mlx_comes_first(tmp_path):
    got = run(LATE.format(pre=with_hook(hook_site(tmp_path))))
    assert got["loaded"] and got["warnings"] == [], got
    assert "loaded before mlx.core by the import hook" in got["reason"]
    assert got["hook"] and got["hook"].endswith(zoo_blas.HOOK_FILE)


def test_hook_loads_nothing_into_a_process_that_never_imports_mlx(tmp_path):
    code = f"""
        import json, sys
        {with_hook(hook_site(tmp_path))}
        import email.message, zipfile, sqlite3, numpy
        maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
        print(json.dumps({{"hooked": any(getattr(f, "__name__", "") == "GemmaZooBlasHook" for f in sys.meta_path),
                          "imported": sorted(m for m in ("zoo_blas", "zoo_switches", "mlx") if m in sys.modules),
                          "mkl": "libmkl_rt" in maps}}))
    """
    assert run(code) == {"hooked": True, "imported": [], "mkl": False}


def test_hook_with_blas_off_loads_nothing_and_says_nothing(tmp_path):
    got = run(LATE.format(pre=with_hook(hook_site(tmp_path))), {zoo_blas.ENV: "off"})
    assert not got["loaded"] and got["warnings"] == []


def test_hook_never_breaks_importing_mlx(tmp_path):
    """A bad switch: ``import mlx.core`` still works (one warning), the zoo's own import then refuses it."""
    code = f"""
        import warnings
        {with_hook(hook_site(tmp_path))}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mlx.core
        print([str(w.message) for w in caught])
        import zoo_blas
    """
    env = {k: v for k, v in os.environ.items() if k != zoo_blas.ENV}
    env[zoo_blas.ENV] = "fastest"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "GEMMA_ZOO_BLAS='fastest'" in out.stderr.splitlines()[-1]
    assert "BLAS import hook failed" in out.stdout and out.stdout.count("GEMMA_ZOO_BLAS='fastest'") == 1


installed_hook = pytest.mark.skipif(
    zoo_blas.hook_path() is None,
    reason=f"{zoo_blas.HOOK_FILE} is not installed: reinstall the project (pip install -e .) to test it",
)


@needs_fast_blas
@installed_hook
def test_installed_hook_makes_the_import_order_irrelevant():
    got = run("import json, mlx.core, zoo_blas; print(json.dumps(zoo_blas.info()))")
    assert got["loaded"] and "by the import hook" in got["reason"], got
    assert got["hook"] == zoo_blas.hook_path()


def test_both_wheels_ship_the_hook_file(tmp_path):
    """``pip install .`` and ``pip install -e .`` both install what setup.py's build step writes."""
    pytest.importorskip("setuptools", minversion="64")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "zoo_blas.py", "zoo_switches.py"):
        shutil.copy(ROOT / name, src / name)
    # The kernels package without its C++ sources: the build records why it built no kernels
    # (compiling them is not what this test is about) and still ships the hook.
    (src / "kernels").mkdir()
    for module in (ROOT / "kernels").glob("*.py"):
        shutil.copy(module, src / "kernels" / module.name)
    code = """
        import json, sys
        from setuptools import build_meta
        build = build_meta.build_editable if sys.argv[1] == "editable" else build_meta.build_wheel
        print(json.dumps(build(sys.argv[2])))
    """
    for kind in ("regular", "editable"):
        dist = tmp_path / kind
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), kind, str(dist)], cwd=src,
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        wheel = dist / json.loads(out.stdout.strip().splitlines()[-1])
        with zipfile.ZipFile(wheel) as archive:
            assert archive.read(zoo_blas.HOOK_FILE).decode() == zoo_blas.pth_line(), wheel
            record = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))).decode()
            assert zoo_blas.HOOK_FILE in record  # so that pip uninstall removes it


def test_unknown_choice_reports_not_installed():
    got = run(PROBE.format(first="models"), {zoo_blas.ENV: "/nonexistent/libblas.so"})
    assert not got["loaded"]
    assert got["line"].startswith("BLAS: ")


@needs_fast_blas
def test_fast_blas_is_much_faster_than_the_reference():
    """The point of it all: a 1024² float32 matmul at least 3x the bundled BLAS's speed."""
    code = """
        import json, time, models
        import mlx.core as mx
        a = mx.random.normal((1024, 1024)); mx.eval(a @ a)
        best = min((lambda t: (mx.eval(a @ a), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(5))
        print(json.dumps({"gflops": 2 * 1024**3 / best / 1e9}))
    """
    fast = run(code)["gflops"]
    slow = run(code, {zoo_blas.ENV: "off"})["gflops"]
    assert fast > 3 * slow, (fast, slow)
