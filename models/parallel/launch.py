"""``mlx.launch`` with an exit status that says whether every rank succeeded.

    python -m models.parallel.launch -n 2 --backend ring --python python3 -m examples.chat --model ... --parallel tensor

takes exactly ``mlx.launch``'s arguments. ``mlx.launch`` itself exits 0 whatever its ranks do, and
as soon as one rank ends with an error it SIGTERMs the others: a split chat whose second rank was
killed mid-answer ended with status 0, the answer cut off and no error. Here the launcher runs with
``--env GEMMA_ZOO_RANK_REPORT=1``, which makes each rank end with one stderr line giving its exit
status (``runtime.report_exit``; the other ranks turn the SIGTERM into a ``RankLostError``,
``runtime.stop_on_sigterm``). Those lines are taken out of the launcher's stderr (the rest passes
through as it comes), and the exit status is 0 when every rank reported 0, else the status of a
rank that failed by itself (not ``EXIT_RANK_LOST``), else ``EXIT_RANK_LOST`` (the ranks that
reported nothing were killed or crashed); each rank that failed is named on stderr.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from models.parallel.runtime import EXIT_RANK_LOST, REPORT_ENV, REPORT_LINE


def launcher() -> str:
    """The ``mlx.launch`` of this Python environment."""
    beside = Path(sys.executable).with_name("mlx.launch")
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        raise FileNotFoundError(f"mlx.launch is neither beside {sys.executable} nor on PATH (it comes with the mlx package)")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        command = [launcher(), "--env", f"{REPORT_ENV}=1", *argv]
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reports: dict[int, int] = {}
    size = 0
    # Ctrl-C reaches the launcher and the ranks as it would without this wrapper, which keeps relaying
    # (a Python handler, unlike SIG_IGN, is not inherited by the launcher).
    signal.signal(signal.SIGINT, lambda signum, frame: None)
    with subprocess.Popen(command, stderr=subprocess.PIPE) as process:
        for raw in process.stderr:
            report = REPORT_LINE.match(raw.decode(errors="replace").rstrip("\r\n"))
            if report is None:
                sys.stderr.buffer.write(raw)
                sys.stderr.buffer.flush()
                continue
            rank, size, code = (int(x) for x in report.groups())
            reports[rank] = code
    if process.returncode != 0 and not reports:  # the launcher refused its arguments, or no rank ever started
        return process.returncode
    if not size:
        print("error: no rank reported its exit status (were they started with --parallel?)", file=sys.stderr)
        return EXIT_RANK_LOST
    failed = {rank: reports.get(rank) for rank in range(size) if reports.get(rank) != 0}
    for rank, code in failed.items():
        why = "ended without reporting its exit status (killed or crashed)" if code is None else f"exited with status {code}"
        print(f"error: rank {rank} of {size} {why}", file=sys.stderr)
    causes = sorted((code for code in failed.values() if code is not None), key=lambda code: code == EXIT_RANK_LOST)
    return 0 if not failed else causes[0] if causes else EXIT_RANK_LOST


if __name__ == "__main__":
    sys.exit(main())
