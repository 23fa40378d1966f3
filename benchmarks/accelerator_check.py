"""The accelerator plan on a GPU in one command: MLX's CUDA build in a fresh environment, the
accelerator-plan parity subset, and our speed against mlx-lm and mlx-vlm on the same device.

    python -m benchmarks.accelerator_check --venv /tmp/zoo-cuda [--wheels DIR]   # on a CUDA machine
    python -m benchmarks.accelerator_check --here [--skip NAME,...]              # an environment that has it
    python -m benchmarks.accelerator_check --cpu                                 # here: MLX's CPU build

Steps, each a row of the table printed at the end (and its own output below it):

1. The environment (not with ``--cpu``): a new virtual environment at ``--venv`` with the project,
   its test extra and mlx-vlm (the peer) installed, then MLX's CPU build swapped for ``mlx[cuda]``
   of the same MLX version (README, "Devices"); ``--wheels DIR`` installs from a folder of wheels only, for a
   machine without a package index. Every later step runs in that environment.
2. Parity under ``GEMMA_ZOO_PLAN=accelerator``: Gemma 3, Gemma 4 text, vision, multimodal,
   DiffusionGemma and the cache equalities against transformers (``PARITY``); passed/failed counts.
3. Speed, each benchmark in its own processes with the accelerator plan: the real Gemma 3 270M
   against mlx-lm (``benchmarks.speed``), a random E2B-shaped Gemma 4 against mlx-lm
   (``benchmarks.gemma4_text_vs_mlx_lm``) and with an image against mlx-vlm
   (``benchmarks.gemma4_vision_vs_mlx_vlm``), DiffusionGemma against mlx-vlm
   (``benchmarks.diffusion_gemma``). A peer that is not installed is reported by the benchmark.

``--here`` runs the steps at full size in the running environment, which already holds MLX's
CUDA (or Metal) build, as on a machine without a package index; ``--skip`` leaves out the steps
whose names contain one of its words (say, the Gemma 3 270M row where its asset cannot be fetched).
``--cpu`` runs the same steps in this environment on MLX's CPU device with small sizes, so the
script is known to run end to end where no GPU is lent; its numbers say nothing about a GPU.
``--smoke`` is ``--cpu`` with one parity file and each benchmark's own ``--smoke`` (whose records
it checks, ``benchmarks.smoke``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = "left out (--skip)"
PARITY = [
    "tests/test_gemma3_text_parity.py", "tests/test_gemma4_text_parity.py", "tests/test_gemma4_vision_parity.py",
    "tests/test_gemma4_multimodal.py", "tests/test_diffusion_parity.py", "tests/test_gemma4_cache_consistency.py",
    "tests/test_cache_reads.py",
]  # fmt: skip
# (name, module, arguments at full size, arguments for --cpu)
SPEED = [
    ("Gemma 3 270M vs mlx-lm", "benchmarks.speed",
     ["--models", "gemma3", "--skip", "torch,llama.cpp,ours 8-bit,ours 4-bit,mlx-lm + BLAS"],
     ["--models", "gemma3", "--skip", "torch,llama.cpp,ours 8-bit,ours 4-bit,mlx-lm + BLAS", "--prompt", "64", "--gen", "8", "--runs", "1"]),
    ("E2B-shaped Gemma 4 vs mlx-lm", "benchmarks.gemma4_text_vs_mlx_lm", [],
     ["--prompt", "64", "--gen", "8", "--runs", "1", "--rounds", "1"]),
    ("E2B-shaped Gemma 4 + image vs mlx-vlm", "benchmarks.gemma4_vision_vs_mlx_vlm", [],
     ["--gen", "8", "--runs", "1", "--max-soft-tokens", "70"]),
    ("DiffusionGemma vs mlx-vlm", "benchmarks.diffusion_gemma", [],
     ["--prompt", "64", "--blocks", "1", "--steps", "2", "--runs", "1"]),
]  # fmt: skip


def run(command: list[str], env: dict, timeout: int) -> tuple[int, str, float]:
    """``(exit code, stdout + stderr, seconds)`` of ``command`` in the checkout."""
    start = time.perf_counter()
    try:
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout + out.stderr, time.perf_counter() - start
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return 124, text + f"\n(timed out after {timeout} s)", time.perf_counter() - start


def outcome(code: int, text: str) -> str:
    """A benchmark's result in a few words: ok, a stack it skipped (the reason is in its output), or its failure."""
    if "No module named 'mlx_vlm'" in text:
        return "peer missing: mlx-vlm is not installed" + ("" if code == 0 else f" (exit {code})")
    if code != 0:
        return f"failed (exit {code})"
    skipped = sorted(set(re.findall(r"\[(\w+) skipped", text)))
    return f"ok, but skipped: {', '.join(skipped)}" if skipped else "ok"


def make_environment(venv: Path, wheels: Path | None) -> tuple[Path, list[str]]:
    """A fresh virtual environment with the project and MLX's CUDA build: ``(its python, notes)``."""
    run([sys.executable, "-m", "venv", str(venv)], dict(os.environ), 600)
    python = venv / "bin" / "python"
    offline = ["--no-index", "--find-links", str(wheels)] if wheels else []
    notes = []
    steps = [
        [str(python), "-m", "pip", "install", *offline, "-e", ".[test]", "mlx-vlm"],
        [str(python), "-m", "pip", "uninstall", "-y", "mlx-cpu"],
    ]
    for step in steps:
        code, text, _ = run(step, dict(os.environ), 3000)
        if code != 0:
            raise SystemExit(f"environment: {' '.join(step[2:5])} failed:\n{text[-3000:]}")
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('mlx'))"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    code, text, _ = run([str(python), "-m", "pip", "install", *offline, f"mlx[cuda]=={version}"], dict(os.environ), 3000)
    if code != 0:
        raise SystemExit(f"environment: mlx[cuda]=={version} failed to install:\n{text[-3000:]}")
    notes.append(device_probe(python))
    return python, notes


def device_probe(python: Path) -> str:
    """MLX's version, default device and whether CUDA is available, as ``python`` sees them."""
    probe = "import zoo_cpu, mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), 'cuda:', mx.cuda.is_available())"
    out = subprocess.run([str(python), "-c", probe], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or f"probe failed: {out.stderr.strip()[-300:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--venv", type=Path, help="make a fresh environment with MLX's CUDA build here")
    where.add_argument("--here", action="store_true", help="this environment (MLX's CUDA or Metal build), full sizes")
    where.add_argument("--cpu", action="store_true", help="this environment, MLX's CPU device, small sizes")
    parser.add_argument("--skip", default="", help="comma-separated words: leave out the steps whose names contain one")
    parser.add_argument("--wheels", type=Path, help="install from this folder of wheels only (no package index)")
    parser.add_argument("--photo", type=Path, help="the vision row's photo (default: a synthetic picture; the tower's speed does not depend on it)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds each step may take")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP + "; implies --cpu")
    args = parser.parse_args()
    if args.venv and args.smoke:
        parser.error("--smoke runs here (it implies --cpu), not in --venv")
    if not (args.venv or args.here or args.cpu or args.smoke):
        parser.error("one of --venv, --here, --cpu or --smoke is required")
    skipped = [word.strip() for word in args.skip.split(",") if word.strip()]
    args.cpu = args.cpu or args.smoke
    record = smoke.Record("accelerator_check")

    rows, outputs = [], []
    if args.cpu:
        python, notes = Path(sys.executable), ["MLX's CPU device (--cpu): a check that the script runs, not a GPU number"]
    elif args.here:
        python, notes = Path(sys.executable), [device_probe(Path(sys.executable))]
    else:
        python, notes = make_environment(args.venv, args.wheels)
    env = {**os.environ, "GEMMA_ZOO_PLAN": "accelerator"}
    # float32 parity needs IEEE float32 products (MLX's CUDA build defaults to TF32): the suite's
    # conftest sets it too; the speed rows run as users run, with MLX's default
    parity_env = {**env, "MLX_ENABLE_TF32": "0"}
    rows.append(("environment", "; ".join(notes), ""))

    if any(word in "parity, accelerator plan" for word in skipped):
        rows.append(("parity, accelerator plan", LEFT_OUT, ""))
    else:
        parity = PARITY[:1] if args.smoke else PARITY
        code, text, seconds = run([str(python), "-m", "pytest", "-q", "--tb=line", "-m", "not slow", "-p", "no:cacheprovider", *parity],
                                  parity_env, args.timeout)  # fmt: skip
        counts = ", ".join(re.findall(r"\d+ (?:passed|failed|errors?|skipped)", text)) or f"exit {code}"
        rows.append(("parity, accelerator plan", counts if code == 0 else f"failed: {counts}", f"{seconds:.0f} s"))
        print(" | ".join(rows[-1]), flush=True)  # as each step ends, for a run that is cut short
        outputs.append(("parity, accelerator plan", text[-6000:]))
        if code == 0:
            record.row("parity, accelerator plan", seconds=seconds)
        else:
            record.missing("parity, accelerator plan", counts)

    for name, module, full, small in SPEED:
        if any(word in name for word in skipped):
            rows.append((name, LEFT_OUT, ""))
            continue
        # diffusion_gemma's smoke mode and test are its own; the others run their --smoke here
        arguments = (small if module == "benchmarks.diffusion_gemma" else ["--smoke"]) if args.smoke else small if args.cpu else full
        if module == "benchmarks.gemma4_vision_vs_mlx_vlm" and not args.smoke:
            arguments = [*arguments, "--photo", str(args.photo or smoke.synthetic_photo())]
        code, text, seconds = run([str(python), "-m", module, *arguments], env, args.timeout)
        result = outcome(code, text)
        rows.append((name, result, f"{seconds:.0f} s"))
        print(" | ".join(rows[-1]), flush=True)
        outputs.append((name, text[-6000:]))
        if smoke.MARK in text:
            found = smoke.problems(smoke.parse(text))
        else:
            found = [] if result == "ok" or result.startswith("peer missing") else [result]
        if found:
            record.missing(name, "; ".join(found))
        else:
            record.row(name, seconds=seconds)

    print("| step | result | time |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for name, text in outputs:
        print(f"\n## {name}\n\n{text.strip()}")
    if args.smoke:
        record.finish()
    if any(r[1].startswith("failed") for r in rows[1:2]) or any(
        r[1] not in ("ok", LEFT_OUT) and not r[1].startswith("peer missing") for r in rows[2:]
    ):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
