"""EmbeddingGemma 300M: texts per second and peak memory, ours against sentence-transformers and mlx-embeddings.

    python -m benchmarks.embedding                 # 256 texts of mixed length, 3 rounds of every stack
    python -m benchmarks.embedding --q8 DIR        # and the 8-bit folder (models.convert --q-bits 8)
    python -m benchmarks.embedding --smoke         # 16 short texts: checks that every stack runs

Each stack runs in its own fresh process (``--worker STACK``), so its peak resident memory
(``ru_maxrss``: weights, activations, everything) is its own and no BLAS or thread setting of one
stack reaches another: sentence-transformers on torch float32 with 2 threads and without our BLAS
preload (``benchmarks.speed.PEER_ENV``); mlx-embeddings and ours on MLX's CPU. All embed the same
texts with the ``document`` prompt in batches of 32, after a warm-up batch; mlx-embeddings gets its
batches sorted by length (as sentence-transformers and ours sort), padded to the longest. Each
stack's vectors are compared with sentence-transformers' (the reference) as the lowest cosine.
The texts are paragraphs of this repository's docs cut to token lengths cycling through ``LENGTHS``.
Rounds run every stack once, in alternating order; the ratios to sentence-transformers are taken
within each round (the machine's load drifts between rounds) and reported as median [min-max].
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import smoke

ROOT = Path(__file__).resolve().parent.parent
STACKS = ("ours", "sentence-transformers", "mlx-embeddings")
LENGTHS = (16, 32, 64, 128, 256, 512)  # tokens of text before the prompt and special tokens
BATCH = 32


def texts(tokenizer, count: int, lengths) -> list[str]:
    """``count`` texts cut from the docs' paragraphs to token lengths cycling through ``lengths``."""
    words = " ".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    # The docs spell control tokens (`<image_soft_token>`, `<start_of_turn>`), which the tokenizer
    # parses as such; they are dropped so that every stack embeds ordinary text.
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    ids = [i for i in tokenizer(words, add_special_tokens=False)["input_ids"] if i not in special]
    out, start = [], 0
    for i in range(count):
        n = lengths[i % len(lengths)]
        start = (start + 997) % (len(ids) - n)
        out.append(tokenizer.decode(ids[start : start + n]))
    return out


def run_ours(folder: str, batch: list[str], warm: list[str]):
    import models

    model = models.load(folder)
    model.embed(warm, prompt_name="document", batch_size=BATCH)
    start = time.perf_counter()
    vectors = model.embed(batch, prompt_name="document", batch_size=BATCH)
    import mlx.core as mx

    return time.perf_counter() - start, vectors, f"mlx {mx.__version__}"


def run_sentence_transformers(folder: str, batch: list[str], warm: list[str]):
    import sentence_transformers
    import torch

    torch.set_num_threads(2)
    model = sentence_transformers.SentenceTransformer(folder, device="cpu")
    model.encode(warm, prompt_name="document", batch_size=BATCH)
    start = time.perf_counter()
    with torch.inference_mode():
        vectors = model.encode(batch, prompt_name="document", batch_size=BATCH, convert_to_numpy=True)
    return time.perf_counter() - start, vectors, f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}"


def run_mlx_embeddings(folder: str, batch: list[str], warm: list[str]):
    import mlx.core as mx
    import numpy as np
    from importlib.metadata import version
    from mlx_embeddings.utils import load

    model, tokenizer = load(folder)
    prompt = json.loads((Path(folder) / "config_sentence_transformers.json").read_text())["prompts"]["document"]

    def embed(items: list[str]) -> np.ndarray:
        order = sorted(range(len(items)), key=lambda i: -len(tokenizer._tokenizer(prompt + items[i])["input_ids"]))
        out = np.empty((len(items), 768), dtype=np.float32)
        for s in range(0, len(order), BATCH):
            chosen = order[s : s + BATCH]
            enc = tokenizer._tokenizer([prompt + items[i] for i in chosen], padding=True, return_tensors="np")
            result = model(mx.array(enc["input_ids"]), attention_mask=mx.array(enc["attention_mask"]))
            out[chosen] = np.array(result.text_embeds.astype(mx.float32))
        return out

    embed(warm)
    start = time.perf_counter()
    vectors = embed(batch)
    return time.perf_counter() - start, vectors, f"mlx-embeddings {version('mlx-embeddings')}"


PACKAGES = {"sentence-transformers": "sentence_transformers", "mlx-embeddings": "mlx_embeddings"}  # peers' import names
RUNNERS = {"ours": run_ours, "ours 8-bit": run_ours, "sentence-transformers": run_sentence_transformers, "mlx-embeddings": run_mlx_embeddings}


def worker(stack: str, folder: str, texts_file: str, vectors_file: str) -> None:
    import numpy as np

    batch = json.loads(Path(texts_file).read_text())
    start = time.perf_counter()
    seconds, vectors, notes = RUNNERS[stack](folder, batch, batch[:4])
    np.save(vectors_file, np.asarray(vectors, dtype=np.float32))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"seconds": seconds, "total": time.perf_counter() - start, "peak_mb": peak, "notes": notes}))


def run_worker(stack: str, folder: str, tmp: Path):
    """One stack's measurement in a fresh process: ``(result, vectors)`` or ``(why it failed, None)``."""
    import numpy as np

    out = tmp / f"{stack}.npy"
    env = {**os.environ, "GEMMA_ZOO_BLAS": "off"} if not stack.startswith("ours") else dict(os.environ)
    command = [sys.executable, "-m", "benchmarks.embedding", "--worker", stack, folder, str(tmp / "texts.json"), str(out)]
    done = subprocess.run(command, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if done.returncode != 0:
        return f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", None
    return json.loads(done.stdout.strip().splitlines()[-1]), np.load(out)


def lowest_cosine(a, b) -> float:
    import numpy as np

    return float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min())


def spread(values: list[float], digits: int = 2) -> str:
    """``median [min-max]`` of ``values``."""
    import numpy as np

    return f"{np.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="16 texts of 8-32 tokens; " + smoke.HELP)
    parser.add_argument("--model", default="embeddinggemma-300m", help="zoo name or local folder")
    parser.add_argument("--q8", metavar="FOLDER", help="also run the 8-bit folder (models.convert --q-bits 8) as 'ours 8-bit'")
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--count", type=int, default=256, help="texts (lengths cycling through LENGTHS)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each runs every stack once, the order alternating")
    parser.add_argument("--worker", nargs=4, metavar=("STACK", "FOLDER", "TEXTS", "VECTORS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return

    from models.loading import load_tokenizer, model_folder

    folder = model_folder(args.model)
    tokenizer = load_tokenizer(folder, None)._tokenizer
    count, lengths, rounds = (16, (8, 16, 32), 1) if args.smoke else (args.count, LENGTHS, args.rounds)
    batch = texts(tokenizer, count, lengths)
    tokens = sum(len(tokenizer("title: none | text: " + t)["input_ids"]) for t in batch)
    stacks = [s.strip() for s in args.stacks.split(",")] + (["ours 8-bit"] if args.q8 else [])
    folders = {stack: str(args.q8 if stack == "ours 8-bit" else folder) for stack in stacks}
    print(f"{count} texts, {tokens} tokens with the document prompt (lengths cycling {lengths}), batches of {BATCH}, "
          f"{rounds} round(s); load average {os.getloadavg()[0]:.1f} at the start on {os.cpu_count()} CPUs.", flush=True)  # fmt: skip
    results: dict[str, list[dict]] = {s: [] for s in stacks}
    vectors, failed, loads = {}, {}, [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "texts.json").write_text(json.dumps(batch))
        for r in range(rounds):
            for stack in stacks if r % 2 == 0 else stacks[::-1]:
                if stack in failed:
                    continue
                result, got = run_worker(stack, folders[stack], Path(tmp))
                loads.append(os.getloadavg()[0])
                if got is None:
                    failed[stack] = result
                    print(f"{stack}: failed ({result})", flush=True)
                    continue
                result["round"] = r
                results[stack].append(result)
                vectors[stack] = got
                print(f"round {r + 1} {stack}: {count / result['seconds']:.2f} texts/s, peak {result['peak_mb']:.0f} MB, "
                      f"load {loads[-1]:.1f} ({result['notes']})", flush=True)  # fmt: skip
    rows = [(stack, results[stack]) for stack in stacks if results[stack]]
    reference = vectors.get("sentence-transformers")
    base = {res["round"]: res["seconds"] for res in results.get("sentence-transformers", [])}
    print("\n| stack | texts/s | x sentence-transformers (per round) | peak RSS (MB) | lowest cosine to sentence-transformers |\n|---|---|---|---|---|")
    for stack, done in rows:
        speeds = [count / res["seconds"] for res in done]
        ratios = [base[res["round"]] / res["seconds"] for res in done if res["round"] in base]
        cosine = f"{lowest_cosine(vectors[stack], reference):.6f}" if reference is not None else "-"
        ratio = spread(ratios) + "x" if ratios else "-"
        print(f"| {stack} | {spread(speeds)} | {ratio} | {max(res['peak_mb'] for res in done):.0f} | {cosine} |")
    print(f"\nLoad average {min(loads):.1f}-{max(loads):.1f} over the run ({loads[-1]:.1f} at the end); medians [min-max] of the rounds.")
    if args.smoke:
        smoke_record([(stack, done[0]) for stack, done in rows], vectors, failed, count).finish()


def smoke_record(rows, vectors, failed, count) -> smoke.Record:
    """Every stack a row (a peer not installed says so), and each within cosine 0.9999 of
    sentence-transformers, the reference (a stack further off has no valid row)."""
    record = smoke.Record("embedding")
    reference = vectors.get("sentence-transformers")
    for stack, result in rows:
        if reference is not None:
            cosine = lowest_cosine(vectors[stack], reference)
            if cosine < 0.9999:
                record.missing(stack, f"lowest cosine to sentence-transformers {cosine:.6f} < 0.9999", ours=stack.startswith("ours"))
                continue
        record.row(stack, ours=stack.startswith("ours"), texts_per_s=count / result["seconds"])
    for stack, reason in failed.items():
        record.missing(stack, reason, ours=stack.startswith("ours"), package=PACKAGES.get(stack))
    return record


if __name__ == "__main__":
    main()
