"""A look at the shared KV cache on its own: a sliding-window layer through a long generation.

Prefills a prompt longer than the window in chunks, decodes well past several wraps of the window,
rolls back a speculative draft after the wrap, and checks every answer against a plain attention
over all positions (masked to the window), printing storage as it goes.

    python -m examples.cache_demo --window 64 --prompt 300 --decode 2000
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from cache import RotatingKVCache


def dense_window_attention(q, keys, values, window):
    """The oracle: the newest query against every position so far, keys older than the window masked."""
    T = keys.shape[2]
    visible = mx.arange(T) > T - 1 - window
    scores = (q @ mx.repeat(keys, q.shape[1] // keys.shape[1], axis=1).swapaxes(-1, -2))
    scores = mx.where(visible, scores, -mx.inf)
    return mx.softmax(scores, axis=-1) @ mx.repeat(values, q.shape[1] // values.shape[1], axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--decode", type=int, default=2000)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--draft", type=int, default=4, help="speculative draft length rolled back after the wrap")
    args = parser.parse_args()

    heads, kv_heads, dim = 4, 1, 64
    mx.random.seed(0)
    cache = RotatingKVCache(args.window, slack=max(8, args.draft))
    all_k, all_v = [], []

    def step(L):
        q = mx.random.normal((1, heads, L, dim)) * dim**-0.5
        k = mx.random.normal((1, kv_heads, L, dim))
        v = mx.random.normal((1, kv_heads, L, dim))
        out = cache.window(q, k, v, scale=1.0) if L > 1 else cache.decode(q, k, v, scale=1.0)
        all_k.append(k)
        all_v.append(v)
        return q, out

    for start in range(0, args.prompt, args.chunk):
        step(min(args.chunk, args.prompt - start))
    print(f"prefill {args.prompt} positions in chunks of {args.chunk}: {cache.stored} stored, {cache.nbytes / 1024:.0f} KiB")

    worst = 0.0
    for i in range(args.decode):
        q, out = step(1)
        if i % 97 == 0 or i == args.decode - 1:
            keys, values = mx.concatenate(all_k, axis=2), mx.concatenate(all_v, axis=2)
            worst = max(worst, mx.max(mx.abs(out - dense_window_attention(q, keys, values, args.window))).item())
        if i and i % 500 == 0:
            print(f"decode step {i:5d}: offset {cache.offset}, {cache.stored} stored, {cache.nbytes / 1024:.0f} KiB")

    for _ in range(args.draft):
        step(1)
    cache.trim(args.draft)
    del all_k[-args.draft :], all_v[-args.draft :]
    q, out = step(1)
    keys, values = mx.concatenate(all_k, axis=2), mx.concatenate(all_v, axis=2)
    worst = max(worst, mx.max(mx.abs(out - dense_window_attention(q, keys, values, args.window))).item())
    print(f"rolled back a {args.draft}-token draft after {cache.offset // args.window} wraps of the window")
    print(f"worst |difference| against dense attention: {worst:.2e}")


if __name__ == "__main__":
    main()
