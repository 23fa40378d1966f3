"""Helpers of the distributed tests: tiny checkpoints, and launching ranks of ``tests.distributed_rank`` on loopback.

``launch`` runs the ranks the way users do, through ``mlx.launch --backend ring``; ``launch_direct``
starts each rank itself with the environment ``mlx.launch`` would give it (a ring hostfile and
``MLX_RANK``), so a fault test can watch every rank's own exit status and stderr (``mlx.launch``
ends the other ranks itself as soon as one fails). Every launch has a timeout: no test can hang.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import models
from tests import hf_tiny
from tests.distributed_rank import cached_logits

REPO = Path(__file__).resolve().parents[1]
# Split models only reorder sums; on these float32 models that alone moves logits by up to ~2e-5
# (as swapping the BLAS does in one process): see ``assert_logits_of``.
TOL = 1e-5
NEAR = 5e-5
IMAGE_PROMPT = [2, 10, 11, hf_tiny.T5_TOKENS["image_token_id"], 12, 13, 14]

S, F = hf_tiny.S, hf_tiny.F
# Small weights: logits of order one, so 1e-5 is a float32 statement.
SMALL = dict(initializer_range=0.05)
CONFIGS = {
    # per-layer inputs and KV sharing in E2B's pattern (S S S S S F S F, the last two reuse 4 and 5)
    "ple_shared": dict(hf_tiny.TEXT_CONFIGS["E2B_like"], **SMALL),
    # MoE beside the dense MLP, K=V on the full layer, 4 query heads over 2 (sliding) and 1 (full) kv heads
    "moe": dict(hf_tiny.TEXT_CONFIGS["T3"], num_attention_heads=4, **SMALL),
    # sliding + full, biases and an untied head: 4 stages of one layer each fit
    "dense_untied": dict(hf_tiny.TEXT_CONFIGS["T1_bias_untied"], num_attention_heads=4, num_key_value_heads=2, **SMALL),
}


def save_text(name: str, directory: Path):
    """``CONFIGS[name]`` saved by transformers into ``directory``; the transformers model."""
    return hf_tiny.save_causal_lm(CONFIGS[name], directory)


def tiny_folders(root: Path, ids: list[int]) -> dict:
    """Every checkpoint of ``CONFIGS``, the multimodal T5 and a 4-bit MLX conversion of ``moe``
    (``moe_packed``) saved under ``root``: ``{name: folder}``, plus ``"root"`` and ``"float64"``:
    transformers' float64 logits of ``ids`` for each text checkpoint."""
    out: dict = {"root": root, "float64": {}, "multimodal": root / "multimodal"}
    for name in CONFIGS:
        out["float64"][name] = hf_tiny.float64_logits(save_text(name, root / name), [ids])
        out[name] = root / name
    hf_tiny.save_conditional_generation(out["multimodal"])
    # the MoE checkpoint as an MLX folder quantized to 4 bits in groups of 32 (packed weights, scales and biases)
    from models.convert import convert

    out["moe_packed"] = root / "moe_packed"
    convert(str(out["moe"]), out["moe_packed"], q_bits=4, q_group_size=32)
    return out


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free local ports (``mlx.launch --starting-port``)."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            start = probe.getsockname()[1]
        if start + count < 65536 and all(_free(start + i) for i in range(count)):
            return start
    raise RuntimeError("no block of free local ports")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def write_jobs(jobs: list[dict], directory: Path) -> Path:
    path = directory / "jobs.json"
    path.write_text(json.dumps(jobs))
    return path


def launch(jobs: list[dict], ranks: int, directory: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``mlx.launch -n ranks --backend ring`` of ``tests.distributed_rank`` over ``jobs``."""
    launcher = shutil.which("mlx.launch")
    if launcher is None:
        raise FileNotFoundError("mlx.launch is not on PATH (it comes with the mlx package)")
    command = [
        launcher, "-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)),
        "--python", sys.executable, "-m", "tests.distributed_rank", str(write_jobs(jobs, directory)),
    ]  # fmt: skip
    return run_group(command, timeout)


def run_group(command: list[str], timeout: float, input: str | None = None) -> subprocess.CompletedProcess:
    """``command`` in its own process group, all of which (the launcher and its ranks) is killed at ``timeout``."""
    with subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            log = f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
            raise AssertionError(f"{' '.join(command[:3])} ... ran past {timeout} s and was killed\n{log}") from None
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@dataclass
class Rank:
    returncode: int | None
    stdout: str
    stderr: str


def launch_direct(jobs: list[dict], ranks: int, directory: Path, timeout: float = 300, rest: float | None = None) -> list[Rank]:
    """Each rank started here with a ring hostfile; rank 0 is waited for up to ``timeout`` seconds,
    each other rank up to ``rest`` more (default ``timeout``), then killed."""
    start = free_ports(ranks)
    hostfile = directory / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{start + r}"] for r in range(ranks)]))
    jobs_file = write_jobs(jobs, directory)
    processes = []
    for r in range(ranks):
        env = dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=str(hostfile), MLX_WORLD_SIZE=str(ranks))
        command = [sys.executable, "-m", "tests.distributed_rank", str(jobs_file)]
        processes.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for r, process in enumerate(processes):
        try:
            out, err = process.communicate(timeout=timeout if r == 0 or rest is None else rest)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            results.append(Rank(None, out, err))
            continue
        results.append(Rank(process.returncode, out, err))
    return results


def results(directory: Path, name: str, ranks: int, launched: subprocess.CompletedProcess | None = None) -> list[dict]:
    """Every rank's arrays of job ``name`` (a missing file fails with the launch's output)."""
    out = []
    for r in range(ranks):
        path = directory / f"{name}.rank{r}.npz"
        if not path.exists():
            log = "" if launched is None else f"\nstdout:\n{launched.stdout[-3000:]}\nstderr:\n{launched.stderr[-3000:]}"
            raise AssertionError(f"rank {r} wrote no result for job {name!r}{log}")
        with np.load(path) as data:
            out.append(dict(data))
    return out


def single(folder, **options):
    return models.load(str(folder), dtype="float32", tokenizer=False, **options)


def worst(a, b) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)).max())


def same_on_every_rank(ranks: list[dict], key: str = "full") -> None:
    for r, got in enumerate(ranks):
        assert np.array_equal(got[key], ranks[0][key]), f"rank {r}'s {key} differs from rank 0's"


def assert_logits_of(ranks: list[dict], model, float64: np.ndarray, ids: list[int], chunks=(7, 1)) -> None:
    """The split model's uncached and cached (``chunks``) logits of ``ids`` (each rank's ``full`` and
    ``cached``) are no further from transformers' float64 logits than the single process's, plus ``TOL``."""
    same_on_every_rank(ranks)
    floor = max(worst(model.logits([ids]), float64), worst(cached_logits(model, ids, list(chunks)), float64))
    assert worst(ranks[0]["full"], float64) <= floor + TOL
    assert worst(ranks[0]["cached"], float64) <= floor + TOL


def assert_near(ranks: list[dict], model, ids: list[int], chunks=(7, 1)) -> None:
    """Where no float64 reference is at hand: the split model's uncached and cached logits of ``ids``
    within ``NEAR`` of the single process's (and the same on every rank)."""
    same_on_every_rank(ranks)
    assert worst(ranks[0]["full"], model.logits([ids])) < NEAR
    assert worst(ranks[0]["cached"], cached_logits(model, ids, list(chunks))) < NEAR
