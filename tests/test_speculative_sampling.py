"""Speculative sampling keeps the target's distribution exactly.

With temperature 1 and top-k 4 the first two sampled tokens have at most 16 outcomes, whose exact
probabilities follow from the target's logits (``p(t1) * p(t2 | t1)``, each through the sampler's
filters). Over many seeds, the outcomes of speculative sampling (drafts from a random assistant,
so most are rejected and resampled from ``max(0, p - q)``; and from the target itself, so all
are accepted) must fit those probabilities by Pearson's chi-square test at p > 0.001 (cells with
an expected count below 5 pooled). Plain sampling (mlx-lm's sampler) is held to the same test, which
also shows that the loop's ``distribution`` is the one mlx-lm samples from.

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
from tests.speculative_tiny import gemma4_pair

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


def test_sampled_pairs_fit_the_target_distribution(pair):
    """A quick run (100 seeds, the assistant drafting); the slow test below has ``sample_size`` per drafter."""
    target, assistant = pair
    joint = exact_joint(target)
    n, drafter, draft = 100, "assistant", assistant
    counts = samples(target, n, draft)
    p = chi_square_p(counts, joint, n)
    assert p > P_VALUE, f"{drafter}: chi-square p = {p:.2e} over {len(joint)} outcomes, counts {dict(counts)}"


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["plain", "assistant", "self"])
def test_sampled_pairs_fit_over_many_seeds(pair, drafter):
    target, assistant = pair
    joint = exact_joint(target)
    n = sample_size(joint)
    draft = {"plain": None, "assistant": assistant, "self": ModelDrafter(target, target)}[drafter]
    counts = samples(target, n, draft)
    p = chi_square_p(counts, joint, n)
    assert p > P_VALUE, f"{drafter}: chi-square p = {p:.2e} over {len(joint)} outcomes"


def test_the_chi_square_test_catches_a_wrong_rule(pair):
    """Accepting every draft (no rejection sampling) gives the drafter's distribution: the test must fail."""
    import models.generation.speculative as speculative

    target, assistant = pair
    joint = exact_joint(target)
    keep = speculative._accept_sampled

    def accept_all(verify, drafts, dists, options):
        m, token, proposed = keep(verify, drafts, dists, options)
        return len(drafts), mx.array(0), [int(d.item()) for d in drafts]

    speculative._accept_sampled = accept_all
    try:
        counts = samples(target, 100, assistant)
    finally:
        speculative._accept_sampled = keep
    outside = sum(v for c, v in counts.items() if c not in joint)
    assert outside > 0 or chi_square_p(counts, joint, 100) < P_VALUE
