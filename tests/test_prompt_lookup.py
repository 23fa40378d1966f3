"""Prompt-lookup drafts (``models.generation.prompt_lookup``): the lookup finds the latest earlier
n-gram, and greedy answers through the speculative loop equal plain greedy ones token for token."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402,F401
from models.generation.generate import GenerationStats, SamplingOptions  # noqa: E402
from models.generation.prompt_lookup import PromptLookupDrafter  # noqa: E402
from models.generation.speculative import DrafterMismatchError  # noqa: E402
from tests import hf_tiny  # noqa: E402


def test_the_lookup_takes_the_longest_latest_match():
    drafter = PromptLookupDrafter(100)
    assert drafter.lookup([1, 2, 3, 9, 7, 2, 3, 8, 5, 2, 3], 3) == [8, 5, 2]  # "2 3" last seen before "8 5"
    assert drafter.lookup([4, 1, 2, 3, 6, 0, 2, 3, 7, 1, 2, 3], 2) == [6, 0]  # "1 2 3" beats the later "2 3"
    assert drafter.lookup([1, 2, 3], 4) == []


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_tiny.load_causal_lm("T2", tmp_path_factory.mktemp("T2"))


def test_greedy_answers_are_unchanged(model):
    rng = np.random.default_rng(4)
    for length in (6, 30):
        phrase = [int(x) for x in rng.integers(3, model.vocab_size, length)]
        prompt = [2] + phrase + phrase[: length // 2]  # the answer may go on copying the phrase
        tokens = lambda **kw: [c.token for c in model.stream(prompt, max_tokens=16, sampling=SamplingOptions(), **kw) if c.token is not None]  # noqa: E731
        stats = GenerationStats()
        assert tokens(draft="prompt-lookup", num_draft_tokens=4, stats=stats) == tokens()
        assert stats.speculation.target_steps and stats.speculation.drafted


def test_a_sampled_answer_repeats_with_its_seed(model):
    prompt = [2, 5, 9, 11, 5, 9]
    run = lambda: [c.token for c in model.stream(prompt, max_tokens=10, sampling=SamplingOptions(temp=1.0, seed=3), draft="prompt-lookup") if c.token is not None]  # noqa: E731
    assert run() == run() and len(run()) == 10


def test_another_name_is_refused(model):
    with pytest.raises(DrafterMismatchError, match="prompt-lookup"):
        list(model.stream([2, 5], max_tokens=2, draft="ngrams"))
