"""What a split model needs from MLX's distributed runtime beyond the collectives themselves.

The ranks are ``mx.distributed``'s group (the ring backend over TCP under ``mlx.launch``); every
collective the graphs make is MLX's (``all_sum``, ``all_gather``, ``send``/``recv``). On top:

- ``share_bytes`` / ``share_json`` / ``share_arrays``: rank 0's value on every rank (an ``all_sum``
  with zeros from the others, as mlx-lm's server shares requests), for the prompts, images and
  seeds a chat on rank 0 hands to the ranks that follow it;
- ``check_same``: at start-up every rank must hold the same checkpoint (config.json and every
  safetensors header) under the same plan; a difference is a ``ParallelSetupError`` naming the
  ranks, their hosts and what differs, before any weight is used;
- ``rank_errors`` and ``Watchdog``: a rank that dies closes its sockets, and MLX's ring then fails
  the pending collective (``RuntimeError: [ring] connection to a peer was lost``, about a second
  later); that becomes a ``RankLostError`` naming this rank. A rank that hangs without dying (a
  stopped process, a dead link) closes nothing, so each step that waits on the others is armed on
  a watchdog that ends the process with the same named error once ``timeout`` seconds pass;
- ``stop_on_sigterm`` and ``report_exit``: ``mlx.launch`` SIGTERMs the other ranks as soon as one
  ends with an error, before they notice the loss themselves; the SIGTERM becomes the same
  ``RankLostError`` line and status. Under ``python -m models.parallel.launch`` every rank's last
  stderr line reports its exit status, which the launcher's own exit status does not
  (``models.parallel.launch``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from weights.safetensors_io import checkpoint_files, tensor_entries
from zoo_cpu import switches

# The exit status of a rank that lost another rank (a sysexits-style "temporary failure").
EXIT_RANK_LOST = 75
# How long one step (a prefill chunk, a token, a start-up exchange) may wait on the other ranks.
DEFAULT_STEP_TIMEOUT = 300.0

_BACKEND_ERROR = re.compile(r"^\[(ring|jaccl|mpi|nccl)\]")


class ParallelSetupError(RuntimeError):
    """The ranks cannot run together: not started as several ranks, or they disagree on the
    checkpoint or the plan (the message names the ranks, their hosts and what differs)."""


class RankLostError(RuntimeError):
    """Another rank died or stopped answering while this one waited on it."""


# Set by ``models.parallel.launch`` for the ranks it starts: each reports its exit status on stderr.
REPORT_ENV = "GEMMA_ZOO_RANK_REPORT"
REPORT_LINE = re.compile(r"^gemma-zoo: rank (\d+) of (\d+) exited with status (-?\d+)$")


def init(backend: str = "any") -> mx.distributed.Group:
    """The group of every rank ``mlx.launch`` started (size 1 when run without a launcher)."""
    return mx.distributed.init(backend=backend)


def describe(group: mx.distributed.Group) -> str:
    return f"rank {group.rank()} of {group.size()} ({socket.gethostname()})"


# ---------------------------------------------------------------------------------------- sharing
def share_bytes(group: mx.distributed.Group, payload: bytes | None) -> bytes:
    """Rank 0's ``payload`` on every rank (the others pass None)."""
    if group.size() == 1:
        return payload
    mine = group.rank() == 0
    size = int(mx.distributed.all_sum(mx.array([len(payload) if mine else 0], dtype=mx.int64), group=group).item())
    data = np.frombuffer(payload, dtype=np.uint8) if mine else np.zeros(size, dtype=np.uint8)
    if size == 0:
        return b""
    return bytes(np.array(mx.distributed.all_sum(mx.array(data), group=group)))


def share_json(group: mx.distributed.Group, value=None):
    """Rank 0's JSON-able ``value`` on every rank."""
    raw = share_bytes(group, json.dumps(value).encode() if group.rank() == 0 else None)
    return json.loads(raw)


def share_arrays(group: mx.distributed.Group, arrays=None) -> list[mx.array]:
    """Rank 0's list of arrays (MLX or numpy) on every rank, shapes and dtypes included."""
    mine = group.rank() == 0
    if mine:
        arrays = [mx.array(a) for a in arrays]
    header = share_json(group, [[list(a.shape), str(a.dtype).rsplit(".", 1)[-1]] for a in arrays] if mine else None)
    if group.size() == 1:
        return arrays
    shared = []
    for i, (shape, dtype) in enumerate(header):
        local = arrays[i] if mine else mx.zeros(shape, dtype=getattr(mx, dtype))
        shared.append(mx.distributed.all_sum(local, group=group))
    mx.eval(shared)
    return shared


def any_rank(group: mx.distributed.Group, flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (a Ctrl-C on rank 0 stops every rank's loop)."""
    if group.size() == 1:
        return flag
    return bool(mx.distributed.all_sum(mx.array([int(flag)]), group=group).item())


# ---------------------------------------------------------------------------------------- start-up check
def checkpoint_digest(folder: Path) -> str:
    """A digest of ``config.json`` and every safetensors file's name, size and header: two ranks
    with equal digests hold the same tensors under the same names, shapes and dtypes (the data
    itself is not hashed: that would read the whole checkpoint on every start)."""
    digest = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    files, _ = checkpoint_files(Path(folder))
    for name, path in files.items():
        _, entries = tensor_entries(path)
        digest.update(json.dumps([name, path.stat().st_size, entries], sort_keys=True).encode())
    return digest.hexdigest()


def check_same(group: mx.distributed.Group, checkpoint: str, plan: dict) -> None:
    """Every rank must report rank 0's checkpoint digest and plan; else ``ParallelSetupError`` on every rank."""
    plan_text = json.dumps(plan, sort_keys=True)
    host = socket.gethostname()
    mine = [checkpoint, hashlib.sha256(plan_text.encode()).hexdigest(), host[:64]]
    if group.size() == 1:
        return
    width = 64 + 64 + 64
    row = np.zeros(width, dtype=np.uint8)
    for i, text in enumerate(mine):
        encoded = text.encode()[:64]
        row[64 * i : 64 * i + len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    table = np.array(mx.distributed.all_gather(mx.array(row[None]), group=group))
    rows = [[bytes(r[64 * i : 64 * (i + 1)]).rstrip(b"\0").decode(errors="replace") for i in range(3)] for r in table]
    problems = []
    for what, column in (("checkpoint (config.json or a safetensors header differs)", 0), ("plan", 1)):
        bad = [r for r in range(group.size()) if rows[r][column] != rows[0][column]]
        if bad:
            where = ", ".join(f"rank {r} on {rows[r][2]}" for r in bad)
            verb = "holds a different" if column == 0 else "runs a different"
            problems.append(f"{where} {verb} {what} than rank 0 on {rows[0][2]}")
    if problems:
        raise ParallelSetupError(
            f"{describe(group)}: the ranks do not agree: " + "; ".join(problems) + f". This rank's plan: {plan_text}"
        )


# ---------------------------------------------------------------------------------------- failures
@contextmanager
def rank_errors(group: mx.distributed.Group):
    """Turn the distributed backend's failure (a lost peer) into ``RankLostError``."""
    try:
        yield
    except RuntimeError as err:
        if not _BACKEND_ERROR.match(str(err)):
            raise
        raise RankLostError(f"{describe(group)}: another rank is gone ({err}); stopping") from err


def report_exit(code: int) -> None:
    """Under ``models.parallel.launch`` (``REPORT_ENV`` set), this rank's last stderr line: its exit status."""
    group = mx.distributed.init()
    if switches.enabled(REPORT_ENV) and group.size() > 1:
        sys.stderr.write(f"gemma-zoo: rank {group.rank()} of {group.size()} exited with status {code}\n")
        sys.stderr.flush()


def stop_on_sigterm(group: mx.distributed.Group) -> None:
    """End this rank with a ``RankLostError`` line and ``EXIT_RANK_LOST`` on SIGTERM, which
    ``mlx.launch`` sends the other ranks once one has ended with an error. Python runs signal
    handlers only between bytecodes, and a rank blocked in a collective runs none, so the signal
    is taken from ``signal.set_wakeup_fd`` by a thread instead. Call from the main thread."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the thread below acts on it
    signal.set_wakeup_fd(write)

    def watch() -> None:
        while signal.SIGTERM not in os.read(read, 64):
            pass
        sys.stderr.write(f"RankLostError: {describe(group)}: stopped by SIGTERM (mlx.launch sends it when another rank "
                         "has ended); stopping\n")  # fmt: skip
        report_exit(EXIT_RANK_LOST)
        os._exit(EXIT_RANK_LOST)

    threading.Thread(target=watch, name="gemma-zoo-sigterm", daemon=True).start()


class Watchdog:
    """Ends this process (exit status ``EXIT_RANK_LOST``, a ``RankLostError`` line on stderr) when a
    step armed with ``arm`` has not been re-armed or ``disarm``-ed within ``timeout`` seconds.

    A blocked collective cannot be interrupted from Python, so the watchdog is a daemon thread that
    calls ``os._exit``: no hang outlives the timeout, whatever the other rank is doing.
    """

    def __init__(self, group: mx.distributed.Group, timeout: float = DEFAULT_STEP_TIMEOUT):
        if not timeout > 0:
            raise ValueError(f"Watchdog: timeout must be > 0 seconds, got {timeout!r}")
        self.group, self.timeout = group, float(timeout)
        self._deadline: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="gemma-zoo-watchdog", daemon=True).start()

    def arm(self, what: str) -> None:
        with self._lock:
            self._deadline, self._what = time.monotonic() + self.timeout, what

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    @contextmanager
    def step(self, what: str):
        self.arm(what)
        try:
            yield
        finally:
            self.disarm()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                sys.stderr.write(
                    f"RankLostError: {describe(self.group)}: no answer from the other ranks for {self.timeout:g} s "
                    f"during {what}; stopping\n"
                )
                sys.stderr.flush()
                report_exit(EXIT_RANK_LOST)
                os._exit(EXIT_RANK_LOST)
