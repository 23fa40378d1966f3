"""``models.load`` end to end on tiny checkpoints written by transformers: the calls users make."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import models  # noqa: E402
from models.generation.generate import GenerationStats, SamplingOptions, generate_tokens  # noqa: E402
from tests import hf_tiny  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t2")
    hf_model = hf_tiny.save_causal_lm(hf_tiny.TEXT_CONFIGS["T2"], folder, max_shard_size="100KB")
    return folder, hf_model


def test_load_logits_with_and_without_cache(checkpoint):
    folder, hf_model = checkpoint
    model = models.load(str(folder), tokenizer=False)
    ids = np.random.default_rng(0).integers(3, 256, (1, 19)).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor(ids)).logits.numpy()
    full = np.array(model.logits(ids))
    assert np.abs(full - want).max() < 1e-4
    cache = model.make_cache()
    pieces = [model.logits(ids[0][:9], cache), model.logits(ids[0][9:10], cache), model.logits(ids[0][10:], cache)]
    cached = np.concatenate([np.array(p) for p in pieces], axis=1)
    assert np.abs(cached - full).max() < 1e-4


def test_greedy_generation_equals_reference_argmax(checkpoint):
    folder, hf_model = checkpoint
    model = models.load(str(folder), tokenizer=False)
    prompt = [2, 17, 99, 4, 56, 200, 31]
    ours = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=20, prefill_step_size=3))
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_overlapped_and_read_first_loops_agree(checkpoint, temp):
    """The overlapped loop (the default off the CPU) queues the step feeding a token before reading
    it and trims that step off when the token stops: same tokens, same cache, same finish reason."""
    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    prompt = [2, 17, 99, 4, 56, 200, 31]
    greedy = list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=20))
    stop = {greedy[6]}
    cases = [dict(max_tokens=9), dict(max_tokens=20, stop_ids=stop), dict(max_tokens=20, stop_ids={greedy[9]})]
    for kwargs in cases:
        runs = []
        for overlap in (False, True):
            cache, stats = model.make_cache(), GenerationStats()
            sampling = SamplingOptions(temp=temp, seed=3)
            tokens = list(generate_tokens(model.forward, prompt, cache, sampling=sampling, stats=stats,
                                          overlap=overlap, **kwargs))  # fmt: skip
            runs.append((tokens, [c.offset for c in cache], stats.finish_reason))
        assert runs[0] == runs[1], kwargs
        tokens, offsets, _ = runs[0]
        assert set(offsets) == {len(prompt) + len(tokens)}  # every yielded id fed, a stop id never
    # an interrupt after the third token: nothing past it is fed
    for overlap in (False, True):
        cache, seen = model.make_cache(), []
        stream = generate_tokens(model.forward, prompt, cache, max_tokens=20, overlap=overlap,
                                 should_stop=lambda: len(seen) >= 3)  # fmt: skip
        seen.extend(stream)
        assert seen == greedy[:3] and cache[0].offset == len(prompt) + 3


def test_dtype_option_casts_weights(checkpoint):
    folder, _ = checkpoint
    model = models.load(str(folder), dtype="bfloat16", tokenizer=False)
    assert model.graph.embed_tokens.weight.dtype == mx.bfloat16
    assert model.logits([2, 3, 4]).shape == (1, 3, 256)


def test_prompt_past_the_context_is_refused(checkpoint):
    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    cache = model.make_cache()
    model.logits([3 + i % 250 for i in range(500)], cache)  # ids inside T2's vocabulary of 256
    with pytest.raises(ValueError, match="500 cached \\+ 20 new positions > max_position_embeddings 512"):
        model.logits(list(range(3, 23)), cache)
    assert cache[0].offset == 500


def test_unsupported_model_type_names_it(checkpoint, tmp_path):
    folder, _ = checkpoint
    for item in folder.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        models.load(str(tmp_path), tokenizer=False)


def test_missing_shard_names_the_file(checkpoint, tmp_path):
    folder, _ = checkpoint
    for item in folder.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        models.load(str(tmp_path), tokenizer=False)


def test_unreachable_hub_id_says_how_to_use_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(models.ModelNotAvailableError, match="google/gemma-4-E2B-it"):
        models.load("google/gemma-4-E2B-it")


def test_sampling_options_are_checked():
    with pytest.raises(ValueError, match="top_p=1.5"):
        SamplingOptions(temp=1.0, top_p=1.5)


def test_last_only_skips_the_shared_tail_exactly(checkpoint):
    """With only the last logits wanted, KV-shared layers run on the last position alone."""
    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    assert model.config.num_kv_shared_layers == 2
    ids = np.random.default_rng(1).integers(3, 256, 23).tolist()
    full = np.array(model.logits(ids))[0]
    cache = model.make_cache()
    for start, stop in ((0, 6), (6, 7), (7, 23)):
        last = model.forward(mx.array([ids[start:stop]]), cache, last_only=True)
        assert last.shape == (1, 1, 256)
        assert np.abs(np.array(last)[0, 0] - full[stop - 1]).max() < 1e-4


@pytest.mark.parametrize("overlap", [False, True])
def test_answer_that_fills_the_context_ends_with_length(checkpoint, overlap):
    """Reaching max_position_embeddings mid-answer ends the answer (finish reason "length"), every
    yielded token fed; a prompt that does not fit is refused before any forward."""
    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    prompt = np.random.default_rng(2).integers(3, 256, 500).tolist()
    cache, stats = model.make_cache(), GenerationStats()
    tokens = list(generate_tokens(model.forward, prompt, cache, max_tokens=100, stats=stats, overlap=overlap,
                                  max_context=model.max_context))  # fmt: skip
    assert len(tokens) == 512 - 500 and stats.finish_reason == "length"
    assert cache[0].offset == 512
    stats = GenerationStats()
    list(generate_tokens(model.forward, prompt, model.make_cache(), max_tokens=5, stats=stats, overlap=overlap))
    assert stats.finish_reason == "length"  # max_tokens is a length limit too
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return model.forward(*args, **kwargs)

    with pytest.raises(ValueError, match="does not fit the context: 0 cached \\+ 513 new positions"):
        list(generate_tokens(counting, prompt + prompt[:13], model.make_cache(), max_context=model.max_context))
    assert not calls


def test_interrupt_is_checked_between_prefill_chunks(checkpoint):
    """should_stop is asked before every prefill chunk: a long prompt stops after the chunk being computed."""
    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return model.forward(*args, **kwargs)

    cache, stats = model.make_cache(), GenerationStats()
    stream = generate_tokens(counting, list(range(3, 23)), cache, prefill_step_size=5, stats=stats,
                             should_stop=lambda: len(calls) >= 1)  # fmt: skip
    assert list(stream) == []
    assert len(calls) == 1 and cache[0].offset == 5
    assert stats.finish_reason == "interrupted" and stats.prompt_tokens == 5


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(temp=float("inf")), "temp=inf"),
        (dict(temp=float("nan")), "temp=nan"),
        (dict(temp=-0.5), "temp=-0.5"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_p=-0.1), "top_p=-0.1"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(min_p=2.0), "min_p=2.0"),
        (dict(min_p=float("nan")), "min_p=nan"),
    ],
)
def test_sampling_options_are_checked_on_construction(options, named):
    with pytest.raises(ValueError, match=named):
        SamplingOptions(**options)


def test_generation_limits_and_kv_settings_are_named_errors(checkpoint):
    from models.generation.generate import KVQuantization

    folder, _ = checkpoint
    model = models.load(str(folder), tokenizer=False)
    for max_tokens in (None, -5, 0):
        with pytest.raises(ValueError, match=f"max_tokens={max_tokens}"):
            list(generate_tokens(model.forward, [2, 3, 4], model.make_cache(), max_tokens=max_tokens))
    with pytest.raises(ValueError, match="start=-1"):
        KVQuantization(8, 64, start=-1)
    with pytest.raises(ValueError, match="group_size=48"):
        KVQuantization(8, 48)
    # T2's head dims are 32 (sliding) and 64 (full): a group of 64 cannot split the sliding layers' rows
    KVQuantization(8, 32).check_model(model.config)
    with pytest.raises(ValueError, match="group_size=64.*head dims \\[32, 64\\]"):
        KVQuantization(8, 64).check_model(model.config)


def test_sampling_given_twice_and_media_beside_a_prompt_are_refused(checkpoint):
    from models.generation.prompts import Prompt

    model = models.load(str(checkpoint[0]), tokenizer=False)
    with pytest.raises(ValueError, match=r"pass either sampling=SamplingOptions\(...\) or sampling keywords, not both \(got \['temp'\]\)"):
        next(model.stream([2, 5], max_tokens=2, sampling=SamplingOptions(), temp=0.5))
    with pytest.raises(ValueError, match="stream: a Prompt already carries its media"):
        next(model.stream(Prompt([2, 5]), images=["/nonexistent.png"]))
