"""Batched admission: arrivals prefilled together in ragged chunks equal each prompt prefilled alone.

The block of a ragged forward is padded in front (``cache.batch_caches(..., new=...)``); the padding
must never reach a row's cache, mask or RoPE positions. Checked at the read (each row's output and
stored rows equal the same read alone) and through the generator on tiny random Gemma 3 and Gemma 4
checkpoints with sliding windows of 4 that wrap inside the prompts: first-token logits to 1e-4 and
greedy/seeded tokens equal to each request alone, with arrivals mid-decode and a long prompt fed one
chunk per step beside running rows.
"""

from __future__ import annotations

import numpy as np
import pytest

import models  # noqa: F401  (loads the fast BLAS before MLX runs)
import mlx.core as mx  # noqa: E402
from cache import KVCache, RotatingKVCache, batch_caches  # noqa: E402
from models.generation.batch import BatchGenerator, BatchRequest  # noqa: E402
from models.generation.generate import KVQuantization, SamplingOptions, prefill  # noqa: E402
from models.generation.prompts import prefill_chunks  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_batch_generate import STOP, alone  # noqa: E402
from tests.test_gemma3_text_parity import _write_checkpoint as write_gemma3  # noqa: E402

HKV, GROUPS, D = 2, 2, 16


@pytest.fixture(scope="module", params=["gemma3", "T2", "T3"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return models.load(str(write_gemma3("base", folder)[1]), tokenizer=False)
    return hf_tiny.load_causal_lm(request.param, folder)


def prompts_of(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[2] + [int(x) for x in rng.integers(3, vocab, n - 1)] for n in lengths]


@pytest.mark.parametrize("window", [None, 4])
def test_a_ragged_read_gives_each_row_its_read_alone(window):
    """Rows bringing 1, 5 and 3 new positions to one block of 5: each row's output (at its real
    positions) and stored rows equal the same read alone; the padding outputs zeros."""
    rng = np.random.default_rng(1)
    make = (lambda: KVCache()) if window is None else (lambda: RotatingKVCache(window))
    history, new = [6, 0, 3], [1, 5, 3]
    rows, refs = [make() for _ in new], [make() for _ in new]

    def qkv(n):
        q, k, v = (mx.array(rng.standard_normal((1, h, n, D)).astype(np.float32)) for h in (HKV * GROUPS, HKV, HKV))
        return q, k, v

    for row, ref, n in zip(rows, refs, history):
        if n:
            q, k, v = qkv(n)
            row.window(q, k, v, scale=0.25), ref.window(q, k, v, scale=0.25)
    width = max(new)
    parts = [qkv(n) for n in new]
    padded = [[mx.concatenate([mx.full((1, x.shape[1], width - n, D), 7.0), x], axis=2) for x in part] for part, n in zip(parts, new)]
    batch = batch_caches([[row] for row in rows], new)[0]
    assert batch.offset == tuple(h - (width - n) for h, n in zip(history, new))
    out = batch.window(*(mx.concatenate([p[i] for p in padded]) for i in range(3)), scale=0.25)
    for r, (ref, part, n) in enumerate(zip(refs, parts, new)):
        want = ref.window(*part, scale=0.25)
        np.testing.assert_allclose(np.array(out[r : r + 1, :, width - n :]), np.array(want), atol=1e-6, err_msg=f"row {r}")
        assert not np.array(out[r, :, : width - n]).any(), f"row {r}: padding outputs must be zeros"
        assert rows[r].offset == ref.offset == history[r] + n
        np.testing.assert_array_equal(np.array(rows[r].temporal()[0]), np.array(ref.temporal()[0]))


def test_bad_ragged_counts_are_named():
    with pytest.raises(ValueError, match="new must give each of the 2 rows"):
        batch_caches([[KVCache()], [KVCache()]], [3])
    with pytest.raises(ValueError, match="new must give each of the 2 rows"):
        batch_caches([[KVCache()], [KVCache()]], [3, 0])


def test_ragged_chunked_prefill_logits_equal_alone(model):
    """Prompts of 3, 17, 9 and 30 tokens fed in chunks of 8, all in one ragged block per step (as
    the generator feeds them): the last position's logits and the next decode step's equal each
    prompt's own prefill (1e-4)."""
    prompts = prompts_of(model.vocab_size, (3, 17, 9, 30))
    caches = [model.make_cache() for _ in prompts]
    chunks = [list(prefill_chunks(len(p), (), 8)) for p in prompts]
    last = [None] * len(prompts)
    while any(chunks):
        feeding = [i for i, c in enumerate(chunks) if c]
        pieces = [chunks[i].pop(0) for i in feeding]
        width = max(e - s for s, e in pieces)
        ids = mx.array([[0] * (width - e + s) + prompts[i][s:e] for i, (s, e) in zip(feeding, pieces)])
        logits = model.graph(ids, cache=batch_caches([caches[i] for i in feeding], [e - s for s, e in pieces]), last_only=True)
        for j, i in enumerate(feeding):
            last[i] = logits[j, -1]
    nxt = mx.array([[5] for _ in prompts])
    step = model.graph(nxt, cache=batch_caches(caches), last_only=True)[:, -1]
    for i, p in enumerate(prompts):
        cache = model.make_cache()
        want = prefill(model._forward, p, cache, 8)
        np.testing.assert_allclose(np.array(last[i]), np.array(want), atol=1e-4, err_msg=f"prompt {i}")
        want_step = model.graph(mx.array([[5]]), cache=cache, last_only=True)[0, -1]
        np.testing.assert_allclose(np.array(step[i]), np.array(want_step), atol=1e-4, err_msg=f"prompt {i} decode")


def test_arrivals_mid_decode_and_a_long_prompt_chunked(model):
    """Two requests decode; three arrive later (ragged, one of 60 tokens fed 8 per step): every
    request's tokens equal it alone, and the running rows get a token in every step of the long
    prefill."""
    prompts = prompts_of(model.vocab_size, (5, 11, 60, 2, 13), seed=3)
    options = [SamplingOptions(), SamplingOptions(temp=0.9, seed=4), SamplingOptions(), SamplingOptions(temp=1.0, top_k=5, seed=2), SamplingOptions()]
    max_tokens = [20, 18, 6, 9, 7]
    want = [alone(model, p, o, n) for p, o, n in zip(prompts, options, max_tokens)]
    generator = BatchGenerator(model, max_batch=6, prefill_step_size=8)
    requests = [BatchRequest(p, max_tokens=n, sampling=o, stop_ids=STOP) for p, o, n in zip(prompts, options, max_tokens)]
    ids = [generator.submit(r) for r in requests[:2]]
    got: dict[int, list[int]] = {}
    steps = 0
    long_steps = []
    while generator.busy:
        steps += 1
        if steps == 3:
            ids += [generator.submit(r) for r in requests[2:]]
        events = generator.step()
        if steps >= 3 and ids[2] not in got:  # the long prompt is being fed (until its first token)
            long_steps.append({e.request_id for e in events})
        for e in events:
            got.setdefault(e.request_id, [])
            if e.token is not None and e.finish_reason is None:
                got[e.request_id].append(e.token)
    assert [got[i] for i in ids] == want
    assert len(long_steps) == 8  # 60 positions in chunks of 8: one chunk per step, the first token with the last
    assert all({ids[0], ids[1]} <= seen for seen in long_steps[:5]), "running rows stalled behind the long prefill"


def test_ragged_admission_with_quantized_kv_and_logprobs(model):
    """Chunked ragged admission with caches switching to 8-bit mid-prompt; each token's reported
    log-probability equals the one the request reports alone (1e-4)."""
    if model.config.head_dim % 32:
        pytest.skip(f"head dim {model.config.head_dim} is below the smallest KV quantization group (32)")
    kv = KVQuantization(8, 32, start=10)
    prompts = prompts_of(model.vocab_size, (4, 23, 15), seed=7)
    want = [alone(model, p, SamplingOptions(), 8, kv) for p in prompts]

    def run(requests, max_batch):
        generator = BatchGenerator(model, max_batch=max_batch, kv_quantization=kv, prefill_step_size=8)
        ids = [generator.submit(BatchRequest(p, max_tokens=8, stop_ids=STOP, logprobs=0)) for p in requests]
        tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
        while generator.busy:
            for e in generator.step():
                if e.token is not None and e.finish_reason is None:
                    tokens[e.request_id].append(e.token)
                    logprobs[e.request_id].append(e.logprob.logprob)
        return [tokens[i] for i in ids], [logprobs[i] for i in ids]

    together, together_lp = run(prompts, 3)
    assert together == want
    for p, lp in zip(prompts, together_lp):
        _, lone = run([p], 1)
        np.testing.assert_allclose(lp, lone[0], atol=1e-4)


def test_a_request_cancelled_while_its_prompt_is_fed_frees_its_rows(model):
    """Cancelled mid-prefill (whole, or one of its ``n`` choices): a ``"cancelled"`` event per
    choice that leaves, no token, and the request beside it equals alone."""
    prompts = prompts_of(model.vocab_size, (40, 6), seed=11)
    want = alone(model, prompts[1], SamplingOptions(), 6)
    for choice in (None, 1):
        generator = BatchGenerator(model, max_batch=4, prefill_step_size=8)
        long = generator.submit(BatchRequest(prompts[0], max_tokens=4, stop_ids=STOP, n=2))
        short = generator.submit(BatchRequest(prompts[1], max_tokens=6, stop_ids=STOP))
        events = generator.step() + generator.step()
        assert generator.prefilling == 1 and generator.running == 3
        assert generator.cancel(long, choice)
        while generator.busy:
            events += generator.step()
        ended = {e.choice: e.finish_reason for e in events if e.request_id == long and e.finish_reason}
        assert ended == ({0: "cancelled", 1: "cancelled"} if choice is None else {0: "length", 1: "cancelled"})
        assert not any(e.token is not None for e in events if e.request_id == long and e.choice == 1)
        assert [e.token for e in events if e.request_id == short and e.token is not None and e.finish_reason is None] == want
