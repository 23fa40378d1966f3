"""zoo_cpu.blas: the fast BLAS goes in before MLX when the zoo is imported first, can be switched off,
is reported (one warning with the fix when it came too late), changes no result, and reaches into
no other program (no import hook: a process that imports only MLX gets MLX as it is)."""

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

import zoo_cpu

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (the preload happens once per process); its last line is JSON."""
    # The outer setting (e.g. the whole suite run with GEMMA_ZOO_BLAS=off) is not what these tests test.
    full_env = {k: v for k, v in os.environ.items() if k != zoo_cpu.blas.ENV}
    full_env.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=full_env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
    import json, {first}
    import mlx.core as mx
    import zoo_cpu
    a = mx.array([[float(i % 7 - 3) for i in range(64)] for _ in range(64)]) / 8
    print(json.dumps({{**zoo_cpu.blas.info(), "line": zoo_cpu.blas.describe(), "product": (a @ a).tolist()}}))
"""


def fast_blas_available() -> bool:
    return bool(zoo_cpu.blas._candidates("auto")) and zoo_cpu.blas._mlx_build() == "cpu"


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
    off = run(PROBE.format(first="models"), {zoo_cpu.blas.ENV: "off"})
    assert not off["loaded"] and off["name"] == "MLX's bundled reference BLAS"
    assert f"{zoo_cpu.blas.ENV}=off" in off["line"]
    # Small integers / 8: every product and sum is exact in float32, whatever the summation order.
    assert on["product"] == off["product"]


LATE = """
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import mlx.core as mx
        import zoo_cpu, models
        zoo_cpu.blas.preload(); zoo_cpu.blas.info()
    print(json.dumps({**zoo_cpu.blas.info(), "line": zoo_cpu.blas.describe(),
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))
"""


def test_too_late_warns_once_with_the_fix():
    got = run(LATE)
    assert got["line"].startswith("BLAS: ")
    if not fast_blas_available():
        assert got["warnings"] == [] and got["warning"] is None
        return
    assert not got["loaded"] and "too late" in got["reason"]
    assert f"{zoo_cpu.blas.FIX}" in got["line"]  # the fix, in --verbose's line
    assert got["warnings"] == [f"SlowBlasWarning: {got['warning']}"]  # exactly one, however often it is asked
    assert f"Fix: {zoo_cpu.blas.FIX}" in got["warning"] and f"{zoo_cpu.blas.ENV}=off" in got["warning"]


def test_off_means_no_preload_and_no_warning():
    got = run(LATE, {zoo_cpu.blas.ENV: "off"})
    assert not got["loaded"] and got["reason"] == f"{zoo_cpu.blas.ENV}=off"
    assert got["warnings"] == [] and got["warning"] is None


def test_a_program_that_imports_only_mlx_gets_mlx_as_it_is():
    """No startup hook: installing the zoo changes nothing for another MLX program in the environment."""
    code = """
        import json, sys
        import mlx.core as mx
        mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)))
        maps = open("/proc/self/maps").read() if sys.platform == "linux" else ""
        print(json.dumps({"imported": sorted(m for m in sys.modules if m.split(".")[0] in ("zoo_cpu", "models", "cache")),
                          "mkl": "libmkl_rt" in maps}))
    """
    assert run(code) == {"imported": [], "mkl": False}
    # setuptools' own editable-install file only puts the checkout on the path (or a finder for it).
    pth = [f for d in map(Path, sys.path) if d.is_dir() for f in d.glob("*.pth") if not f.name.startswith("__editable__")]
    assert not [f for f in pth if "zoo" in f.read_text(errors="replace").lower()], pth


def test_unknown_choice_reports_not_installed():
    got = run(PROBE.format(first="models"), {zoo_cpu.blas.ENV: "/nonexistent/libblas.so"})
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
    slow = run(code, {zoo_cpu.blas.ENV: "off"})["gflops"]
    assert fast > 3 * slow, (fast, slow)


@needs_fast_blas
def test_each_named_choice_and_a_file_that_is_no_blas(tmp_path):
    mkl = run(PROBE.format(first="zoo_cpu"), {zoo_cpu.blas.ENV: "mkl"})
    assert mkl["loaded"] == bool(zoo_cpu.blas._mkl()) and mkl["line"].startswith("BLAS: ")
    openblas = run(PROBE.format(first="zoo_cpu"), {zoo_cpu.blas.ENV: "openblas"})
    if zoo_cpu.blas._openblas():
        assert openblas["loaded"] and openblas["name"] == "OpenBLAS"
    else:
        assert not openblas["loaded"] and openblas["reason"] == f"{zoo_cpu.blas.ENV}=openblas: not installed"
    fake = tmp_path / "libfake.so"
    fake.write_text("not a shared library")
    got = run(PROBE.format(first="zoo_cpu"), {zoo_cpu.blas.ENV: str(fake)})
    assert not got["loaded"] and got["name"] == "MLX's bundled reference BLAS"
    assert got["reason"].startswith(f"{fake}: ")  # the loader's own error for that file
    assert got["product"] == mkl["product"]


@needs_fast_blas
def test_a_blas_already_preloaded_is_reported_not_loaded_again():
    found = zoo_cpu.blas._mkl()
    if not found:
        pytest.skip("the mkl wheel is not installed")
    mkl = found[0][1]
    got = run(PROBE.format(first="zoo_cpu"), {"LD_PRELOAD": str(mkl)})
    assert got["loaded"] and got["name"] == "Intel oneMKL" and got["path"] == str(mkl)
    assert got["reason"] == "already in the process before the zoo loaded one (LD_PRELOAD?)"
