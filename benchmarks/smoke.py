"""The smoke mode every benchmark offers (``--smoke``: tiny sizes, one round) and the checks made on it.

A benchmark run with ``--smoke`` fills a :class:`Record` as it goes (a row per stack that ran, the
stacks it could not run and why, the groups of stacks that must give the same greedy tokens) and
ends with :meth:`Record.finish`, which prints it as one ``SMOKE {json}`` line and exits non-zero
when :func:`problems` finds any. ``tests/test_benchmark_smoke.py`` runs every benchmark this way,
so a benchmark that silently stops measuring one of its stacks fails the suite. The rules:

- a stack of ours must have a row: skipping it for any reason is a failure;
- a peer whose package is installed must have a row; one whose package is not installed is
  reported as not installed (never as a row), and is checked to be really absent; a peer that
  ran and refused the configuration itself (its own ``NotImplementedError``) is reported as
  unsupported, a measured result;
- a row's measurements must be finite and positive;
- the stacks of an agreement group (same weights, same arithmetic precision, greedy) must give
  the same token ids.

Tiny random checkpoints (:func:`tiny_checkpoint`) stand in for real or large ones where the
benchmark takes a folder: the same code paths, seconds to build.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "SMOKE "
HELP = "tiny sizes, one round; prints a SMOKE record and fails on a missing row (benchmarks/smoke.py)"


def installed(package: str) -> bool:
    """Whether ``package`` (an import name) can be imported here."""
    return find_spec(package) is not None


class Record:
    """What one smoke run of a benchmark produced."""

    def __init__(self, benchmark: str):
        self.benchmark = benchmark
        self.stacks: dict[str, dict] = {}
        self.groups: list[list[str]] = []

    def row(self, stack: str, ids: list[int] | None = None, ours: bool = True, **values: float) -> None:
        """A stack that ran: its measurements (``values``) and, where it generated, its token ids."""
        self.stacks[stack] = {"status": "row", "ours": ours, "values": values, "ids": ids}

    def missing(self, stack: str, reason: str, ours: bool = True, package: str | None = None) -> None:
        """A stack without a row: ``package`` names the import whose absence explains it (a peer
        not installed); any other reason is a failure."""
        status = "not installed" if package and not installed(package) else "skipped"
        self.stacks[stack] = {"status": status, "ours": ours, "reason": reason, "package": package}

    def unsupported(self, stack: str, reason: str) -> None:
        """A peer that ran and refused the configuration (its own ``NotImplementedError``)."""
        self.stacks[stack] = {"status": "unsupported", "ours": False, "reason": reason}

    def agree(self, *stacks: str) -> None:
        """These stacks must give the same token ids (those with a row are compared)."""
        self.groups.append(list(stacks))

    def as_dict(self) -> dict:
        return {"benchmark": self.benchmark, "stacks": self.stacks, "groups": self.groups}

    def finish(self) -> None:
        """Print the record; exit with status 1 when it has problems."""
        record = self.as_dict()
        print(MARK + json.dumps(record), flush=True)
        found = problems(record)
        if found:
            print("smoke problems:\n  " + "\n  ".join(found), file=sys.stderr, flush=True)
            raise SystemExit(1)


def alone(fn, runs: int) -> list[float]:
    """Seconds of each of ``runs`` calls of ``fn`` after one warm-up call: our side of a
    comparison whose peer is not installed."""
    import time

    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def problems(record: dict) -> list[str]:
    """What is wrong with a smoke record (an empty list: nothing)."""
    found = []
    stacks = record["stacks"]
    if not any(s["status"] == "row" and s["ours"] for s in stacks.values()):
        found.append("no row of ours at all")
    for name, s in stacks.items():
        if s["status"] == "row":
            bad = {k: v for k, v in s["values"].items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)}
            if bad:
                found.append(f"{name}: measurements not finite and positive: {bad}")
            if s["ids"] is not None and not s["ids"]:
                found.append(f"{name}: generated no tokens")
        elif s["ours"]:
            found.append(f"{name} (ours) has no row: {s['reason']}")
        elif s["status"] == "unsupported":
            if not s["reason"].startswith("NotImplementedError"):
                found.append(f"{name} is called unsupported, but failed otherwise: {s['reason']}")
        elif s["status"] != "not installed":
            found.append(f"{name} is installed but has no row: {s['reason']}")
        elif installed(s["package"]):
            found.append(f"{name} was reported not installed, but {s['package']} imports")
    for group in record["groups"]:
        ran = [n for n in group if n in stacks and stacks[n]["status"] == "row"]
        unknown = [n for n in group if n not in stacks]
        if unknown:
            found.append(f"agreement group names stacks with no record: {unknown}")
        answers = {n: stacks[n]["ids"] for n in ran}
        if len({json.dumps(a) for a in answers.values()}) > 1:
            found.append(f"stacks that should agree differ: {answers}")
    return found


def parse(stdout: str) -> dict:
    """The record a smoke run printed (the last ``SMOKE`` line)."""
    lines = [line for line in stdout.splitlines() if line.startswith(MARK)]
    if not lines:
        raise ValueError("the benchmark printed no SMOKE record")
    return json.loads(lines[-1][len(MARK) :])


# A tiny Gemma of each text family, saved by transformers; the full 262,144-token vocabulary, so that
# the benchmarks' prompts (random ids up to 200,000) fit, and dimensions that the 4-bit g32 and
# 8-bit g64 policies divide.
S, F = "sliding_attention", "full_attention"
TINY = {
    # mlx-lm's gemma3_text takes the layer pattern from sliding_window_pattern (6): whole periods only
    "gemma3": dict(vocab_size=262144, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                   sliding_window=16, layer_types=[S] * 5 + [F], max_position_embeddings=4096),
    # 8 layers: the last 2 share the keys and values of layers 4-5, so a 2-stage pipeline can split 0-3 | 4-7
    "gemma4": dict(vocab_size=262144, vocab_size_per_layer_input=262144, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   global_head_dim=128, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                   sliding_window=16, layer_types=[S, F] * 4, final_logit_softcapping=30.0,
                   max_position_embeddings=4096),
}  # fmt: skip


def tiny_checkpoint(family: str) -> Path:
    """A random tiny ``family`` ("gemma3" or "gemma4") causal LM saved by transformers, built once
    under ``.assets/bench``, with the config fields mlx-lm reads."""
    if family not in TINY:
        raise ValueError(f"tiny_checkpoint: unknown family {family!r} (known: {sorted(TINY)})")
    import hashlib

    shape = hashlib.sha256(json.dumps(TINY[family], sort_keys=True).encode()).hexdigest()[:8]
    folder = ROOT / ".assets" / "bench" / f"smoke-{family}-{shape}"  # a changed shape is a new folder
    if (folder / "model.safetensors").is_file():
        return folder
    import torch
    import transformers

    config_class, model_class = {
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
    }[family]
    torch.manual_seed(0)
    raw = dict(TINY[family], pad_token_id=0, bos_token_id=2, eos_token_id=1, initializer_range=0.02)
    model = model_class(config_class(**raw)).eval()
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")  # whole or absent: processes may race
    model.save_pretrained(partial)
    if family == "gemma4":  # mlx-lm reads global_head_dim as a plain field
        config = json.loads((partial / "config.json").read_text())
        config.update(global_head_dim=TINY[family]["global_head_dim"])
        (partial / "config.json").write_text(json.dumps(config, indent=2))
    try:
        partial.rename(folder)
    except OSError:  # another process finished first: its folder is the same checkpoint
        shutil.rmtree(partial)
    return folder


def synthetic_photo() -> Path:
    """A 320x240 RGB picture (colour gradients and seeded noise) for smoke runs that need an image:
    the speed of a vision tower does not depend on what the picture shows. Written once under
    ``.assets/bench``."""
    path = ROOT / ".assets" / "bench" / "smoke-photo.png"
    if path.is_file():
        return path
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:240, 0:320]
    noise = np.random.default_rng(0).integers(0, 32, (240, 320, 3))
    pixels = np.stack([x * 255 // 319, y * 255 // 239, (x + y) * 255 // 558], axis=-1) * 7 // 8 + noise
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}.png")  # whole or absent: processes may race
    Image.fromarray(pixels.astype(np.uint8)).save(partial)
    partial.replace(path)
    return path
