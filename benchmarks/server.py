"""Our server against ``mlx_lm.server``: throughput and latency at 1, 4 and 16 concurrent clients.

    python -m benchmarks.server                       # the real Gemma 3 270M (float32 folder)
    python -m benchmarks.server --clients 1 4 --requests 2 --gen 32
    python -m benchmarks.server --smoke   # 1 and 2 clients, one request each, 4 tokens (benchmarks.smoke)

Both servers run as subprocesses on the same converted folder (``models.assets.gemma3_270m``) with
the same BLAS (``mlx_lm.server`` is started through ``MLX_LM_WITH_OUR_BLAS``, which imports
``zoo_cpu`` first so that MKL is loaded under its MLX too), in float32, greedy, batching up to ``--batch`` requests (``--max-batch`` /
``--decode-concurrency``). Each client sends ``--requests`` streamed ``/v1/completions`` requests
one after another, each with its own prompt (random words, ``--prompt`` tokens or so, never
repeated, so no prompt cache helps either side) and ``max_tokens=--gen``.

Per level: throughput = all completion tokens (as each server's usage reports them) / wall time
from the first request sent to the last answer received; latency = each request's time to its
last byte, time to first token = to its first text; p50 and p99 over the level's requests (with a
few dozen requests p99 is close to the maximum). Both servers are up at once and each level runs
``--repeats`` times, alternating which server goes first; cells are medians with the [range]. The
machine is a shared 2-core VM whose load swings 2x: read the ratios, not the digits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("lighthouse keeper storm harbour lantern rope gull tide island ship captain night wave rock beacon "
         "fog bell sailor map compass anchor coast cliff wind rain salt boat net fisher dawn").split()  # fmt: skip


def prompts(n: int, words: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(n)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# mlx-lm's command line with the zoo's BLAS loaded first (the zoo installs nothing into other programs).
MLX_LM_WITH_OUR_BLAS = "import sys, runpy, zoo_cpu; sys.argv[0] = 'mlx_lm'; runpy.run_module('mlx_lm', run_name='__main__')"


def start(stack: str, folder: Path, port: int, batch: int, gen: int) -> subprocess.Popen:
    if stack == "ours":
        cmd = [sys.executable, "-m", "examples.serve", "--model", str(folder), "--model-id", "m", "--port", str(port),
               "--max-batch", str(batch), "--max-queue", "256", "--max-tokens", str(gen)]  # fmt: skip
    else:
        cmd = [sys.executable, "-c", MLX_LM_WITH_OUR_BLAS, "server", "--model", str(folder), "--port", str(port),
               "--decode-concurrency", str(batch), "--max-tokens", str(gen), "--log-level", "WARNING"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become ready")


def one_request(client, model: str, prompt: str, gen: int) -> dict:
    sent = time.perf_counter()
    first = None
    tokens = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=gen, temperature=0.0, stream=True,
                                           stream_options={"include_usage": True}):  # fmt: skip
        if chunk.choices and chunk.choices[0].text and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    done = time.perf_counter()
    return {"latency": done - sent, "ttft": (first or done) - sent, "tokens": tokens}


def level(url: str, model: str, clients: int, requests: int, gen: int, words: int, seed: int) -> dict:
    import openai

    texts = prompts(clients * requests, words, seed)
    results: list[dict] = []
    errors: list[str] = []

    def client(index: int) -> None:
        api = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        for r in range(requests):
            try:
                results.append(one_request(api, model, texts[index * requests + r], gen))
            except Exception as err:  # noqa: BLE001 -- reported in the table
                errors.append(repr(err))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start_time = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_time
    lat = sorted(r["latency"] for r in results)
    ttft = sorted(r["ttft"] for r in results)

    def pct(values, q):
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")

    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "errors": errors[:3], "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99), "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99), "mean_tokens": statistics.mean(r["tokens"] for r in results) if results else 0}  # fmt: skip


def run_all(folder: Path, args) -> dict[str, list[list[dict]]]:
    """Both servers up at once; each level runs ``--repeats`` times, alternating which goes first
    (an idle server takes no CPU), so both see the same spells of the shared machine's load."""
    stacks = ("ours", "mlx_lm.server")
    ports = {stack: free_port() for stack in stacks}
    urls = {stack: f"http://127.0.0.1:{ports[stack]}" for stack in stacks}
    names = {"ours": "m", "mlx_lm.server": str(folder)}
    processes = {stack: start(stack, folder, ports[stack], args.batch, args.gen) for stack in stacks}
    results: dict[str, list[list[dict]]] = {stack: [[] for _ in args.clients] for stack in stacks}
    try:
        for stack in stacks:
            wait_ready(urls[stack], processes[stack])
            level(urls[stack], names[stack], 1, 1, 8, args.words, seed=999)  # warm-up
        for i, clients in enumerate(args.clients):
            for repeat in range(args.repeats):
                for stack in stacks if repeat % 2 == 0 else reversed(stacks):
                    run = level(urls[stack], names[stack], clients, args.requests, args.gen, args.words, seed=100 * repeat + clients)
                    results[stack][i].append(run)
    finally:
        for process in processes.values():
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
    return results


def summary(runs: list[dict], key: str) -> tuple[float, str]:
    values = [r[key] for r in runs]
    middle = statistics.median(values)
    return middle, f"{middle:.2f} [{min(values):.2f}-{max(values):.2f}]" if len(values) > 1 else f"{middle:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    p.add_argument("--repeats", type=int, default=2, help="runs of each level per server, alternating the order")
    p.add_argument("--gen", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--words", type=int, default=60, help="words per prompt (about 1.3 tokens each)")
    p.add_argument("--batch", type=int, default=16, help="rows decoded together by either server")
    p.add_argument("--folder", help="serve this converted folder with both servers (default: the float32 270M; e.g. "
                   "the 8-bit .assets/gemma-3-270m-8bit-g64-e8g64-f16-v2, which mlx_lm.server loads too)")  # fmt: skip
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    args = p.parse_args()
    if args.smoke:
        args.clients, args.requests, args.repeats, args.gen, args.words, args.batch = [1, 2], 1, 1, 4, 12, 2
    record = smoke.Record("server")

    from models.assets.gemma3_270m import gemma3_270m_folder

    folder = Path(args.folder) if args.folder else gemma3_270m_folder()
    results = run_all(folder, args)
    print(f"Gemma 3 270M ({folder.name}), {args.requests} streamed completions per client, ~{args.words} words in, "
          f"max {args.gen} tokens out, batch {args.batch}, {args.repeats} alternating repeats (median [range]); "
          f"{os.cpu_count()} CPUs (shared), load average {os.getloadavg()[0]:.1f} at the end\n")  # fmt: skip
    print("| clients | stack | tokens per run | tok/s | latency p50 s | latency p99 s | first token p50 s | first token p99 s "
          "| throughput ours / peer | p50 peer / ours |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, clients in enumerate(args.clients):
        ours, peer = results["ours"][i], results["mlx_lm.server"][i]
        ratio = summary(ours, "tok_s")[0] / summary(peer, "tok_s")[0]
        p50 = summary(peer, "p50_s")[0] / summary(ours, "p50_s")[0]
        for name, runs in (("ours", ours), ("mlx_lm.server", peer)):
            cells = [summary(runs, key)[1] for key in ("tok_s", "p50_s", "p99_s", "ttft_p50_s", "ttft_p99_s")]
            extra = f"{ratio:.2f}x | {p50:.2f}x" if name == "ours" else " | "
            print(f"| {clients} | {name} | {runs[0]['tokens']} | {' | '.join(cells)} | {extra} |")
            errors = [e for r in runs for e in r["errors"]]
            if errors:
                print(f"|  | errors | {errors[:3]} |")
                record.missing(f"{name} {clients} clients", f"errors: {errors[:3]}", ours=name == "ours", package="mlx_lm")
            elif all(r["requests"] == clients * args.requests and r["tokens"] for r in runs):
                record.row(f"{name} {clients} clients", ours=name == "ours", tok_s=summary(runs, "tok_s")[0])
            else:
                record.missing(f"{name} {clients} clients", f"answered {[r['requests'] for r in runs]} requests, "
                               f"{[r['tokens'] for r in runs]} tokens", ours=name == "ours", package="mlx_lm")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.smoke:
        record.finish()


if __name__ == "__main__":
    main()
