"""zoo_blas: the fast BLAS goes in before MLX, can be switched off, is reported, and changes no result."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import zoo_blas

ROOT = Path(__file__).resolve().parent.parent


def run(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter (the preload happens once per process); its last line is JSON."""
    import os

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


def test_too_late_is_said_not_hidden():
    got = run(PROBE.format(first="mlx.core"))
    if fast_blas_available():
        assert not got["loaded"] and "too late" in got["reason"]
    assert got["line"].startswith("BLAS: ")


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
