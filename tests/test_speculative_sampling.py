"""Speculative sampling keeps the target's distribution exactly.

With temperature 1 and top-k 4 the first two sampled tokens have at most 16 outcomes, whose exact
probabilities follow from the target's logits (``p(t1) * p(t2 | t1)``, each through the sampler's
filters). Over many seeds, the outcomes of speculative sampling must fit those probabilities by
Pearson's chi-square test at p > 0.001 (cells with an expected count below 5 pooled), with drafts
from: a random assistant (its top 4 never meets the target's here, so every draft is rejected and
the residual ``max(0, p - q)`` is ``p`` itself); the target with its favourite token withheld
(``WithoutFavourite``: drafts are accepted in part, and a rejection must resample the favourite,
a residual unlike ``p``); and the target itself (all are accepted). Plain sampling (mlx-lm's
sampler) is held to the same test, which also shows that the loop's ``distribution`` is the one
mlx-lm samples from. Accepting every draft, and resampling a rejection from ``p`` instead of the
residual, fail the test (``test_the_chi_square_test_catches_a_wrong_rule``).

Sample size of the slow test (``sample_size``): it must catch, with power 0.99 at that p-value, any
outcome distribution at total-variation distance 0.1 or more from the exact one over the test's
cells. Such a distribution has chi-square divergence at least ``4 * 0.1**2`` (Cauchy-Schwarz), so
``n`` seeds give the test a noncentrality of at least ``0.04 * n``; over the 16 outcomes here (15
degrees of freedom; none pooled at this n) power 0.99 needs 55.2, so n = 1380 per drafter (the
3000 used before reached distance 0.068).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

pytest.importorskip("transformers")
stats_ = pytest.importorskip("scipy.stats")

import models  # noqa: F401
import mlx.core as mx

from models.generation.generate import SamplingOptions
from models.generation.speculative import ModelDrafter, distribution
from tests.speculative_tiny import WithoutFavourite, gemma4_pair

PROMPT = [2, 40, 41]
OPTIONS = dict(temp=1.0, top_k=4)
P_VALUE = 1e-3
POWER, DISTANCE = 0.99, 0.1  # the slow test's power against a total-variation distance of DISTANCE


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return gemma4_pair("E2B_like", tmp_path_factory.mktemp("sampling"))


def exact_joint(target) -> dict[tuple[int, int], float]:
    options = SamplingOptions(**OPTIONS)
    first = np.array(distribution(target.logits(PROMPT)[0, -1], options))
    joint = {}
    for t1 in np.flatnonzero(first):
        second = np.array(distribution(target.logits(PROMPT + [int(t1)])[0, -1], options))
        for t2 in np.flatnonzero(second):
            joint[(int(t1), int(t2))] = float(first[t1] * second[t2])
    return joint


def drafter_named(name: str, target, assistant):
    """The drafter of a test case: None (plain sampling), the assistant, the target drafting for
    itself (``self``) or the same without its favourite token (``without_favourite``)."""
    if name == "plain":
        return None
    if name == "assistant":
        return assistant
    self_drafter = ModelDrafter(target, target)
    return {"self": self_drafter, "without_favourite": WithoutFavourite(self_drafter)}[name]


def samples(target, n: int, draft=None) -> Counter:
    out = Counter()
    for seed in range(n):
        options = dict(draft=draft, num_draft_tokens=2) if draft is not None else {}
        tokens = [c.token for c in target.stream(PROMPT, max_tokens=3, sampling=SamplingOptions(seed=seed, **OPTIONS), **options)]
        out[tuple(tokens[:2])] += 1
    return out


def sample_size(joint: dict) -> int:
    """Seeds giving the chi-square test ``POWER`` against any distribution at total-variation distance
    ``DISTANCE`` from ``joint`` over its cells (noncentrality at least ``4 n DISTANCE**2``, degrees of
    freedom at most ``len(joint) - 1``)."""
    from scipy.optimize import brentq

    df = len(joint) - 1
    critical = stats_.chi2.isf(P_VALUE, df)
    noncentrality = brentq(lambda lam: stats_.ncx2.sf(critical, df, lam) - POWER, 1e-6, 1e4)
    return int(np.ceil(noncentrality / (4 * DISTANCE**2)))


def chi_square_p(counts: Counter, joint: dict, n: int) -> float:
    assert set(counts) <= set(joint), f"outcomes outside the target's support: {set(counts) - set(joint)}"
    cells = sorted(joint, key=joint.get, reverse=True)
    expected = np.array([joint[c] * n for c in cells])
    observed = np.array([counts.get(c, 0) for c in cells], dtype=float)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    return float(stats_.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


QUICK = [("assistant", 100), ("without_favourite", 200)]  # at 200 seeds a resample from p fails (below)


@pytest.mark.parametrize("drafter, n", QUICK)
def test_sampled_pairs_fit_the_target_distribution(pair, drafter, n):
    """A quick run of ``n`` seeds; the slow test below has ``sample_size`` per drafter."""
    target, assistant = pair
    joint = exact_joint(target)
    counts = samples(target, n, drafter_named(drafter, target, assistant))
    p = chi_square_p(counts, joint, n)
    assert p > P_VALUE, f"{drafter}: chi-square p = {p:.2e} over {len(joint)} outcomes, counts {dict(counts)}"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["plain", "assistant", "without_favourite", "self"])
def test_sampled_pairs_fit_over_many_seeds(pair, drafter):
    target, assistant = pair
    joint = exact_joint(target)
    n = sample_size(joint)
    counts = samples(target, n, drafter_named(drafter, target, assistant))
    p = chi_square_p(counts, joint, n)
    assert p > P_VALUE, f"{drafter}: chi-square p = {p:.2e} over {len(joint)} outcomes"


def accept_every_draft(keep):
    """No rejection sampling: the second token follows the drafter's distribution."""

    def rule(verify, drafts, dists, options, keys):
        m, token, proposed = keep(verify, drafts, dists, options, keys)
        return len(drafts), mx.array(0), [int(d.item()) for d in drafts]

    return rule


def resample_from_p(keep):
    """A rejection resampled from the target's ``p`` instead of the residual ``max(0, p - q)``."""

    def rule(verify, drafts, dists, options, keys):
        m, token, proposed = keep(verify, drafts, dists, options, keys)
        if m < len(drafts):
            token = mx.random.categorical(mx.log(distribution(verify[m], options)), key=keys())
        return m, token, proposed

    return rule


@pytest.mark.parametrize("rule, drafter", [(accept_every_draft, "assistant"), (resample_from_p, "without_favourite")])
def test_the_chi_square_test_catches_a_wrong_rule(pair, monkeypatch, rule, drafter):
    """The quick test's run of ``drafter`` under a wrong acceptance rule must fail."""
    import models.generation.speculative as speculative

    target, assistant = pair
    joint = exact_joint(target)
    n = dict(QUICK)[drafter]
    monkeypatch.setattr(speculative, "_accept_sampled", rule(speculative._accept_sampled))
    counts = samples(target, n, drafter_named(drafter, target, assistant))
    outside = sum(v for c, v in counts.items() if c not in joint)
    assert outside > 0 or chi_square_p(counts, joint, n) < P_VALUE


def test_speculative_draws_use_the_request_seed_not_the_global_random_state(pair):
    """The same seed repeats the same tokens, and a speculative answer leaves MLX's global random
    state where it was (it draws from its own key stream, as plain sampling does)."""
    target, assistant = pair

    def answer(seed):
        options = SamplingOptions(seed=seed, **OPTIONS)
        return [c.token for c in target.stream(PROMPT, max_tokens=8, sampling=options, draft=assistant, num_draft_tokens=2)]

    mx.random.seed(123)
    expected_next = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(123)
    first = answer(7)
    assert mx.random.uniform(shape=(4,)).tolist() == expected_next
    mx.random.seed(999)
    assert answer(7) == first
    assert len({tuple(answer(seed)) for seed in range(6)}) > 1
