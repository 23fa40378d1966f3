"""Speed on the CPU it runs on, in one go: our stack against the peers, each in its own process.

    python -m benchmarks.speed                       # Gemma 3 270M (real) + E2B-shaped random Gemma 4
    python -m benchmarks.speed --models gemma3 --skip llama.cpp --runs 3 --gen 128
    python -m benchmarks.speed --ablations           # what each of our speed-ups buys (270M)
    python -m benchmarks.speed --models gemma3 --prompt-tokens 512,8192,32768 --skip torch,"mlx-lm stock"
    python -m benchmarks.speed --smoke               # tiny random checkpoints, every stack once (benchmarks.smoke)

Workload: a ``--prompt``-token prompt (BOS + random ids in [1000, 200000),
``numpy.random.default_rng(0)``, the same for every stack), then ``--gen`` greedy tokens with EOS
ignored; one short warm-up (64 + 8) and ``--runs`` timed runs per process. ``--prompt-tokens``
runs the whole table at each of several prompt lengths (long contexts: the decode ceiling then
counts the keys and values every step reads). ``--sampling checkpoint`` draws the tokens as the
checkpoint's ``generation_config.json`` asks (Gemma: temperature 1, top_k 64, top_p 0.95), each
stack with its own sampler (ours ``TokenSampler``, mlx-lm ``make_sampler``, transformers
``generate(do_sample=True)``, llama.cpp ``Llama.sample``): what a chat or a server runs by default;
``--sampling greedy,checkpoint`` makes a table of each.
prefill tok/s = prompt / time to first token; decode tok/s = (n - 1) / (last token - first token).
Peak memory is the process's peak RSS (``getrusage``: Python, libraries, weights, caches). Each
cell is the median of the runs with the [min-max] range: a shared machine is noisy.

The ceiling is the memory bandwidth this run measures (numpy, 2 threads each reading half of a
1 GiB float32 array with ``max``, best of 7): decode can go no faster than bandwidth / bytes read per token (the
weights every token multiplies by, in the stack's storage dtype, plus the KV cache read at the
mean decode position). Stacks:

- ``ours``: ``models.load`` + ``models.generation.generate.generate_tokens``, out of the box (the fast BLAS
  preload, ``dtype="auto"``, the head layout, the compiled decode pieces);
- ``ours 8-bit`` / ``ours 4-bit``: the same on a pre-quantized folder under the zoo's policies
  (8-bit g64; 4-bit g32 layers with an 8-bit g64 embedding and tied head, the shape of llama.cpp's
  Q4_K_M with its Q8_0 embedding; float16 scales), written once by ``models.convert`` (the 270M:
  the zoo's ``gemma-3-270m-8bit`` / ``-4bit``), run through the packed kernels (``kernels``), the
  CPU default for quantized weights;
- ``mlx-lm stock``: ``mlx_lm`` as a user gets it (bf16, as Hub checkpoints are; bundled BLAS);
- ``mlx-lm + BLAS``: ``mlx_lm`` in float32 with the same BLAS as ours loaded before MLX;
- ``torch``: transformers ``generate`` on PyTorch CPU in float32, 2 threads, sdpa;
- ``llama.cpp``: llama-cpp-python (built from source) on the Q4_K_M GGUF the 270M ships as,
  ``use_extra_bufts=False`` (the AMX/REPACK buffers segfault on AMX machines); skipped when the
  package is not installed.

The peers (torch, llama.cpp) run as their users get them: their processes import nothing of the
zoo and get the environment this benchmark was started with (``PEER_ENV``), plus
``GEMMA_ZOO_BLAS=off`` so that nothing loads MKL into them even if a zoo module were imported. MKL's Intel OpenMP, once in a process, also takes over
the OpenMP calls of libraries loaded after it (llama.cpp's ggml, torch), with our ``KMP_BLOCKTIME=0``
(docs/speed.md, "Measured").
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
# The peers' environment: as this process was started (before any zoo import set MKL's defaults),
# and no BLAS preload.
PEER_ENV = {**os.environ, "GEMMA_ZOO_BLAS": "off"}
PEERS = ("torch", "llama.cpp")
STACKS = ("ours", "ours 8-bit", "ours 4-bit", "mlx-lm stock", "mlx-lm + BLAS", "torch", "llama.cpp")
# Our quantized rows: stack -> bits, on a folder from quantized_folder() under the zoo's policy for
# those bits (models.zoo.QUANTIZED_270M; for the 270M the zoo's gemma-3-270m-8bit / -4bit).
QUANTIZED = {"ours 8-bit": 8, "ours 4-bit": 4}
# --sampling checkpoint: what the released Gemma 3 and 4 checkpoints' generation_config.json asks
# (do_sample, top_k 64, top_p 0.95, transformers' temperature 1.0).
CHECKPOINT_SAMPLING = {"temp": 1.0, "top_k": 64, "top_p": 0.95}
# name -> (stack, extra environment, child options); the ablations run on the 270M only.
ABLATIONS = {
    "ours (all on)": ("ours", {}, {}),
    "MLX's exp, tanh and RoPE on the CPU (GEMMA_ZOO_FAST_MATH=0)": ("ours", {"GEMMA_ZOO_FAST_MATH": "0"}, {}),
    "no compiled decode pieces (GEMMA_ZOO_COMPILE=0)": ("ours", {"GEMMA_ZOO_COMPILE": "0"}, {}),
    "decode step not compiled whole (GEMMA_ZOO_COMPILE_STEP=0)": ("ours", {"GEMMA_ZOO_COMPILE_STEP": "0"}, {}),
    "no decode kernels (GEMMA_ZOO_DECODE_KERNELS=0)": ("ours", {"GEMMA_ZOO_DECODE_KERNELS": "0"}, {}),
    "one CPU stream: head and MLP not split (GEMMA_ZOO_STREAMS=0)": ("ours", {"GEMMA_ZOO_STREAMS": "0"}, {}),
    "head neither transposed nor split": ("ours", {}, {"no_relayout": True}),
    "mlx-lm's overlap (next step queued with mx.async_eval before the token is read)": ("ours", {}, {"overlap": True}),
    "bfloat16 weights (--dtype bfloat16)": ("ours", {}, {"dtype": "bfloat16", "short": True}),
    "bundled reference BLAS (GEMMA_ZOO_BLAS=off)": ("ours", {"GEMMA_ZOO_BLAS": "off"}, {"short": True}),
    "OpenBLAS (GEMMA_ZOO_BLAS=openblas)": ("ours", {"GEMMA_ZOO_BLAS": "openblas"}, {}),
    "MKL threads spin 200 ms (KMP_BLOCKTIME=200, MKL's default)": ("ours", {"KMP_BLOCKTIME": "200"}, {}),
    "8-bit folder, packed kernels (default CPU policy)": ("ours 8-bit", {}, {}),
    "8-bit folder, dequantized on load": ("ours 8-bit", {"GEMMA_ZOO_CPU_QUANT": "dequantize"}, {}),
    "8-bit folder, MLX's quantized matmul, float32 scales": ("ours 8-bit", {"GEMMA_ZOO_CPU_QUANT": "fp32-scales"}, {"short": True}),
    "4-bit folder, packed kernels (default CPU policy)": ("ours 4-bit", {}, {}),
    "4-bit folder, no decode kernels (GEMMA_ZOO_DECODE_KERNELS=0)": ("ours 4-bit", {"GEMMA_ZOO_DECODE_KERNELS": "0"}, {}),
    "4-bit folder, dequantized on load": ("ours 4-bit", {"GEMMA_ZOO_CPU_QUANT": "dequantize"}, {}),
    "4-bit folder, MLX's quantized matmul, float32 scales": ("ours 4-bit", {"GEMMA_ZOO_CPU_QUANT": "fp32-scales"}, {"short": True}),
}


# ---------------------------------------------------------------------------------------- models
def gemma3_folder() -> Path:
    from models.assets.gemma3_270m import gemma3_270m_folder

    return gemma3_270m_folder()


def gemma4_folder() -> Path:
    from benchmarks.gemma4_text_vs_mlx_lm import build_checkpoint

    return build_checkpoint()


def gemma3_gguf() -> Path:
    from models.assets.gemma3_270m import gemma3_270m_gguf

    return gemma3_270m_gguf()


MODELS = {"gemma3": ("Gemma 3 270M (real weights)", gemma3_folder), "gemma4": ("Gemma 4 E2B-shaped (random)", gemma4_folder)}


def quantized_folder(folder: Path, bits: int) -> Path:
    """``folder`` quantized under the zoo's ``bits``-bit policy by ``models.convert``, once, beside
    it; the 270M's is the zoo's own folder."""
    from models.assets.gemma3_270m import gemma3_270m_folder
    from models.zoo import QUANTIZED_270M, ZOO, policy_name

    if folder == gemma3_270m_folder():
        return ZOO[f"gemma-3-270m-{bits}bit"]()
    out = folder.with_name(f"{folder.name}-{policy_name(QUANTIZED_270M[bits])}")
    if not (out / "config.json").is_file():
        from models.convert import convert

        convert(str(folder), out, q_policy=QUANTIZED_270M[bits])
    return out


def prompt_ids(n: int) -> list[int]:
    import numpy as np

    return [2] + np.random.default_rng(0).integers(1000, 200000, n - 1).tolist()


def weights_per_token(folder: Path) -> tuple[int, dict]:
    """Parameters every decoded token multiplies by (all but gather-only tables) and the config."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    count = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            for key in f.keys():
                if "embed_tokens_per_layer" in key:
                    continue
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                count += n
    return count, config


def kv_bytes_per_token(config: dict, mean_position: int, item: int) -> int:
    """KV cache bytes a decode step reads at ``mean_position`` (sliding layers read their window)."""
    text = config.get("text_config", config)
    layers = text.get("layer_types") or []
    window = text.get("sliding_window") or mean_position
    total = 0
    for kind in layers:  # a KV-shared layer reads its donor's cache again: every layer counts
        full = kind == "full_attention"
        dim = (text.get("global_head_dim") or text.get("head_dim")) if full else text.get("head_dim")
        heads = (text.get("num_global_key_value_heads") or text.get("num_key_value_heads")) if full else text.get("num_key_value_heads")
        rows = mean_position if full else min(window, mean_position)
        total += 2 * rows * heads * dim * item
    return total


# ---------------------------------------------------------------------------------------- children
def child(stack: str, folder: str, n_prompt: int, gen: int, runs: int, options: dict) -> dict:
    prompt = prompt_ids(n_prompt)
    run = {"ours": run_ours, "ours 8-bit": run_ours, "ours 4-bit": run_ours, "mlx-lm stock": run_mlx_lm,
           "mlx-lm + BLAS": run_mlx_lm, "torch": run_torch, "llama.cpp": run_llama}[stack]  # fmt: skip
    state = setup(stack, Path(folder), options)
    state["sampling"] = options.get("sampling")
    run(state, prompt[:64], 8)  # warm-up
    results = [run(state, prompt, gen) for _ in range(runs)]
    if stack in PEERS:
        check_clean(stack)
    return {
        "prefill": [n_prompt / r[0] for r in results],
        "decode": [(len(r[2]) - 1) / r[1] for r in results],
        "peak_rss_gb": peak_rss_gb(),
        "ids": results[-1][2][:8],
        "item_bytes": state.get("item_bytes", 4),
        "weight_bytes": state.get("weight_bytes"),
        "notes": state.get("notes", ""),
    }


def peak_rss_gb() -> float:
    """This process's peak resident set (``VmHWM``). Not ``getrusage``'s ``ru_maxrss``: Linux keeps
    that across ``exec``, so a child would report the parent's peak (the bandwidth probe's array)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("/proc/self/status has no VmHWM line")


def check_clean(stack: str) -> None:
    """Refuse a peer's result from a process that loaded a BLAS of ours or MLX."""
    loaded = [name for name in ("mlx.core",) if name in sys.modules]
    blas = sys.modules.get("zoo_cpu.blas")
    if blas is not None and blas.info()["loaded"]:
        loaded.append(blas.info()["name"])
    if loaded:
        raise RuntimeError(f"the {stack} process loaded {', '.join(loaded)}: its numbers would not be a user's")


def setup(stack: str, folder: Path, options: dict) -> dict:
    """A stack loaded from ``folder`` (llama.cpp: the GGUF file) and ready to ``run``."""
    if stack in ("ours", *QUANTIZED):
        import zoo_cpu

        import mlx.core as mx
        import models

        kwargs = {"tokenizer": False}
        if options.get("dtype"):
            kwargs["dtype"] = options["dtype"]
        model = models.load(str(folder), **kwargs)
        graph = model.graph
        if options.get("no_relayout"):
            head = graph["lm_head"] if "lm_head" in graph else graph["embed_tokens"]
            head.weight = mx.contiguous(head.weight)
            mx.eval(head.weight)
        from mlx.utils import tree_flatten

        nbytes = sum(a.nbytes for k, a in tree_flatten(graph.parameters()) if "embed_tokens_per_layer" not in k)
        dtype = graph.embed_tokens.get("scales", graph.embed_tokens.weight).dtype if "embed_tokens" in graph else mx.float32
        blas = zoo_cpu.blas.info()
        notes = [f"{blas['name']} {blas['version'] or ''}".strip(), model.precision.describe().split(" (")[0],
                 *(n.split(" (")[0].split(":")[0] for n in model.device_notes)]
        return {"model": model, "overlap": options.get("overlap"), "weight_bytes": nbytes,
                "item_bytes": dtype.size, "notes": "; ".join(notes)}  # fmt: skip
    if stack in ("mlx-lm stock", "mlx-lm + BLAS"):
        if stack == "mlx-lm + BLAS":
            import zoo_cpu  # noqa: F401  (before mlx, as ours)
        import mlx.core as mx
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load_model

        model, _ = load_model(folder)
        dtype = mx.bfloat16 if stack == "mlx-lm stock" else mx.float32
        model.set_dtype(dtype)
        mx.eval(model.parameters())
        nbytes = sum(a.nbytes for k, a in tree_flatten(model.parameters()) if "embed_tokens_per_layer" not in k)
        blas = __import__("zoo_cpu").blas.info() if stack == "mlx-lm + BLAS" else {}
        notes = "bf16, bundled reference BLAS" if stack == "mlx-lm stock" else f"fp32, {blas['name']} {blas['version'] or ''}"

        return {"model": model, "weight_bytes": nbytes, "item_bytes": dtype.size, "notes": notes}
    if stack == "torch":
        import torch
        from transformers import AutoModelForCausalLM

        threads = options.get("threads", 2)
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
        nbytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "embed_tokens_per_layer" not in n)
        return {"model": model, "weight_bytes": nbytes, "item_bytes": 4,
                "notes": f"torch {torch.__version__}, fp32, {threads} thread{'s' if threads > 1 else ''}"}  # fmt: skip
    if stack == "llama.cpp":
        import llama_cpp
        import llama_cpp.llama as llama_module

        gguf = folder
        default_params = llama_cpp.llama_model_default_params

        def no_extra_buffers():
            params = default_params()
            params.use_extra_bufts = False  # the AMX / REPACK buffer types segfault on AMX CPUs
            return params

        llama_module.llama_cpp.llama_model_default_params = no_extra_buffers
        threads = options.get("threads", 2)
        llm = llama_cpp.Llama(str(gguf), n_ctx=options.get("n_ctx", 1024), n_batch=512, n_threads=threads, verbose=False)
        return {"model": llm, "weight_bytes": gguf.stat().st_size, "item_bytes": 2,
                "notes": f"llama-cpp-python {llama_cpp.__version__}, {gguf.name}, {threads} threads, use_extra_bufts=False"}  # fmt: skip
    raise ValueError(stack)


def run_ours(state: dict, prompt: list[int], gen: int):
    from models.generation.generate import SamplingOptions, generate_tokens

    model = state["model"]
    cache = model.make_cache()
    start = time.perf_counter()
    overlap = state["overlap"] if state.get("overlap") is not None else model.overlap  # the plan's, as Model.stream
    sampling = SamplingOptions(**state["sampling"]) if state.get("sampling") else None
    # Model.stream's loop: _forward (ids checked once, not waited for at every token)
    tokens = generate_tokens(model._forward, prompt, cache, max_tokens=gen, overlap=overlap, sampling=sampling)
    ids = [next(tokens)]
    first = time.perf_counter()
    ids += list(tokens)
    return first - start, time.perf_counter() - first, ids


def run_mlx_lm(state: dict, prompt: list[int], gen: int):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    sampler = None
    if state.get("sampling"):
        from mlx_lm.sample_utils import make_sampler

        o = state["sampling"]
        sampler = make_sampler(temp=o["temp"], top_p=o["top_p"], top_k=o["top_k"])
    start = time.perf_counter()
    steps = generate_step(mx.array(prompt), state["model"], max_tokens=gen, sampler=sampler)
    ids = [int(next(steps)[0])]
    first = time.perf_counter()
    ids += [int(t) for t, _ in steps]
    return first - start, time.perf_counter() - first, ids


def run_torch(state: dict, prompt: list[int], gen: int):
    import torch
    from transformers.generation.streamers import BaseStreamer

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.first = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2:  # the first call is the prompt
                self.first = time.perf_counter()

        def end(self):
            pass

    streamer = FirstToken()
    start = time.perf_counter()
    with torch.no_grad():
        o = state.get("sampling")
        drawn = dict(do_sample=True, temperature=o["temp"], top_k=o["top_k"], top_p=o["top_p"]) if o else dict(do_sample=False)
        out = state["model"].generate(
            torch.tensor([prompt]), max_new_tokens=gen, min_new_tokens=gen, eos_token_id=None, pad_token_id=0,
            streamer=streamer, **drawn,
        )
    end = time.perf_counter()
    ids = out[0, len(prompt):].tolist()
    return streamer.first - start, end - streamer.first, ids


def run_llama(state: dict, prompt: list[int], gen: int):
    import llama_cpp
    import numpy as np

    llm = state["model"]
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)

    o = state.get("sampling")

    def argmax() -> int:
        if o:  # llama.cpp's own sampler chain, nothing but the checkpoint's filters on
            return int(llm.sample(top_k=o["top_k"], top_p=o["top_p"], min_p=0.0, temp=o["temp"], repeat_penalty=1.0))
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llm.n_vocab(),))))

    ids = [argmax()]
    first = time.perf_counter()
    for _ in range(gen - 1):
        llm.eval([ids[-1]])
        ids.append(argmax())
    return first - start, time.perf_counter() - first, ids


# ---------------------------------------------------------------------------------------- parent
def bandwidth_gbs(threads: int = 2, gib: float = 1.0, repeats: int = 7) -> float:
    """Read bandwidth: ``threads`` numpy threads each taking the max of its share of a ``gib`` GiB
    float32 array (a reduction that does one compare per element, so the read is what limits it);
    the best of ``repeats``, as a ceiling is what the machine can do, not what it did on average."""
    import numpy as np

    a = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(a, threads)
    speeds = []
    for _ in range(repeats):
        workers = [threading.Thread(target=p.max) for p in parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        speeds.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    return max(speeds)


def spawn(stack: str, folder: Path, args, env: dict | None = None, options: dict | None = None) -> dict:
    options = options or {}
    if stack == "mlx-lm stock":  # as a user gets it: MLX's bundled BLAS
        env = {"GEMMA_ZOO_BLAS": "off", **(env or {})}
    gen, runs = (min(args.gen, 32), 1) if options.get("short") else (args.gen, args.runs)
    cmd = [sys.executable, "-m", "benchmarks.speed", "--child", stack, "--path", str(folder), "--prompt",
           str(args.prompt), "--gen", str(gen), "--runs", str(runs), "--options", json.dumps(options)]  # fmt: skip
    base = PEER_ENV if stack in PEERS else os.environ
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**base, **(env or {})})
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result.update(gen=gen, runs=runs)
    return result


def merge(old: dict | None, new: dict) -> dict:
    """Pool a stack's runs over rounds (peak RSS: the largest)."""
    if old is None or "error" in old:
        return new
    if "error" in new:
        return old
    merged = dict(new)
    for key in ("prefill", "decode"):
        merged[key] = old[key] + new[key]
    merged["peak_rss_gb"] = max(old["peak_rss_gb"], new["peak_rss_gb"])
    merged["runs"] = old["runs"] + new["runs"]
    return merged


def cell(values: list[float], digits: int = 1) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def table(title: str, rows: dict, ours_key: str, bandwidth: float, kv_of) -> str:
    lines = [f"### {title}", "",
             "| stack | prefill tok/s | decode tok/s | peak RSS GB | prefill vs ours | decode vs ours | RSS vs ours "
             "| decode % of ceiling | notes |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ours = rows.get(ours_key, {})
    for name, r in rows.items():
        if "error" in r or "skipped" in r:
            lines.append(f"| {name} | - | - | - | - | - | - | - | {r.get('error') or r.get('skipped')} |")
            continue
        p, d = statistics.median(r["prefill"]), statistics.median(r["decode"])
        ratio = lambda a, b: f"{a / b:.2f}x" if b else "-"  # noqa: E731
        po = statistics.median(ours["prefill"]) if "prefill" in ours else 0
        do = statistics.median(ours["decode"]) if "decode" in ours else 0
        per_token = r["weight_bytes"] + kv_of(r["item_bytes"])
        ceiling = bandwidth * 1e9 / per_token
        short = f"; G={r['gen']}, {r['runs']} run" if r["runs"] == 1 else ""
        lines.append(
            f"| {name} | {cell(r['prefill'])} | {cell(r['decode'], 2)} | {r['peak_rss_gb']:.2f} | {ratio(p, po)} | "
            f"{ratio(d, do)} | {ratio(r['peak_rss_gb'], ours.get('peak_rss_gb', 0))} | {100 * d / ceiling:.0f}% of "
            f"{ceiling:.1f} ({per_token / 1e6:.0f} MB/token) | {r['notes']}{short} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--prompt-tokens", help="comma-separated prompt lengths, a table each (e.g. 512,8192,32768); "
                                                "overrides --prompt")  # fmt: skip
    parser.add_argument("--gen", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", default="gemma3,gemma4", help="comma-separated: gemma3, gemma4")
    parser.add_argument("--skip", default="", help="comma-separated stacks to leave out, e.g. 'llama.cpp,torch'")
    parser.add_argument("--ablations", action="store_true", help="our stack with each speed-up taken away (270M)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the whole list of stacks this many times, interleaved (a noisy box: "
                             "a slow spell then hits every stack, not one); cells pool all runs")  # fmt: skip
    parser.add_argument("--only", default="", help="run only the rows whose name contains this text")
    parser.add_argument("--sampling", default="greedy",
                        help="comma-separated: greedy, checkpoint (temperature 1, top_k 64, top_p 0.95, each stack's sampler); a table each")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    parser.add_argument("--smoke", action="store_true", help=smoke.HELP)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.prompt, args.gen, args.runs, json.loads(args.options))))
        return
    if args.smoke:
        args.prompt_tokens, args.gen, args.runs, args.rounds = "32", 4, 1, 1
    lengths = [int(n) for n in (args.prompt_tokens or str(args.prompt)).split(",")]
    modes = [m.strip() for m in args.sampling.split(",") if m.strip()]
    if not modes or set(modes) - {"greedy", "checkpoint"}:
        parser.error(f"--sampling takes greedy and/or checkpoint, got {args.sampling!r}")
    record = smoke.Record("speed")
    bandwidth = bandwidth_gbs(gib=0.125 if args.smoke else 1.0)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    load = os.getloadavg()[0]
    out = [f"{args.gen} tokens ({' and '.join(modes)}) after prompts of {', '.join(map(str, lengths))} tokens, median [range] of "
           f"{args.runs} runs per process{f' x {args.rounds} interleaved rounds' if args.rounds > 1 else ''}; "
           f"memory-bandwidth ceiling measured now: {bandwidth:.1f} GB/s (numpy read, 2 threads, best of 7); load average "
           f"at start {load:.1f} on {os.cpu_count()} CPUs."]  # fmt: skip
    print(out[0], flush=True)
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        title, folder_of = MODELS[key]
        folder = smoke.tiny_checkpoint(key) if args.smoke else folder_of()
        title = f"{title.split(' (')[0]} (tiny random, smoke)" if args.smoke else title
        _, config = weights_per_token(folder)
        for n_prompt, mode in [(n, m) for n in lengths for m in modes]:
            args.prompt = n_prompt
            drawn = {"sampling": CHECKPOINT_SAMPLING} if mode == "checkpoint" else {}
            suffix = ", sampled as the checkpoint asks" if drawn else ""
            tag = " sampled" if drawn else ""
            mean_position = n_prompt + args.gen // 2
            kv_of = lambda item, c=config, m=mean_position: kv_bytes_per_token(c, m, item)  # noqa: E731
            rows = {}
            plan = list(ABLATIONS.items()) if args.ablations else [(s, (s, {}, {})) for s in STACKS]
            for round_ in range(args.rounds):
                for name, (stack, env, options) in plan:
                    if stack in skip or (key != "gemma3" and stack == "llama.cpp") or args.only not in name:
                        continue
                    if args.ablations and key != "gemma3":
                        break
                    if stack == "llama.cpp" and not _installed("llama_cpp"):
                        rows[name] = {"skipped": "llama-cpp-python is not installed (optional)"}
                        continue
                    print(f"  {title}, prompt {n_prompt}{suffix}: {name} (round {round_ + 1}/{args.rounds}) ...", flush=True)
                    path = quantized_folder(folder, QUANTIZED[stack]) if stack in QUANTIZED else folder
                    if stack == "llama.cpp":  # the real 270M's GGUF, also in a smoke run (no tiny GGUF exists)
                        path = gemma3_gguf()
                        options = {**options, "n_ctx": max(n_prompt, 64) + max(args.gen, 8) + 8}
                    result = spawn(stack, path, args, env, {**options, **drawn})
                    rows[name] = merge(rows.get(name), result)
            if rows:
                text = table(f"{title}, prompt {n_prompt}{suffix}", rows, "ours (all on)" if args.ablations else "ours", bandwidth, kv_of)
                print(text, flush=True)
                out.append(text)
            for name, r in rows.items():
                label = f"{key} {name}{tag}"
                peer = name in PEERS or name.startswith("mlx-lm")
                if "error" in r or "skipped" in r:
                    package = {"llama.cpp": "llama_cpp", "torch": "torch"}.get(name, "mlx_lm" if peer else None)
                    record.missing(label, r.get("error") or r["skipped"], ours=not peer, package=package)
                else:
                    record.row(label, r["ids"], ours=not peer, prefill=statistics.median(r["prefill"]),
                               decode=statistics.median(r["decode"]))  # fmt: skip
            # float32 on the same weights, greedy: the same tokens (llama.cpp, bf16 and quantized rows differ by design)
            if not drawn:
                record.agree(*(f"{key} {name}" for name in ("ours", "mlx-lm + BLAS", "torch") if name in rows))
    if args.out:
        Path(args.out).write_text("\n\n".join(out) + "\n")
    if args.smoke:
        record.finish()


def _installed(name: str) -> bool:
    from importlib.util import find_spec

    return find_spec(name) is not None


if __name__ == "__main__":
    main()
