"""Failures of a split model: no rank hangs, every rank says what went wrong.

Each rank is started here (``tests.distributed_tiny.launch_direct``, the environment ``mlx.launch``
gives a ring rank) so that every rank's own exit status and stderr can be read: a rank that dies
mid-generation (SIGKILL) or stops answering (SIGSTOP) makes rank 0 exit with ``RankLostError``
(status ``EXIT_RANK_LOST``) within a bounded time, and ranks holding different checkpoints or
plans refuse to start with ``ParallelSetupError`` naming the ranks and what differs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from models.parallel import EXIT_RANK_LOST  # noqa: E402
from tests.distributed_tiny import REPO, free_ports, launch_direct, save_text  # noqa: E402

PROMPT = [2] + list(range(10, 30))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed_faults")
    for name in ("ple_shared", "moe"):
        save_text(name, root / name)
    return root


def generation(folders, mode: str, **fields) -> dict:
    return dict(name="generate", folder=str(folders / "ple_shared"), mode=mode, task="generate", out=str(folders),
                ids=PROMPT, max_tokens=200, prefill_step=8, **fields)  # fmt: skip


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_a_rank_killed_mid_generation_ends_the_others_with_a_named_error(folders, mode, tmp_path):
    start = time.monotonic()
    survivor, victim = launch_direct([generation(folders, mode, die_after=3, timeout=60)], 2, tmp_path, timeout=120)
    assert victim.returncode == -9
    assert survivor.returncode == EXIT_RANK_LOST, survivor.stderr[-2000:]
    # The backend's error when the survivor was receiving as the peer died; the watchdog's when it
    # was sending: MLX's ring backend then logs "Failing pending tasks" but the waiting evaluation
    # never returns (seen with MLX 0.32.4 once the decode kernels made the step fast enough to be
    # in a send at that moment), and only the watchdog ends it.
    assert "RankLostError: rank 0 of 2" in survivor.stderr
    assert "another rank is gone" in survivor.stderr or "no answer from the other ranks for 60 s" in survivor.stderr
    assert time.monotonic() - start < 90


def test_a_rank_that_stops_answering_trips_the_watchdog(folders, tmp_path):
    survivor, victim = launch_direct([generation(folders, "tensor", die_after=3, stall=True, timeout=5)], 2, tmp_path,
                                     timeout=120, rest=5)  # fmt: skip
    assert victim.returncode is None  # stopped, killed by the test
    assert survivor.returncode == EXIT_RANK_LOST, survivor.stderr[-2000:]
    assert "no answer from the other ranks for 5 s during a generation step" in survivor.stderr


def test_ranks_with_different_checkpoints_refuse_to_start(folders, tmp_path):
    job = dict(name="logits", folders=[str(folders / "ple_shared"), str(folders / "moe")], mode="tensor", task="logits",
               out=str(folders), ids=PROMPT)  # fmt: skip
    for rank in launch_direct([job], 2, tmp_path, timeout=120):
        assert rank.returncode == 2, rank.stderr[-2000:]
        assert "ParallelSetupError" in rank.stderr
        assert "rank 1 on" in rank.stderr and "holds a different checkpoint" in rank.stderr


def test_ranks_with_different_plans_refuse_to_start(folders, tmp_path):
    job = dict(name="logits", folder=str(folders / "moe"), mode="tensor", task="logits", out=str(folders), ids=PROMPT,
               experts_per_rank=["columns", "rows"])  # fmt: skip
    for rank in launch_direct([job], 2, tmp_path, timeout=120):
        assert rank.returncode == 2, rank.stderr[-2000:]
        assert "rank 1 on" in rank.stderr and "runs a different plan" in rank.stderr
        assert ('"experts": "columns"' in rank.stderr) != ('"experts": "rows"' in rank.stderr)  # each rank states its own


# ------------------------------------------------------------------------------ under the launcher
@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    from tests.server_tiny import save_random_chat

    return save_random_chat(tmp_path_factory.mktemp("launched") / "chat")


def launched_chat(folder: Path, *flags: str) -> subprocess.Popen:
    """``python -m models.parallel.launch -n 2`` of a split ``examples.chat`` (its own process group)."""
    command = [sys.executable, "-m", "models.parallel.launch", "-n", "2", "--backend", "ring", "--starting-port",
               str(free_ports(2)), "--python", sys.executable, "-m", "examples.chat", "--model", str(folder),
               "--parallel", "tensor", *flags]  # fmt: skip
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finished(process: subprocess.Popen, timeout: float = 300) -> tuple[str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        raise AssertionError(f"the launch ran past {timeout} s: {err.decode()[-3000:]}") from None
    return out.decode(), err.decode()


def rank_pid(rank: int, marker: str) -> int:
    """The process of ``rank`` (``MLX_RANK`` in its environment) whose command line holds ``marker``."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                if f"MLX_RANK={rank}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                    return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"no process of rank {rank} running {marker}")


def test_the_launcher_fails_when_a_rank_is_killed_mid_answer(chat_folder):
    """``mlx.launch`` exited 0 with the answer cut off: it ignores its ranks' statuses and SIGTERMs the
    survivor before it notices the loss. The wrapper exits EXIT_RANK_LOST and rank 0 says why."""
    process = launched_chat(chat_folder, "--prompt", "Once upon a time", "--max-tokens", "480")
    try:
        assert process.stdout.read(1), "the answer never began"
        os.kill(rank_pid(1, str(chat_folder)), signal.SIGKILL)
    finally:
        out, err = finished(process)
    assert process.returncode == EXIT_RANK_LOST, err[-3000:]
    assert "RankLostError: rank 0 of 2" in err and "error: rank 1 of 2 ended without reporting its exit status" in err
    assert "gemma-zoo: rank" not in err  # the ranks' status lines are the wrapper's, not the user's


def test_the_launcher_succeeds_when_every_rank_does(chat_folder):
    process = launched_chat(chat_folder, "--prompt", "Hi", "--max-tokens", "3")
    out, err = finished(process)
    assert process.returncode == 0, err[-3000:]
    assert "[the answer reached --max-tokens 3]" in err and "gemma-zoo: rank" not in err and "error" not in err, err[-3000:]
    assert out.strip()
