"""A model split over 2 ranks on one machine against the single process: memory per rank, speed, communication.

Uses the E2B-shaped random Gemma 4 of ``benchmarks.gemma4_text_vs_mlx_lm`` (the full 262,144-token
vocabulary, per-layer inputs, KV sharing; built once under ``.assets/bench``). In one run:

- the single process (``python -m benchmarks.distributed --child single``);
- 2 ranks, ``--parallel tensor`` and ``--parallel pipeline``, each started by ``mlx.launch -n 2
  --backend ring`` on loopback (``MKL_NUM_THREADS=1`` per rank: two ranks share the cores one
  process has);
- the MoE split: a 26B-shaped random Gemma 4 in small (``MOE_SHAPED``: 32 experts, top 4, the
  MoE beside the dense MLP on every layer) in one process and over 2 ranks with the experts cut
  by columns (every expert's hidden columns halved) and by rows (whole experts per rank).

Each process loads the checkpoint (a rank reads only its part), runs one warm-up and ``--runs``
timed generations (a prompt of ``--prompt`` random tokens, ``--gen`` greedy tokens, through
``generate_tokens``) and reports its memory: MLX's allocator peak (``mx.get_peak_memory``: weights,
caches, activations and the transients of loading), what MLX holds after the warm-up (the
weights: ``mx.get_active_memory``) and the process's peak RSS. The communication of one decode step
is measured apart: every collective one decode step makes is recorded (op, shape) and then replayed
alone on zeros, in the same order, each evaluated on its own, 20 times; its mean is the "comm per
step" column (on loopback: the latency of the TCP ring and of the eval calls, not of a real link). Medians and [min-max] over the runs; the
memory ratio is each rank's peak over the single process's (the issue's target: <= 0.55 at 2 ranks).

    python -m benchmarks.distributed [--prompt 256 --gen 32 --runs 3]
    python -m benchmarks.distributed --smoke   # a tiny random Gemma 4 for the E2B shape, one run (benchmarks.smoke)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks import smoke
from benchmarks.speed import cell

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = ("all_sum", "all_gather", "send", "recv")
MOE_CHECKPOINT = ROOT / ".assets" / "bench" / "gemma4-moe-shaped"
MOE_SHAPED = dict(
    vocab_size=32768, hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, num_global_key_value_heads=2, head_dim=64, global_head_dim=128, attention_k_eq_v=True,
    enable_moe_block=True, num_experts=32, top_k_experts=4, moe_intermediate_size=512, hidden_size_per_layer_input=0,
    sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"], final_logit_softcapping=30.0,
    max_position_embeddings=32768, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip


def checkpoint(which: str) -> Path:
    """The benchmark's checkpoint, built once: the E2B-shaped one, or the MoE one (random, saved by transformers)."""
    from benchmarks.gemma4_text_vs_mlx_lm import build_checkpoint

    if which == "e2b":
        return build_checkpoint()
    if which == "tiny":
        return smoke.tiny_checkpoint("gemma4")
    if not (MOE_CHECKPOINT / "model.safetensors").exists():
        import torch
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        torch.manual_seed(0)
        Gemma4ForCausalLM(Gemma4TextConfig(**MOE_SHAPED, initializer_range=0.02)).eval().save_pretrained(MOE_CHECKPOINT)
    return MOE_CHECKPOINT


@contextmanager
def recording(calls: list):
    """Record every ``mx.distributed`` collective built while inside: ``(op, shape, dtype, peer)``."""
    import mlx.core as mx

    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}

    def wrap(name, op):
        def recorded(*args, **kwargs):
            out = op(*args, **kwargs)
            peer = args[1] if name in ("send", "recv") and len(args) > 1 else None
            if name == "recv":
                peer = args[2]
            shape = out.shape if name != "all_gather" else args[0].shape
            calls.append((name, tuple(shape), out.dtype, peer))
            return out

        return recorded

    for name, op in originals.items():
        setattr(mx.distributed, name, wrap(name, op))
    try:
        yield
    finally:
        for name, op in originals.items():
            setattr(mx.distributed, name, op)


def replay_seconds(calls: list, group, repeats: int = 20) -> float:
    """Mean seconds of ``calls`` replayed alone on zeros, in order, each evaluated on its own."""
    import mlx.core as mx

    def once():
        for name, shape, dtype, peer in calls:
            if name == "all_sum":
                out = mx.distributed.all_sum(mx.zeros(shape, dtype=dtype), group=group)
            elif name == "all_gather":
                out = mx.distributed.all_gather(mx.zeros(shape, dtype=dtype), group=group)
            elif name == "send":
                out = mx.distributed.send(mx.zeros(shape, dtype=dtype), peer, group=group)
            else:
                out = mx.distributed.recv(shape, dtype, peer, group=group)
            mx.eval(out)

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats


def child(which: str, mode: str, experts: str, prompt_length: int, gen: int, runs: int) -> None:
    import numpy as np

    import models
    from models import parallel
    from models.generation.generate import generate_tokens

    import mlx.core as mx

    group = parallel.init() if mode != "single" else None
    sharding = parallel.sharding_for(mode, group, experts=experts) if group is not None else None
    start = time.perf_counter()
    model = models.load(str(checkpoint(which)), tokenizer=False, sharding=sharding)
    load_seconds = time.perf_counter() - start
    prompt = [2] + np.random.default_rng(0).integers(3, model.vocab_size, prompt_length - 1).tolist()

    def generate(ids, count):
        cache = model.make_cache()
        begin = time.perf_counter()
        tokens = generate_tokens(model.forward, ids, cache, max_tokens=count, overlap=model.overlap)
        first = [next(tokens)]
        after_first = time.perf_counter()
        rest = list(tokens)
        return after_first - begin, time.perf_counter() - after_first, first + rest, cache

    generate(prompt[:64], 4)  # warm-up (the single process's lazily loaded weights are all read by now)
    resident = mx.get_active_memory() / 1e9
    prefill, decode = [], []
    for _ in range(runs):
        first_s, rest_s, tokens, cache = generate(prompt, gen)
        prefill.append(prompt_length / first_s)
        decode.append((len(tokens) - 1) / rest_s)
    report = dict(
        mode=mode if mode != "tensor" or which in ("e2b", "tiny") else f"tensor, experts by {experts}",
        rank=0 if group is None else group.rank(), load_s=load_seconds, prefill_tps=prefill, decode_tps=decode,
        peak_gb=mx.get_peak_memory() / 1e9, resident_gb=resident,
        rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, tokens=tokens,
    )  # fmt: skip
    if group is not None:
        calls: list = []
        step = mx.array([[tokens[-1]]])
        with recording(calls):
            logits = model.forward(step, cache, last_only=True)
        mx.eval(logits)
        report.update(collectives=len(calls), comm_ms=1e3 * replay_seconds(calls, group),
                      comm_kb=sum(int(np.prod(s)) * d.size for _, s, d, _ in calls) / 1e3)  # fmt: skip
    print("RESULT " + json.dumps(report), flush=True)


def run(command: list[str], env: dict) -> list[dict]:
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    reports = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not reports:
        raise RuntimeError(f"{' '.join(command[:6])} ... reported nothing:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return sorted(reports, key=lambda r: r["rank"])


def table(title: str, reports: dict[str, list[dict]]) -> None:
    single = next(iter(reports.values()))[0]  # the single process comes first
    print(f"\n{title}")
    print("| run | rank | prefill tok/s | decode tok/s | MLX peak GB | x single | held after load GB | x single | peak RSS GB "
          "| collectives / decode step | comm per step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ranks in reports.values():
        for r in ranks:
            comm = f"{r['collectives']} ({r['comm_kb']:.1f} kB) | {r['comm_ms']:.2f} ms" if "comm_ms" in r else "- | -"
            same = "" if r["tokens"] == single["tokens"] else " (tokens differ!)"
            peak, held = r["peak_gb"], r["resident_gb"]
            print(f"| {r['mode']}{same} | {r['rank']} | {cell(r['prefill_tps'])} | {cell(r['decode_tps'])} | {peak:.3f} | "
                  f"{peak / single['peak_gb']:.2f} | {held:.3f} | {held / single['resident_gb']:.2f} | {r['rss_gb']:.2f} | {comm} |")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--gen", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "EXPERTS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.prompt, args.gen, args.runs = 32, 4, 1
    record = smoke.Record("distributed")
    sizes = ["--prompt", str(args.prompt), "--gen", str(args.gen), "--runs", str(args.runs)]
    if args.child:
        child(*args.child, args.prompt, args.gen, args.runs)
        return 0
    this = [sys.executable, "-m", "benchmarks.distributed", *sizes, "--child"]
    launch = [shutil.which("mlx.launch"), "-n", "2", "--backend", "ring", "--python", *this]
    ranks_env = dict(os.environ, MKL_NUM_THREADS="1")
    runs = {
        "tiny" if args.smoke else "e2b": [("single", "auto"), ("tensor", "auto"), ("pipeline", "auto")],
        "moe": [("single", "auto"), ("tensor", "columns"), ("tensor", "rows")],
    }
    for which, modes in runs.items():
        checkpoint(which)
        reports = {}
        for mode, experts in modes:
            command = [*this, which, mode, experts] if mode == "single" else [*launch, which, mode, experts]
            reports[f"{mode} {experts}"] = run(command, dict(os.environ) if mode == "single" else ranks_env)
            for r in reports[f"{mode} {experts}"]:
                record.row(f"{which} {mode} {experts} rank {r['rank']}", r["tokens"], decode=min(r["decode_tps"]))
        record.agree(*(f"{which} {mode} {experts} rank {r['rank']}" for mode, experts in modes
                       for r in reports[f"{mode} {experts}"]))  # fmt: skip
        shape = {"e2b": "E2B-shaped random Gemma 4 (benchmarks.gemma4_text_vs_mlx_lm)", "moe": "MoE-shaped (MOE_SHAPED)",
                 "tiny": "tiny random Gemma 4 (benchmarks.smoke)"}[which]  # fmt: skip
        table(f"{shape}, prompt {args.prompt}, {args.gen} greedy tokens, {args.runs} runs; 2 ranks on loopback "
              "(mlx.launch --backend ring), one machine", reports)  # fmt: skip
    if args.smoke:
        record.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
