"""Continuous batching (``models.generation.batch``): each request of a batch produces exactly the
tokens it produces alone, whatever runs beside it, joins or leaves, for Gemma 4 (PLE + KV sharing,
MoE), Gemma 3, prompts with images, quantized KV and sampled requests with seeds; windows wrap
(the tiny checkpoints' sliding windows are 4 and 8 positions)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from models.checks import NoTokenizerError  # noqa: E402
from models.generation.batch import BatchGenerator, BatchRequest  # noqa: E402
from models.generation.generate import KVQuantization, SamplingOptions, generate_tokens  # noqa: E402
from models.generation.prompts import Prompt  # noqa: E402
from tests import hf_tiny  # noqa: E402
from zoo_cpu import backend, decode, prefill  # noqa: E402
from tests.test_gemma3_text_parity import _write_checkpoint as write_gemma3  # noqa: E402

STOP = frozenset({1})
SAMPLED = [SamplingOptions(), SamplingOptions(temp=0.9, seed=3), SamplingOptions(temp=1.0, top_k=5, seed=2),
           SamplingOptions(), SamplingOptions(temp=0.7, top_p=0.9, min_p=0.05, seed=9), SamplingOptions()]  # fmt: skip
MAX_TOKENS = [12, 7, 20, 3, 15, 9]


def ragged_prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[2] + [int(x) for x in rng.integers(3, vocab, length)] for length in (3, 9, 14, 5, 20, 7)[:n]]


def alone(model, prompt, options, max_tokens, kv=None) -> list[int]:
    images = prompt.images if isinstance(prompt, Prompt) else ()
    ids = prompt.ids if isinstance(prompt, Prompt) else prompt
    return list(generate_tokens(model._forward, ids, model.make_cache(), sampling=options, max_tokens=max_tokens,
                                stop_ids=STOP, images=images, kv_quantization=kv))  # fmt: skip


def batched(model, prompts, options, max_tokens, max_batch=3, kv=None) -> list[list[int]]:
    generator = BatchGenerator(model, max_batch=max_batch, kv_quantization=kv)
    requests = [BatchRequest(p, max_tokens=n, sampling=o, stop_ids=STOP) for p, o, n in zip(prompts, options, max_tokens)]
    return generator.run(requests)


@pytest.fixture(scope="module", params=["T2", "T3"])
def gemma4(request, tmp_path_factory):
    return hf_tiny.load_causal_lm(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    _, folder = write_gemma3("base", tmp_path_factory.mktemp("gemma3"))
    return models.load(str(folder), tokenizer=False)


@pytest.mark.parametrize("max_batch", [1, 3, 6])
def test_gemma4_batch_equals_alone(gemma4, max_batch):
    prompts = ragged_prompts(gemma4.vocab_size)
    want = [alone(gemma4, p, o, n) for p, o, n in zip(prompts, SAMPLED, MAX_TOKENS)]
    assert batched(gemma4, prompts, SAMPLED, MAX_TOKENS, max_batch) == want
    assert [len(w) for w in want] == MAX_TOKENS  # no early stop hides a difference


def test_gemma3_batch_equals_alone(gemma3):
    prompts = ragged_prompts(gemma3.vocab_size)
    want = [alone(gemma3, p, o, n) for p, o, n in zip(prompts, SAMPLED, MAX_TOKENS)]
    assert batched(gemma3, prompts, SAMPLED, MAX_TOKENS, 4) == want


def test_batched_decode_takes_the_rows_kernels(gemma3, monkeypatch):
    """With the decode kernels, a step of 4 rows or more attends every row in one call per layer
    (``decode.attention_rows``) and sends its rows through the few-row head kernel
    (``prefill.linear`` on the transposed head), and every request still gets exactly its tokens alone."""
    if not backend.active().decode or gemma3.graph.head_blocks is None:
        pytest.skip("the decode kernels or the transposed head (fast BLAS) are not in effect here")
    prompts = ragged_prompts(gemma3.vocab_size)
    want = [alone(gemma3, p, o, n) for p, o, n in zip(prompts, SAMPLED, MAX_TOKENS)]
    calls = Counter()
    attention_rows, linear = decode.attention_rows, prefill.linear
    monkeypatch.setattr(decode, "attention_rows", lambda *a, **kw: calls.update(["attention_rows"]) or attention_rows(*a, **kw))
    monkeypatch.setattr(
        prefill, "linear", lambda *a, **kw: calls.update(["head"] if kw.get("transposed") else []) or linear(*a, **kw)
    )
    assert batched(gemma3, prompts, SAMPLED, MAX_TOKENS, 6) == want
    assert calls["attention_rows"] and calls["head"], calls


def test_quantized_kv_batch_equals_alone(gemma4):
    kv = KVQuantization(8, 32, start=6)  # some rows switch to quantized storage mid-batch, some at once
    prompts = ragged_prompts(gemma4.vocab_size)
    want = [alone(gemma4, p, o, n, kv) for p, o, n in zip(prompts, SAMPLED, MAX_TOKENS)]
    assert batched(gemma4, prompts, SAMPLED, MAX_TOKENS, 4, kv) == want


def test_images_in_some_requests(tmp_path):
    from tests.test_gemma4_multimodal import PROMPT_ONE, PROMPT_TWO, TEXT_VARIANTS, save_multimodal
    from tests.test_gemma4_vision_parity import synthetic_images

    save_multimodal(tmp_path, TEXT_VARIANTS["vision_kv_shared"])
    model = models.load(str(tmp_path), tokenizer=False)
    a, b = synthetic_images()[:2]
    prompts = [model.prompt(PROMPT_TWO, [a, b], 70), [2, 30, 31, 32, 33], model.prompt(PROMPT_ONE, [b], 70), [2, 40, 41]]
    options, max_tokens = SAMPLED[:4], [10, 12, 6, 9]
    want = [alone(model, p, o, n) for p, o, n in zip(prompts, options, max_tokens)]
    assert batched(model, prompts, options, max_tokens, 2) == want
    # Raw images are encoded at admission, in the generator's thread.
    generator = BatchGenerator(model, max_batch=4)
    raw = generator.run([BatchRequest(PROMPT_TWO, max_tokens=10, stop_ids=STOP, images=[a, b], max_soft_tokens=70),
                         BatchRequest([2, 30, 31, 32, 33], max_tokens=12, sampling=SAMPLED[1], stop_ids=STOP)])  # fmt: skip
    assert raw == want[:2]


def test_cancel_frees_the_row_and_leaves_the_others_exact(gemma4):
    prompts = ragged_prompts(gemma4.vocab_size, 3)
    want = [alone(gemma4, p, SamplingOptions(), 15) for p in prompts]
    generator = BatchGenerator(gemma4, max_batch=3)
    ids = [generator.submit(BatchRequest(p, max_tokens=15, stop_ids=STOP)) for p in prompts]
    got = {i: [] for i in ids}
    finish = {}
    steps = 0
    while generator.busy:
        steps += 1
        if steps == 4:
            assert generator.cancel(ids[1])
        for event in generator.step():
            if event.token is not None and event.finish_reason is None:
                got[event.request_id].append(event.token)
            if event.finish_reason:
                finish[event.request_id] = event.finish_reason
    assert finish == {ids[0]: "length", ids[1]: "cancelled", ids[2]: "length"}
    assert got[ids[0]] == want[0] and got[ids[2]] == want[2]
    assert got[ids[1]] == want[1][: len(got[ids[1]])] and len(got[ids[1]]) == 3
    assert not generator.cancel(ids[1])


def test_stop_and_length_match_generate_tokens(gemma4):
    """The finish reasons and token counts of the plain loop, stop ids included."""
    prompt = ragged_prompts(gemma4.vocab_size, 1)[0]
    free = alone(gemma4, prompt, SamplingOptions(), 10)
    first_new = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    generator = BatchGenerator(gemma4)
    generator.submit(BatchRequest(prompt, max_tokens=10, stop_ids=frozenset({free[first_new]})))
    events = []
    while generator.busy:
        events += generator.step()
    assert [e.token for e in events] == free[: first_new + 1] and events[-1].finish_reason == "stop"
    assert events[-1].generated_tokens == first_new and events[-1].prompt_tokens == len(prompt)
    generator.submit(BatchRequest(prompt, max_tokens=10, stop_ids=frozenset()))
    events = []
    while generator.busy:
        events += generator.step()
    assert [e.token for e in events[:-1]] == free and events[-1].token is None
    assert events[-1].finish_reason == "length" and events[-1].generated_tokens == 10


def test_bad_requests_are_named_and_do_not_disturb_the_batch(gemma4):
    generator = BatchGenerator(gemma4)
    with pytest.raises(ValueError, match="999"):
        generator.submit(BatchRequest([2, 999], max_tokens=3))
    with pytest.raises(ValueError, match="empty"):
        generator.submit(BatchRequest([], max_tokens=3))
    with pytest.raises(ValueError, match="max_tokens"):
        generator.submit(BatchRequest([2, 5], max_tokens=0))
    with pytest.raises(ValueError, match="does not fit the context: 0 cached \\+ 600 new positions"):
        generator.submit(BatchRequest([5] * 600, max_tokens=3))
    with pytest.raises(ValueError, match="top_p"):
        generator.submit(BatchRequest([2, 5], sampling=_bad_top_p()))
    good = generator.submit(BatchRequest([2, 5, 6], max_tokens=4, stop_ids=frozenset()))
    image = generator.submit(BatchRequest([2, 5], max_tokens=4, images=["/nonexistent.png"]))
    events = []
    while generator.busy:
        events += generator.step()
    errors = [e for e in events if e.finish_reason == "error"]
    assert [e.request_id for e in errors] == [image] and "text model" in errors[0].error
    assert [e.token for e in events if e.request_id == good and e.token is not None] == alone(gemma4, [2, 5, 6], SamplingOptions(), 4)


def test_misused_requests_are_named_and_a_queued_request_can_be_cancelled(gemma4):
    generator = BatchGenerator(gemma4, max_batch=1)
    with pytest.raises(TypeError, match="submit: takes a BatchRequest, got list"):
        generator.submit([2, 5])
    with pytest.raises(TypeError, match="submit: sampling must be SamplingOptions, got dict"):
        generator.submit(BatchRequest([2, 5], sampling={"temp": 0.5}))
    with pytest.raises(ValueError, match="a Prompt already carries its media"):
        generator.submit(BatchRequest(Prompt([2, 5]), images=["/nonexistent.png"]))
    first = generator.submit(BatchRequest([2, 5, 6], max_tokens=3, stop_ids=frozenset()))
    queued = generator.submit(BatchRequest([2, 7], max_tokens=3))
    assert generator.waiting == 2
    assert generator.cancel(queued)
    events = []
    while generator.busy:
        events += generator.step()
    assert [(e.request_id, e.finish_reason) for e in events if e.finish_reason] == [(queued, "cancelled"), (first, "length")]
    with pytest.raises(ValueError, match="request 1: .*text model"):
        BatchGenerator(gemma4).run([BatchRequest([2, 5], max_tokens=2), BatchRequest([2, 5], max_tokens=2, images=["/x.png"])])
    with pytest.raises(NoTokenizerError, match="batch_generate \\(which returns text\\)"):
        gemma4.batch_generate([[2, 5]])


def _bad_top_p():
    options = SamplingOptions(temp=1.0)
    options.top_p = 1.5  # changed after construction: checked again at submit
    return options


def test_diffusion_gemma_is_refused_by_name():
    class Diffusion:
        model_type = "diffusion_gemma"

    with pytest.raises(ValueError, match="DiffusionGemma"):
        BatchGenerator(Diffusion())


@pytest.mark.slow
def test_batch_generate_text_equals_generate_on_the_real_270m():
    model = models.load("gemma-3-270m")
    prompts = ["The capital of France is", "Water boils at", "A haiku about the sea:\n"]
    want = [model.generate(p, max_tokens=12, seed=3) for p in prompts]  # sampled with the checkpoint's top-k and top-p
    sampling, _ = model.sampling_options(seed=3)
    assert model.batch_generate(prompts, max_tokens=12, max_batch=2, sampling=sampling) == want


def test_prefix_store_serves_admissions_exactly(gemma4):
    """Requests behind one long shared prefix (windows wrapped inside it) reuse it and still equal alone."""
    from models.generation.prefix_store import PrefixStore

    rng = np.random.default_rng(5)
    system = [2] + [int(x) for x in rng.integers(3, gemma4.vocab_size, 40)]
    prompts = [system + [int(x) for x in rng.integers(3, gemma4.vocab_size, n)] for n in (3, 6, 2, 9)]
    want = [alone(gemma4, p, SamplingOptions(), 8) for p in prompts]
    store = PrefixStore(max_bytes=1 << 26)
    generator = BatchGenerator(gemma4, max_batch=2, prefix_store=store, prefill_step_size=16)
    ids = [generator.submit(BatchRequest(p, max_tokens=8, stop_ids=STOP)) for p in prompts]
    got, reused = {i: [] for i in ids}, {}
    while generator.busy:
        for event in generator.step():
            reused[event.request_id] = event.reused_tokens
            if event.token is not None and event.finish_reason is None:
                got[event.request_id].append(event.token)
    assert [got[i] for i in ids] == want
    assert reused[ids[0]] == 0 and all(reused[i] >= 32 for i in ids[1:])
    assert store.stats.hits == 3
