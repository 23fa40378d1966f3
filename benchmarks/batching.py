"""Many conversations at once on the real Gemma 3 270M: our ``BatchGenerator`` against mlx-lm's
``batch_generate`` on the same converted folder, float32, the same fast BLAS, in one run.

    python -m benchmarks.batching [--batches 1,4,8,16 --prompt 128 --gen 32 --rounds 2]
    python -m benchmarks.batching --smoke   # a tiny random Gemma 3, a batch of 3, one round (benchmarks.smoke)

Each (stack, batch size) runs in its own process: ``B`` prompts of about ``--prompt`` tokens (BOS +
random ids, lengths staggered by 8 so the rows sit at different positions), ``--gen`` greedy tokens
each, EOS ignored. Aggregate decode tok/s = generated tokens / the time of the steps that only
decode (ours: steps with no admission; mlx-lm: its ``BatchGenerator.stats()`` generation rate).
Peak memory per request = MLX's peak allocation over the run / ``B`` (weights included, so it
falls with ``B``). Ceiling: one decode step reads the weights once for all rows, so aggregate
decode can reach ``B x`` bandwidth / weight bytes before compute binds.

``--system`` also times the first token of a request whose 2,000-token system prompt is already in
our prefix store, against the same request with an empty store (ours only: mlx-lm's
``batch_generate`` keeps no prefix store).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent


def prompts(batch: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [[2] + [int(x) for x in rng.integers(1000, 200000, length - 1 + 8 * i)] for i in range(batch)]


def run_ours(folder: str, batch: int, length: int, gen: int) -> dict:
    import models  # first: the fast BLAS loads before MLX (zoo_cpu.blas)

    import mlx.core as mx
    from models.generation.batch import BatchGenerator, BatchRequest

    model = models.load(folder, tokenizer=False)
    mx.reset_peak_memory()
    generator = BatchGenerator(model, max_batch=batch)
    for ids in prompts(batch, length):
        generator.submit(BatchRequest(ids, max_tokens=gen, stop_ids=frozenset()))
    decode_tokens, decode_seconds = 0, 0.0
    start = time.perf_counter()
    while generator.busy:
        admitting = generator.waiting > 0 or generator.prefilling > 0
        t = time.perf_counter()
        events = generator.step()
        if not admitting:
            decode_seconds += time.perf_counter() - t
            decode_tokens += sum(e.token is not None for e in events)
    total = time.perf_counter() - start
    return {"decode_tps": decode_tokens / decode_seconds, "total_s": total, "peak_gb": mx.get_peak_memory() / 1e9}


def run_mlx_lm(folder: str, batch: int, length: int, gen: int) -> dict:
    import zoo_cpu  # noqa: F401  (the same BLAS as ours, before MLX)

    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    mx.reset_peak_memory()
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=batch, prefill_batch_size=batch)
    start = time.perf_counter()
    generator.insert(prompts(batch, length), [gen] * batch)
    with generator.stats() as stats:
        while generator.next_generated():
            pass
    total = time.perf_counter() - start
    generator.close()
    return {"decode_tps": stats.generation_tps, "total_s": total, "peak_gb": mx.get_peak_memory() / 1e9}


def run_system_prompt(folder: str, length: int, gen: int) -> dict:
    """Time to first token of ``system + question`` with the system prompt stored vs not."""
    import models  # first: the fast BLAS loads before MLX (zoo_cpu.blas)

    import mlx.core as mx
    from models.generation.batch import BatchGenerator, BatchRequest
    from models.generation.prefix_store import PrefixStore

    model = models.load(folder, tokenizer=False)
    system = prompts(1, length)[0]
    questions = [[int(x) for x in q[1:40]] for q in prompts(3, 48)]
    result = {}
    warm_up = [2] + [int(x) for x in prompts(1, 64)[0][1:]]  # one-time costs (compiles, allocations) off the clock
    BatchGenerator(model, max_batch=1).run([BatchRequest(warm_up, max_tokens=2, stop_ids=frozenset())])
    for aligned in (True, False):
        store = PrefixStore(max_bytes=2 * 2**30, aligned=aligned)
        mode = "exact (aligned chunks)" if aligned else "at the common prefix (aligned=False)"
        for name, ids in (("no reuse", system + questions[0]), ("reuse", system + questions[1]), ("reuse again", system + questions[2])):
            generator = BatchGenerator(model, max_batch=1, prefix_store=store)
            generator.submit(BatchRequest(ids, max_tokens=gen, stop_ids=frozenset()))
            t = time.perf_counter()
            first = generator.step()
            result[f"{mode}: {name}"] = {"ttft_s": round(time.perf_counter() - t, 5), "reused": first[0].reused_tokens}
            while generator.busy:
                generator.step()
        result[f"{mode}: store MB"] = round(store.stats.bytes / 1e6, 1)
    mx.eval(mx.array(0))
    return result


def child(args) -> dict:
    if args.child == "system":
        return run_system_prompt(args.path, args.system_length, args.gen)
    run = run_ours if args.child == "ours" else run_mlx_lm
    return run(args.path, args.batch, args.prompt, args.gen)


def spawn(stack: str, folder: Path, args, batch: int = 1) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.batching", "--child", stack, "--path", str(folder), "--batch", str(batch),
           "--prompt", str(args.prompt), "--gen", str(args.gen), "--system-length", str(args.system_length)]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def shown(values: list[float], digits: int = 1) -> str:
    """``benchmarks.speed.cell`` (median [range]), or "-" when every run of the cell failed."""
    from benchmarks.speed import cell

    return cell(values, digits) if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,8,16")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; cells give the median [range]")
    parser.add_argument("--system", action="store_true", help="also time the first token with a stored system prompt")
    parser.add_argument("--system-length", type=int, default=2000)
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    from benchmarks.speed import bandwidth_gbs, gemma3_folder, weights_per_token

    folder = smoke.tiny_checkpoint("gemma3") if args.smoke else gemma3_folder()
    if args.smoke:
        # every stack once, at one batch size whose rows sit at different positions
        args.batches, args.prompt, args.gen, args.rounds, args.system, args.system_length = "3", 24, 4, 1, True, 64
    record = smoke.Record("batching")
    parameters, _ = weights_per_token(folder)
    weight_bytes = parameters * 4  # float32
    bandwidth = bandwidth_gbs(gib=0.125 if args.smoke else 1.0)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {}
    for round_ in range(args.rounds):
        for batch in batches:
            for stack in ("ours", "mlx-lm"):
                print(f"  {stack} B={batch} (round {round_ + 1}/{args.rounds}) ...", flush=True)
                results.setdefault((stack, batch), []).append(spawn(stack, folder, args, batch))
    lines = [
        f"Gemma 3 270M (real weights, float32, same BLAS), prompts ~{args.prompt} tokens staggered by 8, {args.gen} greedy "
        f"tokens each; median [range] of {args.rounds} rounds; bandwidth ceiling {bandwidth:.1f} GB/s "
        f"(weights {weight_bytes / 1e6:.0f} MB per step: {bandwidth * 1e9 / weight_bytes:.1f} steps/s); "
        f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
        "",
        "| batch | ours decode tok/s (aggregate) | mlx-lm decode tok/s | ours / mlx-lm | ours peak GB per request | mlx-lm peak GB per request |",
        "|---|---|---|---|---|---|",
    ]
    for (stack, batch), runs in results.items():
        for r in runs:
            if "error" in r:
                record.missing(f"{stack} B={batch}", r["error"], ours=stack == "ours", package="mlx_lm")
            else:
                record.row(f"{stack} B={batch}", ours=stack == "ours", decode=r["decode_tps"])
    for batch in batches:
        ours = [r for r in results[("ours", batch)] if "error" not in r]
        peer = [r for r in results[("mlx-lm", batch)] if "error" not in r]
        errors = [r["error"] for r in results[("ours", batch)] + results[("mlx-lm", batch)] if "error" in r]
        ratio = statistics.median(r["decode_tps"] for r in ours) / statistics.median(r["decode_tps"] for r in peer) if ours and peer else None
        lines.append(
            f"| {batch} | {shown([r['decode_tps'] for r in ours])} | {shown([r['decode_tps'] for r in peer])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {shown([r['peak_gb'] / batch for r in ours], 2)} | "
            f"{shown([r['peak_gb'] / batch for r in peer], 2)} |" + (f" errors: {errors}" if errors else "")
        )
    if args.system:
        system = spawn("system", folder, args)
        if "error" in system:
            record.missing("ours, stored system prompt", system["error"])
        else:
            record.row("ours, stored system prompt", **{k: v["ttft_s"] for k, v in system.items() if isinstance(v, dict)})
        lines += ["", f"First token with a {args.system_length}-token system prompt (ours, prefix store): {json.dumps(system)}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
