"""DiffusionGemma block diffusion: ours against mlx-vlm's ``diffusion_gemma``, and against our own
Gemma 4 autoregressive decoding of the same size, on one random checkpoint.

Builds (once, cached under ``.assets/bench``) a random DiffusionGemma scaled to a small machine
(MoE on every layer, K=V full layers, 5:1 sliding/full, a 32k vocabulary, the image token ids
inside it) and a Gemma 4 ``ForCausalLM`` with the same text stack (MoE + dense, K=V). Each stack
runs in its own process (peak memory is its own): a prompt of ``--prompt`` random tokens, then
``--blocks`` blocks of ``canvas_length`` tokens with ``--steps`` denoising steps each (random
weights are never confident, so no block stops early and every stack does the same work); the AR
model decodes the same number of tokens greedily. The median of ``--runs`` timed runs after a
warm-up is reported, with ratios ours / peer, and a prefill chunk of ``canvas_length`` tokens of
the same model for scale (a canvas step is that forward plus the vocabulary-wide work). Peak
memory includes the weights, all made resident before timing (mlx-vlm's loader evaluates every
weight; ours would leave unused ones, like the vision tower on a text prompt, unread).

mlx-vlm has no entry point that runs the reference sampler on a bare checkpoint, so its row runs
the same loop as ours (``models.generation.diffusion``'s pieces, the same seed) around mlx-vlm's
model calls (``diffusion_prefill_cache``, ``diffusion_decoder_logits``,
``diffusion_self_conditioning``, ``diffusion_update_cache``): the comparison is of the graphs and
caches. Both must give the same greedy draft (the decoder's argmax for one canvas over the
prompt); their sampled runs agree until a float32 near-tie in the entropies (on random weights
every entropy is about log(vocab)), which the run reports. Every process loads the same BLAS
(``zoo_cpu`` is imported before MLX; ``GEMMA_ZOO_BLAS=off`` gives MLX's bundled reference BLAS to
all). mlx-vlm is imported from the environment or
from ``--mlx-vlm-path`` (``pip install --no-deps --target DIR mlx-vlm``); where it is not
installed its row is reported as such.

A stack that is installed and produces no row, or ours and mlx-vlm giving different greedy drafts,
makes the run exit non-zero after the table. ``--smoke`` runs the same on a tiny checkpoint, one
round (seconds; ``tests/test_benchmark_smoke_diffusion.py``).

    python -m benchmarks.diffusion_gemma [--prompt 256 --blocks 2 --steps 8 --runs 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import zoo_cpu  # noqa: F401  (the same fast BLAS for every stack, loaded before MLX in each process)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".assets" / "bench"

# A token vision tower: transformers would otherwise add its default 0.6 GB one, unused here.
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=32, position_embedding_size=256)  # fmt: skip
STACK = dict(
    num_hidden_layers=6,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    top_k_experts=2,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    use_bidirectional_attention="vision",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    initializer_range=0.02,
)
SIZES = {
    "full": dict(
        text=dict(STACK, vocab_size=32768, hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64,
                  global_head_dim=128, num_experts=8, moe_intermediate_size=128, sliding_window=128),
        canvas=64, diffusion="diffusion-gemma-small-v3", autoregressive="gemma4-moe-same-stack",
    ),
    "smoke": dict(
        text=dict(STACK, vocab_size=2048, hidden_size=64, intermediate_size=128, num_attention_heads=2, head_dim=32,
                  global_head_dim=64, num_experts=4, moe_intermediate_size=32, sliding_window=16),
        canvas=16, diffusion="diffusion-gemma-smoke-v1", autoregressive="gemma4-moe-smoke-v1",
    ),
}  # fmt: skip
SMOKE_RUN = dict(prompt=40, blocks=2, steps=3, runs=1)  # a prompt past the sliding window, two blocks
NAMES = {"ours": "ours (diffusion)", "mlx_vlm": "mlx-vlm (diffusion)", "autoregressive": "ours, Gemma 4 AR same stack"}
PEER_PACKAGES = {"mlx_vlm": "mlx_vlm"}  # stacks that may be absent: their import name


class Sizes:
    """One of ``SIZES``: the text config, the canvas length and the checkpoint folders."""

    def __init__(self, name: str):
        size = SIZES[name]
        self.text, self.canvas = size["text"], size["canvas"]
        self.diffusion, self.autoregressive = BENCH / size["diffusion"], BENCH / size["autoregressive"]
        vocab = self.text["vocab_size"]
        # The image, begin- and end-of-image ids: the last three of the vocabulary (transformers'
        # defaults lie past a 32k vocabulary, which the config check refuses). Prompts avoid them.
        self.image_ids = dict(image_token_id=vocab - 1, boi_token_id=vocab - 3, eoi_token_id=vocab - 2)

    def draft_canvas(self) -> list[int]:
        """A fixed canvas for the greedy check: ids over the whole vocabulary."""
        import numpy as np

        return np.random.default_rng(1).integers(0, self.text["vocab_size"], self.canvas).tolist()

    def prompt(self, n: int) -> list[int]:
        import numpy as np

        return [2] + np.random.default_rng(0).integers(3, self.text["vocab_size"] - 3, n - 1).tolist()


def build_checkpoints(sizes: Sizes) -> None:
    """Random weights saved by transformers; the configs also carry the plain fields mlx-vlm reads."""
    import torch

    if not (sizes.diffusion / "model.safetensors").exists():
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

        torch.manual_seed(0)
        config = DiffusionGemmaConfig(text_config=sizes.text, vision_config=VISION, canvas_length=sizes.canvas, **sizes.image_ids)
        DiffusionGemmaForBlockDiffusion(config).eval().save_pretrained(sizes.diffusion)
        saved = json.loads((sizes.diffusion / "config.json").read_text())
        saved["text_config"].update(global_head_dim=sizes.text["global_head_dim"], num_global_key_value_heads=1)
        (sizes.diffusion / "config.json").write_text(json.dumps(saved, indent=2))
    if not (sizes.autoregressive / "model.safetensors").exists():
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        torch.manual_seed(0)
        text = dict(sizes.text, enable_moe_block=True, attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)
        text.pop("use_bidirectional_attention")
        Gemma4ForCausalLM(Gemma4TextConfig(**text)).eval().save_pretrained(sizes.autoregressive)


# Each runner: (prefill seconds, generation seconds, committed tokens, prefill-chunk seconds or None).
def run_ours(sizes: Sizes, prompt: list[int], blocks: int, steps: int):
    import mlx.core as mx

    from models import load

    model = load(str(sizes.diffusion), tokenizer=False)
    mx.eval(model.graph.parameters())  # resident like mlx-vlm's (its loader evaluates every weight)
    mx.reset_peak_memory()
    result = model.generate(prompt, seed=0, max_new_tokens=blocks * sizes.canvas, max_denoising_steps=steps)
    if result.steps_per_block != [steps] * blocks:
        raise RuntimeError(f"ours ran {result.steps_per_block} steps per block, not {[steps] * blocks}: the stacks would do different work")
    return result.prefill_seconds, result.generation_seconds, result.new_tokens(0), _prefill_chunk(model.graph, result.cache, sizes)


def draft_ours(sizes: Sizes, prompt: list[int]) -> list[int]:
    import mlx.core as mx

    from models import load

    graph = load(str(sizes.diffusion), tokenizer=False).graph
    cache = graph.make_cache()
    graph.prefill(mx.array([prompt]), cache)
    return mx.argmax(graph.denoise(mx.array([sizes.draft_canvas()]), cache), axis=-1)[0].tolist()


def draft_mlx_vlm(sizes: Sizes, prompt: list[int]) -> list[int]:
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    model = load_model(sizes.diffusion)
    cache = model.diffusion_prefill_cache(mx.array([prompt]), cache=model.make_cache())
    return mx.argmax(model.diffusion_decoder_logits(mx.array([sizes.draft_canvas()]), cache, None), axis=-1)[0].tolist()


def _prefill_chunk(graph, cache, sizes: Sizes, rounds: int = 3) -> float:
    """Seconds of one encoder pass of ``canvas`` tokens over the run's cache (then trimmed off):
    the forward a canvas step shares with a prefill."""
    import mlx.core as mx
    import numpy as np

    chunk = mx.array(np.array([sizes.prompt(sizes.canvas)]))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        graph.prefill(chunk, cache)
        mx.eval([(state["keys"], state["values"]) for state in (c.state for c in cache)])
        times.append(time.perf_counter() - start)
        for c in cache:
            c.trim(sizes.canvas)
    return statistics.median(times)


def run_mlx_vlm(sizes: Sizes, prompt: list[int], blocks: int, steps: int):
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from models.generation.diffusion import MLXNoise, entropy_bound_accept, vocabulary_step
    from models.generation.diffusion_options import DiffusionGenerationConfig

    model = load_model(sizes.diffusion)
    mx.reset_peak_memory()
    options = DiffusionGenerationConfig(max_denoising_steps=steps)
    noise, vocab, C = MLXNoise(0), sizes.text["vocab_size"], sizes.canvas
    start = time.perf_counter()
    cache = model.diffusion_prefill_cache(mx.array([prompt]), cache=model.make_cache())
    mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    embedding = model.diffusion_prepare_self_conditioning()
    committed, scratch = [], {}
    for block in range(blocks):
        canvas, self_conditioning = noise.canvas((1, C), vocab), None
        for remaining in range(steps, 0, -1):
            logits = model.diffusion_decoder_logits(canvas, cache, self_conditioning)
            processed, probs, entropies, argmax = vocabulary_step(logits, options.temperature(remaining), scratch=scratch)
            accepted = entropy_bound_accept(entropies, options.entropy_bound)
            canvas = mx.where(accepted, noise.sample(probs), noise.canvas((1, C), vocab))
            self_conditioning = model.diffusion_self_conditioning(processed, embedding)
            mx.eval(canvas, argmax)
        committed += argmax[0].tolist()
        if block + 1 < blocks:
            cache = model.diffusion_update_cache(argmax, cache=cache)
            mx.eval([c.state for c in cache])
    return prefill_s, time.perf_counter() - start, committed, None


def run_autoregressive(sizes: Sizes, prompt: list[int], blocks: int, steps: int):
    import mlx.core as mx

    import models
    from models.generation.generate import generate_tokens, prefill

    model = models.load(str(sizes.autoregressive), tokenizer=False)
    mx.eval(model.graph.parameters())
    mx.reset_peak_memory()
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model.forward, prompt, cache))
    prefill_s = time.perf_counter() - start
    tokens = generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=blocks * sizes.canvas, overlap=model.overlap)
    first = next(tokens)
    start = time.perf_counter()
    rest = list(tokens)
    generated = [first, *rest]
    return prefill_s, (time.perf_counter() - start) * blocks * sizes.canvas / len(generated), [int(t) for t in generated], None


def profile(sizes: Sizes, n_prompt: int, steps: int, rounds: int) -> None:
    """Where a canvas step of ours goes: each piece evaluated on its own over the prompt's cache,
    the pieces taking turns round after round (median per piece), beside the whole step as the
    loop runs it and a prefill chunk of the same length."""
    import mlx.core as mx

    from models import load
    from models.generation.diffusion import MLXNoise, StableAndConfident, entropy_bound_accept, vocabulary_step

    model = load(str(sizes.diffusion), tokenizer=False)
    graph, C, V = model.graph, sizes.canvas, sizes.text["vocab_size"]
    mx.eval(graph.parameters())
    prompt = sizes.prompt(n_prompt)
    cache = graph.make_cache()
    graph.prefill(mx.array([prompt]), cache)
    mx.eval([(state["keys"], state["values"]) for state in (c.state for c in cache)])
    noise = MLXNoise(0)
    canvas, temperature, cap = noise.canvas((1, C), V), 0.6, graph.config.text.final_logit_softcapping
    states = graph.decoder_states(canvas, cache, None)
    head = graph.head_product(states)
    scratch = {}
    processed, probs, entropies, argmax = vocabulary_step(head, temperature, cap, scratch)
    soft = graph.expected_embedding(probs)
    mx.eval(states, head, probs, entropies, soft)
    stopper = StableAndConfident(1, 0.005)
    pieces = {
        f"prefill chunk of {C} tokens (encoder pass over the same cache, for scale)":
            lambda: _prefill_chunk(graph, cache, sizes, rounds=1),
        "decoder: embedding, self-conditioning MLP, layers, final norm": lambda: graph.decoder_states(canvas, cache, soft),
        "tied head product (head_product: the extension's GEMM on the CPU plan)": lambda: graph.head_product(states),
        "vocabulary_step: softcap, temperature, softmax, entropy, argmax":  # as the loop runs it on a float32 table
            lambda: vocabulary_step(head, temperature, cap, scratch, keep_processed=False),
        "sample (two-level inverse CDF over the probabilities)": lambda: noise.sample(probs),
        "acceptance, re-noising, stop rule": lambda: (mx.where(entropy_bound_accept(entropies, 0.1), argmax, noise.canvas((1, C), V)),
                                                      stopper(argmax, entropies)),
        "self-conditioning product probs @ E": lambda: graph.expected_embedding(probs),
    }  # fmt: skip
    times = {name: [] for name in pieces}
    whole = []
    for _ in range(rounds):
        for name, piece in pieces.items():
            start = time.perf_counter()
            mx.eval(piece())
            times[name].append(time.perf_counter() - start)
        result = model.generate(prompt, seed=0, max_new_tokens=C, max_denoising_steps=steps)
        whole.append(result.generation_seconds / steps)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(zoo_cpu.blas.describe())
    print(f"ours, one canvas step of {C} positions over a {n_prompt}-token prompt, vocab {V}: median of {rounds}; load average {load}")
    print("| piece | ms |")
    print("|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.1f} |")
    step_pieces = sum(statistics.median(ts) for name, ts in list(times.items())[1:])
    print(f"| sum of the step's pieces | {1000 * step_pieces:.1f} |")
    print(f"| a whole step as the loop runs it ({steps}-step block; the last step skips the self-conditioning product) "
          f"| {1000 * statistics.median(whole):.1f} |")  # fmt: skip


RUNNERS = {"ours": run_ours, "mlx_vlm": run_mlx_vlm, "autoregressive": run_autoregressive}
# The greedy check: the decoder's argmax for one canvas over the prompt (no sampling, no acceptance).
DRAFTS = {"ours": draft_ours, "mlx_vlm": draft_mlx_vlm}


def child(which: str, size: str, n_prompt: int, blocks: int, steps: int, runs: int) -> None:
    import mlx.core as mx

    sizes = Sizes(size)
    prompt = sizes.prompt(n_prompt)
    run = RUNNERS[which]
    run(sizes, prompt[:16], 1, 1)  # warm-up
    results = []
    for _ in range(runs):
        results.append(run(sizes, prompt, blocks, steps))
        peak = mx.get_peak_memory()  # from the end of the model load to the end of the run
    tokens = blocks * sizes.canvas
    chunks = [r[3] for r in results if r[3] is not None]
    print(json.dumps({
        "prefill_tps": statistics.median(n_prompt / r[0] for r in results),
        "tps": statistics.median(tokens / r[1] for r in results),
        "step_ms": statistics.median(1000 * r[1] / (blocks * steps) for r in results),
        "chunk_ms": 1000 * statistics.median(chunks) if chunks else None,
        "peak_gb": peak / 1e9,
        "tokens": results[0][2],
        "draft": DRAFTS[which](sizes, prompt) if which in DRAFTS else None,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint, one round: a check that every stack runs and agrees")
    parser.add_argument("--profile", type=int, metavar="ROUNDS", help="time the pieces of ours' canvas step instead (in this process)")
    parser.add_argument("--mlx-vlm-path", help="a folder holding the mlx_vlm package (added to PYTHONPATH)")
    parser.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="full", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.size = "smoke"
        vars(args).update(SMOKE_RUN)
    if args.profile:
        sizes = Sizes(args.size)
        build_checkpoints(sizes)
        profile(sizes, args.prompt, args.steps, args.profile)
        return
    if args.child:
        child(args.child, args.size, args.prompt, args.blocks, args.steps, args.runs)
        return
    sizes = Sizes(args.size)
    build_checkpoints(sizes)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), args.mlx_vlm_path, env.get("PYTHONPATH")]))
    rows, failures = {}, []
    for which in RUNNERS:
        if which in PEER_PACKAGES and not _importable(PEER_PACKAGES[which], env):
            print(f"[{NAMES[which]}: {PEER_PACKAGES[which]} is not installed, no row]", file=sys.stderr)
            continue
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.diffusion_gemma", "--child", which, "--size", args.size,
             "--prompt", str(args.prompt), "--blocks", str(args.blocks), "--steps", str(args.steps), "--runs", str(args.runs)],
            cwd=ROOT, capture_output=True, text=True, env=env,
        )  # fmt: skip
        if out.returncode:
            lines = out.stderr.strip().splitlines() or ["(no output)"]
            failures.append(f"{NAMES[which]} produced no row (exit {out.returncode}): {lines[-1]}")
            continue
        rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
    print_table(sizes, args, rows)
    if "ours" in rows and "mlx_vlm" in rows:
        ours, peer = rows["ours"], rows["mlx_vlm"]
        if ours["draft"] != peer["draft"]:
            failures.append(f"ours and mlx-vlm (same weights) give different greedy drafts for one canvas:\n"
                            f"  ours    {ours['draft']}\n  mlx-vlm {peer['draft']}")  # fmt: skip
        else:
            print(f"ours and mlx-vlm: the same greedy draft ({len(ours['draft'])} positions)")
        # The sampled runs agree only until a float32 near-tie: on random weights every position's
        # entropy is about log(vocab), so which position is accepted can turn on the last bits.
        same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"]))
        print(f"ours and mlx-vlm, the same loop and seed: {same} of {len(ours['tokens'])} committed tokens equal")
    if failures:
        print("FAILED:\n" + "\n".join(failures), file=sys.stderr)
        raise SystemExit(1)


def _importable(package: str, env: dict) -> bool:
    """Whether ``package`` imports in the children's environment (``--mlx-vlm-path`` included)."""
    path = env["PYTHONPATH"].split(os.pathsep)
    sys.path[:0], found = path, None
    try:
        found = find_spec(package) is not None
    finally:
        del sys.path[: len(path)]
    return found


def print_table(sizes: Sizes, args, rows: dict) -> None:
    text = sizes.text
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(zoo_cpu.blas.describe())
    print(f"DiffusionGemma random checkpoint (H={text['hidden_size']}, {text['num_hidden_layers']} layers, "
          f"{text['num_experts']} experts, vocab {text['vocab_size']}, canvas {sizes.canvas}), prompt {args.prompt}, "
          f"{args.blocks} blocks x {args.steps} steps, median of {args.runs}; load average {load}")  # fmt: skip
    print("| stack | prefill tok/s | tokens/s | ms per step | peak memory GB |")
    print("|---|---|---|---|---|")
    for which, row in rows.items():
        step = f"{row['step_ms']:.1f}" if which != "autoregressive" else "-"
        print(f"| {NAMES[which]} | {row['prefill_tps']:.0f} | {row['tps']:.1f} | {step} | {row['peak_gb']:.2f} |")
    ours = rows.get("ours")
    for which in ("mlx_vlm", "autoregressive"):
        if ours and which in rows:
            peer = rows[which]
            step = f"{ours['step_ms'] / peer['step_ms']:.2f}x" if which == "mlx_vlm" else ""
            print(f"| ours / {NAMES[which]} | {ours['prefill_tps'] / peer['prefill_tps']:.2f}x | "
                  f"{ours['tps'] / peer['tps']:.2f}x | {step} | {ours['peak_gb'] / peer['peak_gb']:.2f}x |")  # fmt: skip
    if ours:
        print(f"ours: a prefill chunk of {sizes.canvas} tokens over the same cache {ours['chunk_ms']:.1f} ms; "
              f"a canvas step costs {ours['step_ms'] / ours['chunk_ms']:.2f}x that")  # fmt: skip


if __name__ == "__main__":
    main()
