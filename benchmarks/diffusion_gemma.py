"""DiffusionGemma block diffusion: ours against mlx-vlm's ``diffusion_gemma``, and against our own
Gemma 4 autoregressive decoding of the same size, on one random checkpoint.

Builds (once, cached under ``.assets/bench``) a random DiffusionGemma scaled to a small machine
(MoE on every layer, K=V full layers, 5:1 sliding/full, a 32k vocabulary) and a Gemma 4
``ForCausalLM`` with the same text stack (MoE + dense, K=V). Each stack runs in its own process
(peak memory is its own): a prompt of ``--prompt`` random tokens, then ``--blocks`` blocks of
``canvas_length`` tokens with ``--steps`` denoising steps each (random weights are never
confident, so no block stops early and every stack does the same work); the AR model decodes the
same number of tokens greedily. The median of ``--runs`` timed runs after a warm-up is reported,
with ratios ours / peer. Peak memory includes the weights, all made resident before timing
(mlx-vlm's loader evaluates every weight; ours would leave unused ones, like the vision tower on
a text prompt, unread).

mlx-vlm has no entry point that runs the reference sampler on a bare checkpoint, so its row runs
the same loop as ours (``models.generation.diffusion``'s pieces) around mlx-vlm's model calls
(``diffusion_prefill_cache``, ``diffusion_decoder_logits``, ``diffusion_update_cache``): the
comparison is of the graphs and caches. mlx-vlm is imported from the environment or from
``--mlx-vlm-path`` (``pip install --no-deps --target DIR mlx-vlm``); without it its row is skipped.

    python -m benchmarks.diffusion_gemma [--prompt 256 --blocks 2 --steps 8 --runs 3]
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

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / ".assets" / "bench"
DIFFUSION = BENCH / "diffusion-gemma-small-v2"
AUTOREGRESSIVE = BENCH / "gemma4-moe-same-stack"

TEXT = dict(
    vocab_size=32768,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    num_experts=8,
    top_k_experts=2,
    moe_intermediate_size=128,
    sliding_window=128,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    use_bidirectional_attention="vision",
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
    initializer_range=0.02,
)
# A token vision tower: transformers would otherwise add its default 0.6 GB one, unused here.
VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=32, position_embedding_size=256)  # fmt: skip
CANVAS = 64


def build_checkpoints() -> None:
    """Random weights saved by transformers; the configs also carry the plain fields mlx-vlm reads."""
    import torch

    if not (DIFFUSION / "model.safetensors").exists():
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

        torch.manual_seed(0)
        DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=CANVAS)).eval().save_pretrained(DIFFUSION)
        config = json.loads((DIFFUSION / "config.json").read_text())
        config["text_config"].update(global_head_dim=TEXT["global_head_dim"], num_global_key_value_heads=1)
        (DIFFUSION / "config.json").write_text(json.dumps(config, indent=2))
    if not (AUTOREGRESSIVE / "model.safetensors").exists():
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        torch.manual_seed(0)
        text = dict(TEXT, enable_moe_block=True, attention_k_eq_v=True, hidden_size_per_layer_input=0, final_logit_softcapping=30.0)
        text.pop("use_bidirectional_attention")
        Gemma4ForCausalLM(Gemma4TextConfig(**text)).eval().save_pretrained(AUTOREGRESSIVE)


def run_ours(prompt: list[int], blocks: int, steps: int) -> tuple[float, float]:
    import mlx.core as mx

    from models import load

    model = load(str(DIFFUSION), tokenizer=False)
    mx.eval(model.graph.parameters())  # resident like mlx-vlm's (its loader evaluates every weight)
    mx.reset_peak_memory()
    result = model.generate(prompt, seed=0, max_new_tokens=blocks * CANVAS, max_denoising_steps=steps)
    assert result.steps_per_block == [steps] * blocks
    return result.prefill_seconds, result.generation_seconds


def run_mlx_vlm(prompt: list[int], blocks: int, steps: int) -> tuple[float, float]:
    import mlx.core as mx
    from mlx_vlm.utils import load_model

    from models.generation.diffusion_options import DiffusionGenerationConfig
    from models.generation.diffusion import MLXNoise, entropy, entropy_bound_accept

    model = load_model(DIFFUSION)
    mx.reset_peak_memory()
    options = DiffusionGenerationConfig(max_denoising_steps=steps)
    noise, vocab = MLXNoise(0), TEXT["vocab_size"]
    start = time.perf_counter()
    cache = model.diffusion_prefill_cache(mx.array([prompt]), cache=model.make_cache())
    mx.eval([c.state for c in cache])
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    embedding = model.diffusion_prepare_self_conditioning()
    for block in range(blocks):
        canvas, self_conditioning = noise.canvas((1, CANVAS), vocab), None
        for remaining in range(steps, 0, -1):
            logits = model.diffusion_decoder_logits(canvas, cache, self_conditioning)
            processed = logits / mx.array(options.temperature(remaining), dtype=mx.float32)
            sample, argmax = noise.sample(processed), mx.argmax(processed, axis=-1)
            accepted = entropy_bound_accept(entropy(processed), options.entropy_bound)
            canvas = mx.where(accepted, sample, noise.canvas((1, CANVAS), vocab))
            self_conditioning = model.diffusion_self_conditioning(processed, embedding)
            mx.eval(canvas, argmax, self_conditioning)
        if block + 1 < blocks:
            cache = model.diffusion_update_cache(argmax, cache=cache)
            mx.eval([c.state for c in cache])
    return prefill_s, time.perf_counter() - start


def run_autoregressive(prompt: list[int], blocks: int, steps: int) -> tuple[float, float]:
    import mlx.core as mx

    import models
    from models.generation.generate import generate_tokens, prefill

    model = models.load(str(AUTOREGRESSIVE), tokenizer=False)
    mx.eval(model.graph.parameters())
    mx.reset_peak_memory()
    cache = model.make_cache()
    start = time.perf_counter()
    mx.eval(prefill(model.forward, prompt, cache))
    prefill_s = time.perf_counter() - start
    tokens = generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=blocks * CANVAS)
    next(tokens)
    start = time.perf_counter()
    n = 1 + sum(1 for _ in tokens)
    return prefill_s, (time.perf_counter() - start) * blocks * CANVAS / n


RUNNERS = {"ours": run_ours, "mlx_vlm": run_mlx_vlm, "autoregressive": run_autoregressive}


def child(which: str, n_prompt: int, blocks: int, steps: int, runs: int) -> None:
    import mlx.core as mx
    import numpy as np

    prompt = [2] + np.random.default_rng(0).integers(3, TEXT["vocab_size"], n_prompt - 1).tolist()
    run = RUNNERS[which]
    run(prompt[:16], 1, 1)  # warm-up
    results = []
    for _ in range(runs):
        results.append(run(prompt, blocks, steps))
        peak = mx.get_peak_memory()  # from the end of the model load to the end of the run
    tokens = blocks * CANVAS
    print(json.dumps({
        "prefill_tps": statistics.median(n_prompt / p for p, _ in results),
        "tps": statistics.median(tokens / g for _, g in results),
        "step_ms": statistics.median(1000 * g / (blocks * steps) for _, g in results),
        "peak_gb": peak / 1e9,
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mlx-vlm-path", help="a folder holding the mlx_vlm package (added to PYTHONPATH)")
    parser.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.prompt, args.blocks, args.steps, args.runs)
        return
    build_checkpoints()
    env = dict(os.environ)
    if args.mlx_vlm_path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), args.mlx_vlm_path, env.get("PYTHONPATH")]))
    rows = {}
    for which in RUNNERS:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.diffusion_gemma", "--child", which, "--prompt", str(args.prompt),
             "--blocks", str(args.blocks), "--steps", str(args.steps), "--runs", str(args.runs)],
            cwd=ROOT, capture_output=True, text=True, env=env,
        )  # fmt: skip
        if out.returncode:
            print(f"[{which} skipped: {out.stderr.strip().splitlines()[-1]}]", file=sys.stderr)
            continue
        rows[which] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"DiffusionGemma small random checkpoint (H={TEXT['hidden_size']}, {TEXT['num_hidden_layers']} layers, "
          f"{TEXT['num_experts']} experts, vocab {TEXT['vocab_size']}, canvas {CANVAS}), prompt {args.prompt}, "
          f"{args.blocks} blocks x {args.steps} steps, median of {args.runs}")  # fmt: skip
    print("| stack | prefill tok/s | tokens/s | ms per step | peak memory GB |")
    print("|---|---|---|---|---|")
    names = {"ours": "ours (diffusion)", "mlx_vlm": "mlx-vlm (diffusion)", "autoregressive": "ours, Gemma 4 AR same stack"}
    for which, row in rows.items():
        step = f"{row['step_ms']:.1f}" if which != "autoregressive" else "-"
        print(f"| {names[which]} | {row['prefill_tps']:.0f} | {row['tps']:.1f} | {step} | {row['peak_gb']:.2f} |")
    ours = rows.get("ours")
    for which in ("mlx_vlm", "autoregressive"):
        if ours and which in rows:
            peer = rows[which]
            print(f"| ours / {names[which]} | {ours['prefill_tps'] / peer['prefill_tps']:.2f}x | "
                  f"{ours['tps'] / peer['tps']:.2f}x | | {ours['peak_gb'] / peer['peak_gb']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
