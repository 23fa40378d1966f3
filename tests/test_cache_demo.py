"""``python -m examples.cache_demo`` at a small size: a window that wraps many times, a rolled-back
draft after the wrap, and every checked answer equal to dense attention over the window."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cache_demo_matches_dense_attention():
    args = ["--window", "16", "--prompt", "300", "--chunk", "128", "--decode", "501", "--draft", "3"]
    done = subprocess.run([sys.executable, "-m", "examples.cache_demo", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # The cache holds at most window - 1 + slack + step positions (15 + 8 + 256 here): never the whole prompt.
    prefill = re.fullmatch(r"prefill 300 positions in chunks of 128: (\d+) stored, \d+ KiB", lines[0])
    assert prefill and 15 + 8 <= int(prefill[1]) <= 15 + 8 + 256
    decode = re.fullmatch(r"decode step   500: offset 801, (\d+) stored, \d+ KiB", lines[1])
    assert decode and 15 + 8 <= int(decode[1]) <= 15 + 8 + 256
    # After the rollback the offset is 300 + 501 + 1 = 802 positions: 50 windows of 16.
    assert lines[2] == "rolled back a 3-token draft after 50 wraps of the window"
    worst = float(re.fullmatch(r"worst \|difference\| against dense attention: (\S+)", lines[3])[1])
    assert worst < 1e-5
