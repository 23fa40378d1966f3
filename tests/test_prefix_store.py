"""Prefix reuse across requests (``models.generation.prefix_store``) on tiny random checkpoints.

Every reuse is checked against a fresh prefill of the same prompt with the same chunking and KV
storage: the last logits within 1e-5, and 12 teacher-forced decode steps after it too (so the
restored sliding windows, not just the last position, are right). The long stored prompts (340
positions) run past what a sliding cache stores (``window - 1 + slack + step``, 275 and 279 here),
so a restore well before their end takes its window's history from the rows recorded during the
stored prefill.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402
from models.checks import TokenIdError  # noqa: E402
from models.generation.generate import GenerationOptionError, KVQuantization, prefill  # noqa: E402
from models.generation.prefix_store import PrefixStore  # noqa: E402
from models.generation.prompts import Prompt  # noqa: E402
from tests import hf_tiny  # noqa: E402
from tests.test_gemma3_text_parity import _write_checkpoint as save_gemma3  # noqa: E402

TOL = 1e-5
BASE_IDS = [2, *range(10, 49)]  # 40 shared positions
CONTINUATION = [7, 8, 9, 11, 13, 17, 19, 23, 29, 31, 37, 41]


def tail(seed: int, n: int = 30) -> list[int]:
    return np.random.default_rng(seed).integers(60, 250, n).tolist()


def build(kind: str, folder):
    if kind == "gemma3":
        _, folder = save_gemma3("base", folder)  # window 8, layers S S F S S F, 512 positions
    else:
        hf_tiny.save_causal_lm(dict(hf_tiny.TEXT_CONFIGS[kind], initializer_range=0.05), folder)
    return models.load(str(folder), tokenizer=False)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = build(kind, tmp_path_factory.mktemp(kind))
        return made[kind]

    return get


def checked(store, model, prompt, kv=None, step=8, tol=TOL) -> int:
    """``store.prefill`` equals a fresh prefill (logits, then 12 decode steps); returns the reused count.
    An aligned store's restore equals it bit for bit."""
    if not isinstance(prompt, Prompt):
        prompt = Prompt(list(prompt))
    cache = model.make_cache()
    reuse = store.prefill(model, prompt, cache, kv_quantization=kv, prefill_step_size=step)
    fresh = model.make_cache()
    want = prefill(model.forward, prompt.ids, fresh, step, prompt.images, kv)
    assert reuse.logits.shape == want.shape
    tol = 0.0 if store.aligned else tol
    assert float(mx.max(mx.abs(reuse.logits - want))) <= tol, f"reused {reuse.reused}"
    for token in CONTINUATION:
        got, expected = model.forward(mx.array([[token]]), cache), model.forward(mx.array([[token]]), fresh)
        assert float(mx.max(mx.abs(got - expected))) <= tol, f"reused {reuse.reused}, decode step {token}"
    return reuse.reused


@pytest.mark.parametrize(
    "kind, step", [("T2", 8), ("T3", 8), ("E2B_like", 8), ("E2B_like", 7), ("gemma3", 7)]
)  # PLE + KV sharing, MoE, E2B's layer pattern, Gemma 3; chunk ends on and off the common prefix
def test_reused_prefixes_equal_fresh_prefills(zoo, kind, step):
    model, store = zoo(kind), PrefixStore()
    first = BASE_IDS + tail(1, 300)
    assert checked(store, model, first, step=step) == 0
    # The stored prompt's sliding caches dropped position 40 long ago; its rows were recorded. The
    # restore is at the new prompt's last chunk end within the common prefix.
    assert checked(store, model, BASE_IDS + tail(2), step=step) == 40 // step * step
    assert checked(store, model, first, step=step) == 336  # the same prompt (340): up to its last chunk end
    assert checked(store, model, first + tail(3, 5), step=step) == 336  # its continuation
    assert checked(store, model, first[:201] + [99], step=step) == 200 // step * step
    assert store.stats.hits == 4 and store.stats.misses == 1
    assert store.stats.reused_tokens == 40 // step * step + 2 * 336 + 200 // step * step
    # Unaligned: restored at the common prefix itself, within another chunking's rounding.
    loose = PrefixStore(aligned=False)
    checked(loose, model, first, step=step)
    assert checked(loose, model, BASE_IDS + tail(2), step=step, tol=1e-4) == 40
    assert checked(loose, model, first, step=step, tol=1e-4) == len(first) - 1
    assert checked(loose, model, first[:201] + [99], step=step, tol=1e-4) == 201


def test_requests_behind_one_system_prompt_share_its_rows(zoo):
    model, system = zoo("T2"), [2, *tail(0, 199)]
    single = PrefixStore()
    checked(single, model, system + tail(1, 5))
    one = single.stats.bytes
    store = PrefixStore()
    reused = [checked(store, model, system + tail(seed, 5)) for seed in range(1, 7)]
    assert reused == [0] + [200] * 5
    assert store.stats.entries == 6 and store.stats.bytes < 1.5 * one  # the 200 shared rows are held once


@pytest.mark.parametrize(
    "kv", [KVQuantization(8, 32, 0), KVQuantization(4, 32, 20)], ids=["q8-from-the-start", "q4-after-20"]
)
def test_quantized_kv_reuse_equals_a_fresh_quantized_prefill(zoo, kv):
    model, store = zoo("T2"), PrefixStore()
    assert checked(store, model, BASE_IDS + tail(1), kv) == 0
    assert checked(store, model, BASE_IDS + tail(2), kv) == 40
    assert checked(store, model, BASE_IDS + tail(2) + tail(3, 4), kv) == 64  # the last chunk end within 70
    assert checked(store, model, BASE_IDS + tail(4)) == 0  # a full-precision request never restores quantized rows


def test_quantized_rows_are_not_restored_where_a_fresh_prefill_holds_full_precision(zoo):
    model, store = zoo("T2"), PrefixStore()
    kv = KVQuantization(8, 32, 30)  # the caches switch after the chunk ending at 32
    assert checked(store, model, BASE_IDS + tail(1), kv) == 0
    # Only 20 positions in common: the stored full-layer rows before 20 are quantized, a fresh
    # prefill of this prompt holds them in full precision, so nothing is restored.
    assert checked(store, model, BASE_IDS[:20] + tail(2), kv) == 0
    assert checked(store, model, BASE_IDS + tail(3), kv) == 40  # past the switch: restored


def test_images_are_keyed_by_their_content(tmp_path):
    hf_tiny.save_conditional_generation(tmp_path)
    model = models.load(str(tmp_path), tokenizer=False)
    placeholder = hf_tiny.T5_TOKENS["image_token_id"]
    rng = np.random.default_rng(0)
    photo, other = (rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(2))
    ids = [2, 10, 11, 12, 13, placeholder, *range(20, 40)]

    def prompt(image, more: list[int]) -> Prompt:
        return model.prompt(ids + more, images=[image], max_soft_tokens=70)  # encoded anew each time

    store = PrefixStore()
    first = prompt(photo, tail(1, 20))
    (span,) = first.images
    assert checked(store, model, first, step=6) == 0
    # The same image encoded again: its hash matches and the restore lies past it.
    assert checked(store, model, prompt(photo, tail(2, 20)), step=6) > span.end
    # Another image at the same place: nothing from the image on is reused.
    assert 0 < checked(store, model, prompt(other, tail(1, 20)), step=6) <= span.start


def test_lru_eviction_within_the_byte_budget(zoo):
    model = zoo("T2")
    prompts = [[100 + seed, *tail(seed, 40)] for seed in range(4)]  # no common first token
    sizing = PrefixStore()
    checked(sizing, model, prompts[0])
    one = sizing.stats.bytes
    store = PrefixStore(max_bytes=int(2.5 * one))
    for p in prompts[:2]:
        checked(store, model, p)
    assert checked(store, model, prompts[0]) == len(prompts[0]) - 1  # touched: now the most recent
    checked(store, model, prompts[2])  # evicts prompts[1], the least recently used
    assert store.stats.evictions == 1 and store.stats.entries == 2 and store.stats.bytes <= store.max_bytes
    assert checked(store, model, prompts[0]) == len(prompts[0]) - 1
    assert checked(store, model, prompts[1]) == 0
    assert store.stats.bytes <= store.max_bytes
    tiny = PrefixStore(max_bytes=one // 2)
    checked(tiny, model, prompts[3])
    assert tiny.stats.too_large == 1 and tiny.stats.entries == 0 and tiny.stats.bytes == 0


def test_bad_calls_are_named(zoo):
    model, store = zoo("T2"), PrefixStore()
    with pytest.raises(TypeError, match="DiffusionGemma"):
        store.prefill(object(), Prompt([2, 3]), [])
    with pytest.raises(TypeError, match="must be a Prompt"):
        store.prefill(model, [2, 3], model.make_cache())
    with pytest.raises(TokenIdError):
        store.prefill(model, Prompt([2, 999]), model.make_cache())
    with pytest.raises(GenerationOptionError, match="prefill_step_size"):
        store.prefill(model, Prompt([2, 3]), model.make_cache(), prefill_step_size=0)
    used = model.make_cache()
    model.forward(mx.array([[2, 3]]), used)
    with pytest.raises(ValueError, match="must be fresh"):
        store.prefill(model, Prompt([4, 5]), used)
    with pytest.raises(ValueError, match="make another store"):
        store.prefill(zoo("T3"), Prompt([2, 3]), zoo("T3").make_cache())
