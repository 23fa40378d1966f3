"""One rank of the distributed tests: ``mlx.launch ... --python python3 -m tests.distributed_rank JOBS.json``.

Each job loads a tiny checkpoint split over the launched ranks (``models.parallel``) and writes
what it computed to ``{out}/{name}.rank{r}.npz``; the tests (``tests/test_distributed*.py``)
compare those files with the single-process model. The fault jobs make one rank die or stall
mid-generation; the others must then exit with a named error, which the tests read from stderr.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

import models
from models import parallel
from models.generation.generate import KVQuantization, SamplingOptions
from zoo_cpu import switches

import mlx.core as mx  # noqa: E402  (after models: the fast BLAS first)

JOB_TIMEOUT = 300


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (100, 150, 3), dtype=np.uint8)


def cached_logits(model, ids: list[int], chunks: list[int], kv: KVQuantization | None = None) -> np.ndarray:
    """Logits of ``ids`` fed through one cache in chunks of the given sizes (the rest in one read)."""
    cache, out, start = model.make_cache(), [], 0
    for size in chunks + [len(ids)]:
        end = min(len(ids), start + size)
        if end > start:
            out.append(np.array(model.logits([ids[start:end]], cache)))
            if kv is not None:
                kv.apply(cache)
        start = end
    return np.concatenate(out, axis=1)


def run(job: dict, group) -> dict[str, np.ndarray]:
    with switches.override(**job.get("switches", {})):
        return run_task(job, group)


def packed_layers(model) -> int:
    """How many layers of ``model`` run through the packed CPU kernels (``kernels``)."""
    from zoo_cpu import packed as zoo_packed

    return sum(isinstance(m, (zoo_packed.PackedLinear, zoo_packed.PackedEmbedding)) for _, m in model.graph.named_modules())


def run_task(job: dict, group) -> dict[str, np.ndarray]:
    rank = group.rank()
    folder = job["folders"][rank] if "folders" in job else job["folder"]
    options = {"dtype": job.get("dtype", "float32"), "q_bits": job.get("q_bits")}
    experts = job.get("experts_per_rank", [job.get("experts", "auto")] * group.size())[rank]
    sharding = parallel.sharding_for(job["mode"], group, options, experts=experts)
    model = models.load(folder, dtype=options["dtype"], tokenizer=False, q_bits=options["q_bits"], sharding=sharding)
    task, ids = job["task"], job.get("ids")
    kv = KVQuantization(job["kv_bits"], job.get("kv_group_size", 32), job.get("kv_start", 0)) if job.get("kv_bits") else None
    if task == "logits":
        full, cached = np.array(model.logits([ids])), cached_logits(model, ids, job.get("chunks", [7, 1]), kv)
        return {"full": full, "cached": cached, "packed_layers": np.array(packed_layers(model))}
    if task == "generate":
        watchdog = parallel.Watchdog(group, job.get("timeout", 60))
        die_after = job.get("die_after")
        tokens = []
        for chunk in model.stream(ids, max_tokens=job["max_tokens"], prefill_step_size=job.get("prefill_step", 16),
                                  sampling=SamplingOptions(**job.get("sampling", {})), kv_quantization=kv,
                                  should_stop=lambda: watchdog.arm("a generation step") or False):  # fmt: skip
            if chunk.token is not None:
                tokens.append(chunk.token)
            if die_after is not None and len(tokens) == die_after and rank == job.get("victim", 1):
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGSTOP if job.get("stall") else signal.SIGKILL)
        watchdog.disarm()
        return {"tokens": np.array(tokens)}
    if task == "image":
        prompt = model.prompt(ids, [image(s) for s in job["images"]], job.get("budget", 70))
        return {"ids": np.array(prompt.ids), "full": np.array(model.logits(prompt))}
    if task == "diffusion":
        cache = model.graph.make_cache()
        prompt = model.prompt(ids, [image(s) for s in job.get("images", [])], job.get("budget", 70))
        model.graph.prefill(mx.array([prompt.ids]), cache, [s.features for s in prompt.images] or None)
        canvas = mx.array([job["canvas"]])
        first = model.graph.denoise(canvas, cache)
        second = model.graph.denoise(canvas, cache, first)
        result = model.generate(prompt, seed=0, **job.get("generate", {}))
        return {"first": np.array(first), "second": np.array(second), "tokens": np.array(result.sequences)}
    raise ValueError(f"unknown task {task!r}")


def main(argv=None) -> int:
    (jobs_file,) = argv if argv is not None else sys.argv[1:]
    jobs = json.loads(Path(jobs_file).read_text())
    group = parallel.init()
    guard = parallel.Watchdog(group, JOB_TIMEOUT)  # no rank outlives a stuck job, whatever the test does
    try:
        for job in jobs:
            with parallel.rank_errors(group), guard.step(f"job {job['name']}"):
                results = run(job, group)
            np.savez(Path(job["out"]) / f"{job['name']}.rank{group.rank()}.npz", **results)
    except parallel.RankLostError as err:
        print(f"RankLostError: {err}", file=sys.stderr, flush=True)
        return parallel.EXIT_RANK_LOST
    except parallel.ParallelSetupError as err:
        print(f"ParallelSetupError: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"rank {group.rank()}: {len(jobs)} jobs done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
