"""Speculative decoding is exact: greedy output equals plain greedy output token for token.

Targets: Gemma 4 with per-layer inputs and KV sharing (window 8) and with a MoE (window 4), each
with a tiny random assistant (which is almost never right, so nearly every draft is rejected and
rolled back); the same targets drafting for themselves (every draft accepted); drafters that are
wrong on purpose at a fixed rate; Gemma 3 with classic draft models; quantized KV caches; a
prompt with images. Generations run long enough to wrap every sliding window many times; the
exhaustive matrix (k = 1..8, hundreds of tokens) is marked slow.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import models  # noqa: F401  (a fast BLAS before MLX)

from graphs.gemma4_assistant_config import DrafterMismatchError
from models.generation.generate import GenerationOptionError, KVQuantization, generate_tokens
from models.generation.speculative import AssistantDrafter, ModelDrafter, make_drafter, speculative_tokens
from tests.speculative_tiny import WrongOnPurpose, first_difference, gemma4_pair, run

PROMPT = [2, 17, 99, 45, 3, 200, 18, 7, 77, 5, 61, 62, 63]


@pytest.fixture(scope="module", params=["E2B_like", "T3"])
def gemma4(request, tmp_path_factory):
    target, assistant = gemma4_pair(request.param, tmp_path_factory.mktemp(request.param))
    plain = {}

    def reference(n, **options):
        key = (n, tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in plain:
            plain[key] = run(target, PROMPT, n, **options)
        return plain[key]

    return request.param, target, assistant, reference


def check_exact(target, reference, n, draft, k, **options):
    want, _, want_cache = reference(n, **options)
    got, stats, cache = run(target, PROMPT, n, draft=draft, num_draft_tokens=k, **options)
    assert first_difference(got, want) is None, f"k={k}: first difference at token {first_difference(got, want)}"
    assert cache[0].offset == want_cache[0].offset == len(PROMPT) + len(want)
    return stats.speculation


@pytest.mark.parametrize("k", [1, 4, 8])
def test_assistant_greedy_equals_plain(gemma4, k):
    name, target, assistant, reference = gemma4
    counts = check_exact(target, reference, 60, assistant, k)
    assert counts.drafted > 0 and counts.emitted == 60


def test_self_drafting_accepts_everything_and_is_exact(gemma4):
    name, target, _, reference = gemma4
    counts = check_exact(target, reference, 60, ModelDrafter(target, target), 5)
    assert counts.acceptance_rate == 1.0 and counts.tokens_per_step > 5


def test_forced_rejections_are_exact(gemma4):
    name, target, assistant, reference = gemma4
    drafter = WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, every=3)
    counts = check_exact(target, reference, 60, drafter, 4)
    assert 0 < counts.acceptance_rate < 1


def test_quantized_kv_is_exact(gemma4):
    name, target, assistant, reference = gemma4
    kv = KVQuantization(bits=8, group_size=32, start=8)
    check_exact(target, reference, 40, assistant, 3, kv_quantization=kv)
    check_exact(target, reference, 40, WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, 2), 4, kv_quantization=kv)


def test_stop_token_inside_accepted_drafts_ends_the_answer_there(gemma4):
    """A stop id among accepted drafts: the answer ends before it and the caches hold exactly the answer."""
    name, target, assistant, reference = gemma4
    want, _, _ = reference(40)
    stop = want[25]
    cut = want.index(stop)
    target.generation_config = {"eos_token_id": [stop]}
    try:
        got, stats, cache = run(target, PROMPT, 40, draft=ModelDrafter(target, target), num_draft_tokens=8)
    finally:
        target.generation_config = {}
    assert got == want[:cut] and stats.finish_reason == "stop"
    assert cache[0].offset == len(PROMPT) + cut


@pytest.mark.slow
@pytest.mark.parametrize("k", range(1, 9))
def test_long_generations_wrap_every_window_and_stay_exact(gemma4, k):
    """Hundreds of tokens on windows of 4 and 8: each window wraps dozens of times."""
    name, target, assistant, reference = gemma4
    check_exact(target, reference, 400, assistant, k)
    check_exact(target, reference, 400, WrongOnPurpose(ModelDrafter(target, target), target.vocab_size, every=k + 1), k)
    check_exact(target, reference, 300, ModelDrafter(target, target), k, kv_quantization=KVQuantization(bits=4, group_size=32, start=20))


def test_mismatched_drafters_are_named_errors(gemma4, tmp_path):
    name, target, assistant, _ = gemma4
    other = "T3" if name == "E2B_like" else "E2B_like"
    _, other_assistant = gemma4_pair(other, tmp_path)
    with pytest.raises(DrafterMismatchError, match="not made for"):
        make_drafter(other_assistant, target)
    with pytest.raises(GenerationOptionError, match="num_draft_tokens"):
        run(target, PROMPT, 4, draft=assistant, num_draft_tokens=0)
    assert isinstance(make_drafter(assistant, target), AssistantDrafter)


@pytest.mark.parametrize("loop", [
    lambda **options: generate_tokens(None, [1], [], **options),
    lambda **options: speculative_tokens(None, None, [1], [], **options),
], ids=["plain", "speculative"])  # fmt: skip
def test_both_loops_take_one_set_of_options_checked_alike(loop):
    """The loops share ``LoopOptions``: a bad value is refused by name before any model work, an unknown option too."""
    with pytest.raises(GenerationOptionError, match="max_tokens"):
        next(loop(max_tokens=0))
    with pytest.raises(GenerationOptionError, match="prefill_step_size"):
        next(loop(prefill_step_size=-1))
    with pytest.raises(TypeError, match="no_such_option"):
        next(loop(no_such_option=1))
