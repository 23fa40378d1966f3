"""A request's processors and what it sees of its distribution (``models.generation.processors``).

Penalties and the logit bias are mlx-lm's processors, fed the prompt and the tokens drawn since as
mlx-lm's ``generate_step`` feeds them; log-probabilities are a log-softmax of ``Model.logits`` at
each position (after the processors); ``n`` choices share one prefill, greedy choices agree and
seeded ones each equal a lone request with their seed. Every option gives the same tokens alone
and batched.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import models  # noqa: E402,F401  (the project before mlx_lm's own imports)
from mlx_lm.sample_utils import make_logits_processors  # noqa: E402

from models.generation.batch import BatchGenerator, BatchRequest  # noqa: E402
from models.generation.generate import GenerationOptionError, SamplingOptions, TokenSampler, generate_tokens  # noqa: E402
from tests import quant_tiny as qt  # noqa: E402
from tests import hf_tiny  # noqa: E402

STOP = frozenset({1})
PENALIZED = [
    SamplingOptions(repetition_penalty=1.5),
    SamplingOptions(presence_penalty=1.5),
    SamplingOptions(frequency_penalty=-0.7),
    SamplingOptions(logit_bias={5: 4.0, 17: -100.0}),
    SamplingOptions(temp=0.8, seed=4, presence_penalty=0.9, frequency_penalty=1.1, repetition_penalty=1.2, logit_bias={9: 2.5}),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return hf_tiny.load_causal_lm("T2", tmp_path_factory.mktemp("T2"))


def prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [[2] + [int(x) for x in rng.integers(3, vocab, n)] for n in (4, 11, 7, 15, 6)]


@pytest.mark.parametrize("options", PENALIZED[:4], ids=["repetition", "presence", "frequency", "logit_bias"])
def test_processed_logprobs_equal_mlx_lm_processors_step_by_step(options):
    """Three steps on fixed random logits: the sampler's processed log-probabilities equal mlx-lm's
    processors applied to the prompt plus the tokens drawn so far (``generate_step``'s bookkeeping)."""
    rng = np.random.default_rng(0)
    context = [3, 7, 7, 5, 12, 40, 5]
    theirs = make_logits_processors(logit_bias=options.logit_bias, repetition_penalty=options.repetition_penalty,
                                    presence_penalty=options.presence_penalty, frequency_penalty=options.frequency_penalty)  # fmt: skip
    sampler = TokenSampler(options, context, keep_logprobs=True)
    tokens = list(context)
    for _ in range(3):
        logits = rng.standard_normal((1, 64)).astype(np.float32) * 3
        token = sampler(mx.array(logits))  # mlx-lm's processors write into the logits they are given
        want = mx.array(logits)
        for process in theirs:
            want = process(mx.array(tokens), want)
        want = want - mx.logsumexp(want, axis=-1, keepdims=True)
        np.testing.assert_allclose(np.array(sampler.logprobs), np.array(want), atol=1e-6)
        assert token.item() == int(np.argmax(np.array(want)))
        tokens.append(int(token.item()))


def test_option_ranges_are_named():
    for fields, name in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
                         (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={3: 101}), "logit_bias")):  # fmt: skip
        with pytest.raises(GenerationOptionError, match=name):
            SamplingOptions(**fields)


def test_top_logprobs_equal_a_log_softmax_of_model_logits(model):
    """Greedy, alone and batched beside other requests: every step's token log-probability and top 5
    equal a log-softmax of ``Model.logits`` of the prompt and the answer so far (1e-5)."""
    ps = prompts(model.vocab_size)
    generator = BatchGenerator(model, max_batch=4)
    requests = [BatchRequest(p, max_tokens=8, sampling=SamplingOptions(), stop_ids=STOP, logprobs=5 if i < 3 else None)
                for i, p in enumerate(ps)]  # fmt: skip
    ids = [generator.submit(r) for r in requests]
    seen: dict[int, list] = {i: [] for i in ids}
    while generator.busy:
        for event in generator.step():
            if event.logprob is not None:
                seen[event.request_id].append(event.logprob)
    lone = BatchGenerator(model, max_batch=1)
    lone.submit(BatchRequest(ps[0], max_tokens=8, sampling=SamplingOptions(), stop_ids=STOP, logprobs=5))
    alone = []
    while lone.busy:
        alone.extend(e.logprob for e in lone.step() if e.logprob is not None)
    for prompt, rid in zip(ps[:3], ids[:3]):
        answer = [lp.token for lp in seen[rid]]
        assert answer
        want = qt.log_softmax(model.logits(prompt + answer)[0, len(prompt) - 1 :])
        for step, lp in enumerate(seen[rid]):
            top = np.argsort(-want[step], kind="stable")[:5]
            assert [t for t, _ in lp.top] == top.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], want[step][top], atol=1e-5)
            assert abs(lp.logprob - want[step][lp.token]) < 1e-5
    assert [(lp.token, [t for t, _ in lp.top]) for lp in alone] == [(lp.token, [t for t, _ in lp.top]) for lp in seen[ids[0]]]
    np.testing.assert_allclose([[v for _, v in lp.top] for lp in alone], [[v for _, v in lp.top] for lp in seen[ids[0]]], atol=1e-5)
    assert all(not seen[i] for i in ids[3:])


def test_penalized_requests_equal_alone_and_batched(model):
    ps = prompts(model.vocab_size)
    want = [list(generate_tokens(model._forward, p, model.make_cache(), sampling=o, max_tokens=10, stop_ids=STOP))
            for p, o in zip(ps, PENALIZED)]  # fmt: skip
    plain = list(generate_tokens(model._forward, ps[1], model.make_cache(), max_tokens=10, stop_ids=STOP))
    assert want[1] != plain  # the penalty changes the answer
    generator = BatchGenerator(model, max_batch=3)
    got = generator.run([BatchRequest(p, max_tokens=10, sampling=o, stop_ids=STOP) for p, o in zip(ps, PENALIZED)])
    assert got == want


def test_a_logit_bias_outside_the_vocabulary_is_refused(model):
    with pytest.raises(ValueError, match=f"logit_bias: token id {model.vocab_size}"):
        BatchGenerator(model).submit(BatchRequest([2, 5], sampling=SamplingOptions(logit_bias={model.vocab_size: 1.0})))


def test_n_choices_share_one_prefill(model, monkeypatch):
    prompt = prompts(model.vocab_size)[3]
    import models.generation.batch as batch

    prefills = []  # the rows of each prompt forward (the generator's ragged feeds pass ``new``)
    real = batch.batch_caches
    monkeypatch.setattr(batch, "batch_caches", lambda caches, *new: (new and prefills.append(len(caches))) or real(caches, *new))
    generator = BatchGenerator(model, max_batch=4)
    greedy = generator.run([BatchRequest(prompt, max_tokens=9, stop_ids=STOP, n=3)])
    assert len(greedy) == 3 and greedy[0] == greedy[1] == greedy[2] and prefills == [1]
    seeded = SamplingOptions(temp=1.0, seed=11)
    choices = generator.run([BatchRequest(prompt, max_tokens=9, sampling=seeded, stop_ids=STOP, n=3)])
    assert len({tuple(c) for c in choices}) == 3
    for i, choice in enumerate(choices):  # choice i is the lone request seeded seed + i
        lone = SamplingOptions(temp=1.0, seed=11 + i)
        assert choice == list(generate_tokens(model._forward, prompt, model.make_cache(), sampling=lone, max_tokens=9, stop_ids=STOP))
    with pytest.raises(ValueError, match="n=5 choices need 5 rows"):
        generator.submit(BatchRequest(prompt, n=5))
