"""What compiling a whole decode step buys on the CPU: a prototype Gemma 3 step under one ``mx.compile``.

    python -m benchmarks.compiled_step                        # the real 270M: float32 and the 8-bit zoo folder
    python -m benchmarks.compiled_step --models gemma-3-270m-8bit --steps 64 --rounds 5

Our decode step is built anew every token: ~1,700 graph nodes through Python, with only the q/k
norm + RoPE compiled (``graphs.speedups.norm_rope``), because the caches write at Python-int
positions and RoPE's tables are keyed on them (``cache/``, ``graphs/layers.py``). One compiled
function can serve every step only if the write position is an array. This prototype writes the
270M's step that way, over the loaded graph's own modules (embedding, norms, projections, MLPs,
head: the same weights and, for a packed folder, the same ``kernels`` products):

- keys and values in preallocated buffers of ``--capacity`` positions (a ring of the window on
  sliding layers), written by ``mx.slice_update`` at the array position, every slot attended with
  the mask ``cache.masks.filled`` gives for that position;
- RoPE by ``mx.fast.rope`` at the array offset;
- the step, ``(token, position, *buffers) -> (next token, logits, *buffers)``, compiled once and
  called for every token.

It first checks its logits against the graph's over the same tokens (prefill by the graph, then
both step from copies of that cache), then times both loops, interleaved over ``--rounds``:
median ms per token. Greedy only; the prototype is not the generation path (``docs/speed.md``
says what adopting it needs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import zoo_blas  # noqa: F401  (before mlx)

import mlx.core as mx
import numpy as np

import models
from cache import masks
from graphs.gemma3_text_config import SLIDING
from models.generation.generate import generate_tokens


def buffers_from(cache: list, capacity: int, windows: list[int]) -> list[mx.array]:
    """The graph's filled caches copied into the prototype's fixed buffers (slot = position % size)."""
    out = []
    for layer_cache, size in zip(cache, windows):
        k, v = (t[:, :, -size:] for t in layer_cache.temporal())
        n = k.shape[2]
        start = layer_cache.offset - n
        slots = mx.array([(start + i) % size for i in range(n)])
        for stored in (k, v):
            buf = mx.zeros((*stored.shape[:2], size, stored.shape[3]), dtype=stored.dtype)
            buf[:, :, slots] = stored
            out.append(buf)
    return out


def make_step(model, capacity: int):
    """The compiled ``(token [1, 1], position [], *buffers) -> (next token, logits, *buffers)``."""
    graph = model.graph
    config = graph.config
    windows = [config.sliding_window if t == SLIDING else capacity for t in config.layer_types]

    def step(token, position, *buffers):
        h = graph.embed(token)
        written = []
        for i, layer in enumerate(graph.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            rope = attn.rope

            def rotate(t, norm):
                return mx.fast.rope(norm(t), attn.head_dim, traditional=False, base=rope.base, scale=1.0,
                                    offset=position, freqs=rope.periods)  # fmt: skip

            q = rotate(attn._heads(attn.q_proj(x), attn.num_heads), attn.q_norm)
            k = rotate(attn._heads(attn.k_proj(x), attn.num_kv_heads), attn.k_norm)
            v = attn._heads(attn.v_proj(x), attn.num_kv_heads)
            slot = (position % windows[i]).reshape(1)
            keys = mx.slice_update(buffers[2 * i], k, slot, axes=(2,))
            values = mx.slice_update(buffers[2 * i + 1], v, slot, axes=(2,))
            written += [keys, values]
            out = mx.fast.scaled_dot_product_attention(
                q, keys, values, scale=attn.scale, mask=masks.filled(position, windows[i])
            )
            out = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 1, -1))
            h = h + layer.post_attention_layernorm(out)
            h = h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        logits = graph.logits(graph.norm(h))
        return (mx.argmax(logits[0, -1]).reshape(1, 1), logits, *written)

    return mx.compile(step), windows


def run_compiled(step, token: int, position: int, buffers: list[mx.array], n: int):
    """``n`` greedy steps: (seconds, ids, logits of every step)."""
    ids, logits = [], []
    current = mx.array([[token]])
    start = time.perf_counter()
    for i in range(n):
        current, step_logits, *buffers = step(current, mx.array(position + i), *buffers)
        ids.append(current.item())
        logits.append(step_logits)
    return time.perf_counter() - start, ids, logits


def run_graph(model, prompt: list[int], n: int):
    """Our loop: the prefill, then ``n`` greedy steps timed from the first token on."""
    cache = model.make_cache()
    tokens = generate_tokens(model.forward, prompt, cache, max_tokens=n + 1)
    ids = [next(tokens)]
    start = time.perf_counter()
    ids += list(tokens)
    return time.perf_counter() - start, ids


def check(model, step, windows, prompt: list[int], capacity: int, n: int = 8) -> float:
    """Max |logit difference| between the graph's steps and the prototype's over ``n`` tokens."""
    cache = model.make_cache()
    first = model.logits([prompt], cache)[0, -1]
    token = int(mx.argmax(first))
    buffers = buffers_from(cache, capacity, windows)
    _, ids, logits = run_compiled(step, token, len(prompt), buffers, n)
    worst, current = 0.0, token
    for i in range(n):
        want = model.logits([[current]], cache)[0, -1]
        worst = max(worst, float(mx.abs(want - logits[i][0, -1]).max()))
        current = ids[i]
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gemma-3-270m,gemma-3-270m-8bit")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=1024, help="positions the full layers' buffers hold")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompt = [2] + np.random.default_rng(0).integers(1000, 200000, args.prompt - 1).tolist()
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = models.load(name, tokenizer=False)
        step, windows = make_step(model, args.capacity)
        print(f"{name}: logits of 8 steps within {check(model, step, windows, prompt, args.capacity):.2e} of the graph's")
        ours, compiled = [], []
        for _ in range(args.rounds):
            seconds, ids = run_graph(model, prompt, args.steps)
            ours.append(1e3 * seconds / args.steps)
            cache = model.make_cache()
            token = int(mx.argmax(model.logits([prompt], cache)[0, -1]))
            seconds, cids, _ = run_compiled(step, token, len(prompt), buffers_from(cache, args.capacity, windows), args.steps)
            compiled.append(1e3 * seconds / args.steps)
            assert cids == ids[1:], "the prototype's greedy tokens differ from the graph's"
        print(
            f"  ms per token, median [range] of {args.rounds}: graph {statistics.median(ours):.2f} "
            f"[{min(ours):.2f}-{max(ours):.2f}], compiled step {statistics.median(compiled):.2f} "
            f"[{min(compiled):.2f}-{max(compiled):.2f}]; {statistics.median(ours) / statistics.median(compiled):.2f}x"
        )


if __name__ == "__main__":
    main()
