"""``python -m benchmarks.diffusion_gemma --smoke`` runs in the suite: a tiny random DiffusionGemma,
one round, every stack in its own process. It must exit cleanly, which it does only when ours and
every installed peer produced a row and ours and mlx-vlm (same weights) gave the same greedy
draft; a broken benchmark (ours skipped, a peer failing) fails here.
"""

import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_smoke(*extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GEMMA_ZOO_CPU_QUANT"}  # the benchmark as a user runs it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "benchmarks.diffusion_gemma", "--smoke", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_diffusion_benchmark_smoke():
    out = run_smoke()
    assert out.returncode == 0, f"exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "| ours (diffusion) |" in out.stdout and "| ours, Gemma 4 AR same stack |" in out.stdout
    if find_spec("mlx_vlm") is not None:
        assert "| mlx-vlm (diffusion) |" in out.stdout and "ours and mlx-vlm: the same greedy draft" in out.stdout
    else:
        assert "mlx_vlm is not installed, no row" in out.stderr


@pytest.mark.slow
def test_an_installed_peer_without_a_row_fails_the_run(tmp_path):
    """An mlx-vlm that imports but cannot load the checkpoint: the run goes on, then exits 1 naming it."""
    (tmp_path / "mlx_vlm").mkdir()
    (tmp_path / "mlx_vlm" / "__init__.py").write_text("")
    (tmp_path / "mlx_vlm" / "utils.py").write_text("def load_model(path):\n    raise RuntimeError('broken on purpose')\n")
    out = run_smoke("--mlx-vlm-path", str(tmp_path))
    assert out.returncode == 1
    assert "| ours (diffusion) |" in out.stdout
    assert "mlx-vlm (diffusion) produced no row (exit 1): RuntimeError: broken on purpose" in out.stderr
