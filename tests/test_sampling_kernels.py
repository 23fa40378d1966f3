"""The sampling kernels (``zoo_cpu.sampling``, ``zoo_cpu/src/sampling*``): a sampler's passes over
a vocabulary row, each one graph node, against float64 references: the top k, the
log-probabilities, the floor that top-p and min-p keep, and the inverse-CDF draw."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from tests import quant_tiny as qt
from zoo_cpu import extension, sampling

pytestmark = pytest.mark.skipif(not extension.available(), reason="the C++ extension is not built here")
ISAS = extension.status().module.available_isas() if extension.available() else []


@pytest.mark.parametrize("V, k", [(1, 1), (7, 3), (300, 37), (8192, 64), (262_144, 64), (262_144, 1), (20_000, 20_000)])
def test_top_k_is_a_stable_sort_cut_short(V, k):
    """Three rows: the k largest from the largest down with their indices, ties to the lower index
    (a row of few distinct values), -inf kept where the row has fewer finite values, NaN as -inf."""
    rng = np.random.default_rng(V + k)
    x = rng.standard_normal((3, V)).astype(np.float32) * 4
    x[1] = np.round(x[1])  # many ties
    x[2, rng.random(V) < 0.9] = -np.inf
    x[2, rng.random(V) < 0.05] = np.nan
    values, ids = sampling.top_k(mx.array(x), k)
    assert ids.dtype == mx.uint32 and values.shape == ids.shape == (3, k)
    ordered = np.where(np.isnan(x), -np.inf, x)
    want = np.argsort(-ordered, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.array(values), np.take_along_axis(ordered, want, axis=-1))
    finite = np.isfinite(np.take_along_axis(ordered, want, axis=-1))
    got = np.array(ids)
    np.testing.assert_array_equal(got[finite], want[finite])
    rows, cols = np.nonzero(~finite)  # past the finite values: indices of -inf or NaN entries
    assert not np.isfinite(ordered[rows, got[rows, cols]]).any()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 262_144), (2, 3, 1000), (5,), (2, 8193)])
def test_log_softmax_matches_float64(shape, isa):
    """Within float32's rounding of the result, -inf entries staying -inf, over strided input too."""
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    x.reshape(-1)[rng.random(x.size) < 0.01] = -np.inf
    x.reshape(-1)[0] = 3.0  # a finite value in every row
    want = qt.log_softmax(x)
    for given in (mx.array(x), mx.array(np.ascontiguousarray(np.swapaxes(x[None], 0, -1))).swapaxes(0, -1)[0]):
        got = np.array(sampling.log_softmax(given, isa=isa))
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(x))
        finite = np.isfinite(x)
        np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=2e-6)


def keep_floor64(logprobs: np.ndarray, top_p: float, min_p: float) -> float:
    """The reference floor of one row: top-p's words from the most likely down while the float64
    mass before each stays below top_p (every word equal to the last kept kept too), min-p's
    largest + log(min_p)."""
    x = np.where(np.isnan(logprobs), -np.inf, logprobs).astype(np.float64)
    floor = -np.inf
    if 0 < top_p < 1:
        ordered = np.sort(x)[::-1]
        above = np.concatenate([[0.0], np.cumsum(np.exp(ordered))[:-1]])
        floor = ordered[(above < top_p).sum() - 1]
    if min_p > 0:  # in float32, as mlx-lm's apply_min_p adds log(min_p) to the row's maximum
        floor = max(floor, np.float32(x.max()) + np.float32(np.log(np.float32(min_p))))
    return floor


def rows_of_kind(kind: str, V: int, rng) -> np.ndarray:
    """Normalised log-probabilities: a trained model's peaked row, a flat one (a nucleus of many
    thousand words), one of few distinct values (ties at the floor), one with -inf and NaN."""
    if kind == "peaked":
        x = rng.standard_normal(V) * 2.0
        x[rng.choice(V, 20, replace=False)] += 12.0
    elif kind == "flat":
        x = rng.standard_normal(V) * 3.0
    elif kind == "ties":
        x = np.round(rng.standard_normal(V) * 2.0)
    else:
        x = rng.standard_normal(V) * 2.0
        x[rng.random(V) < 0.3] = -np.inf
    x = qt.log_softmax(x.astype(np.float32)).astype(np.float32)
    if kind == "masked":
        x[rng.random(V) < 0.01] = np.nan
    return x


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
@pytest.mark.parametrize("V", [50, 300, 262_144])
@pytest.mark.parametrize("top_p, min_p", [(0.1, 0.0), (0.9, 0.0), (0.95, 0.0), (0.999, 0.0), (0.0, 0.05), (0.9, 0.02), (1.0, 0.3)])
def test_keep_floor_is_the_float64_nucleus(kind, V, top_p, min_p):
    """The floor lies between the float64 references for top_p -+ 1e-6 (the masses are summed in
    another order than the reference's, so a word whose mass before it lies that close to top_p
    may fall either side), on rows whose nucleus lies inside the first candidates and far past them."""
    rng = np.random.default_rng(V + int(top_p * 1000) + int(min_p * 100))
    rows = np.stack([rows_of_kind(kind, V, rng) for _ in range(2)])
    got = np.array(sampling.keep_floor(mx.array(rows), top_p, min_p))
    assert got.shape == (2, 1) and got.dtype == np.float32
    for row, floor in zip(rows, got[:, 0]):
        wider, narrower = (keep_floor64(row, p, min_p) for p in (min(top_p + 1e-6, 1 - 1e-9), top_p - 1e-6))
        if not 0 < top_p < 1:
            wider = narrower = keep_floor64(row, top_p, min_p)
        assert np.float32(wider) <= floor <= np.float32(narrower), (floor, wider, narrower)


def test_keep_floor_with_both_filters_off_keeps_everything_and_of_a_dead_row_is_minus_inf():
    x = mx.array(rows_of_kind("flat", 1000, np.random.default_rng(0))[None])
    assert np.array(sampling.keep_floor(x, 0.0, 0.0)).item() == -np.inf
    assert np.array(sampling.keep_floor(x, 1.0, 0.0)).item() == -np.inf
    dead = mx.array(np.full((1, 500), -np.inf, np.float32))
    assert np.array(sampling.keep_floor(dead, 0.9, 0.1)).item() == -np.inf


def inverse_cdf64(x: np.ndarray, u: float, scale: float, floor: float) -> tuple[int, float]:
    """The reference draw (the first index whose float64 running sum passes u times the total) and
    how close u's target lies to a boundary between words, as a fraction of the total."""
    kept = np.where(np.isnan(x) | (x < floor), -np.inf, x).astype(np.float64)
    w = np.exp((kept - kept.max()) * scale)
    edges = np.cumsum(w) / w.sum()
    pick = int(np.searchsorted(edges, u, side="right"))
    return pick, float(np.abs(edges - u).min())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "masked"])
@pytest.mark.parametrize("V, scale, top_p", [(262_144, 1.0, 0.0), (262_144, 1 / 0.7, 0.9), (300, 2.0, 0.0), (4097, 0.5, 0.95)])
def test_categorical_is_the_float64_inverse_cdf(kind, V, scale, top_p, isa):
    """Each draw is the reference's index for its uniform number, away from the boundaries (within
    1e-5 of the total either index is right), and never a word below the floor, -inf or NaN."""
    rng = np.random.default_rng(V + len(kind))
    rows = np.stack([rows_of_kind(kind, V, rng) for _ in range(3)])
    floor = sampling.keep_floor(mx.array(rows), top_p, 0.0) if top_p else None
    floors = np.array(floor)[:, 0] if floor is not None else np.full(3, -np.inf)
    for u in (0.0, 0.013, 0.5, 0.77, 0.9999999):
        uniforms = np.array([u, (u + 0.31) % 1.0, (u + 0.67) % 1.0], np.float32)
        got = np.array(sampling.categorical(mx.array(rows), mx.array(uniforms), scale, floor, isa=isa))
        assert got.dtype == np.uint32 and got.shape == (3,)
        for row, g, fl, uu in zip(rows, got, floors, uniforms):
            assert np.isfinite(row[g]) and row[g] >= fl
            want, margin = inverse_cdf64(row, float(uu), scale, fl)
            if margin > 1e-5:
                assert g == want, (g, want, uu)


def test_categorical_draws_follow_the_distribution():
    """A grid of 20,000 uniform numbers lands on each word in proportion to its probability (within
    two draws: the inverse CDF of an even grid), over a [2, 3, V] batch."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((2, 3, 40)) * 2).astype(np.float32)
    n = 20_000
    grid = ((np.arange(n) + 0.5) / n).astype(np.float32)
    rows = mx.array(np.broadcast_to(x, (n, 2, 3, 40)).copy())
    draws = np.array(sampling.categorical(rows, mx.array(np.broadcast_to(grid[:, None, None], (n, 2, 3)).copy()), 0.8))
    for b in range(2):
        for r in range(3):
            p = np.exp(qt.log_softmax(x[b, r] * 0.8))
            np.testing.assert_allclose(np.bincount(draws[:, b, r], minlength=40), p * n, atol=2.0)


def test_categorical_of_a_row_with_no_weight_is_its_first_largest_value():
    x = np.array([[1.0, 5.0, 5.0, 2.0], [-np.inf, -np.inf, -np.inf, -np.inf], [np.nan] * 4], np.float32)
    floor = mx.array(np.array([[6.0], [0.0], [0.0]], np.float32))  # above every value of each row
    got = np.array(sampling.categorical(mx.array(x), mx.array(np.full(3, 0.5, np.float32)), 1.0, floor))
    assert got.tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sampling.top_k(mx.zeros((2, 5)), 6), r"k must be in \[1, 5\] \(x's last axis\), got 6"),
        (lambda: sampling.top_k(mx.zeros((2, 5), dtype=mx.float16), 2), r"float32"),
        (lambda: sampling.log_softmax(mx.zeros((2, 0))), r"x must have a last axis of at least one value, got \[2, 0\]"),
        (lambda: sampling.keep_floor(mx.zeros((2, 5)), 1.5, 0.0), r"top_p must be in \[0, 1\] \(0 or 1: off\), got 1.5"),
        (lambda: sampling.keep_floor(mx.zeros((2, 5)), 0.5, -0.1), r"min_p must be in \[0, 1\] \(0: off\), got -0.1"),
        (lambda: sampling.categorical(mx.zeros((2, 5)), mx.zeros((5,))), r"u must be \[2\] \(one number a row of x \[2, 5\]\), got \[5\]"),
        (lambda: sampling.categorical(mx.zeros((2, 5)), mx.zeros((2,)), 0.0), r"scale must be a finite number > 0, got 0"),
        (lambda: sampling.categorical(mx.zeros((2, 5)), mx.zeros((2,)), 1.0, mx.zeros((2,))),
         r"floor must be \[2, 1\] \(one value a row of x \[2, 5\]\), got \[2\]"),
    ],
)
def test_bad_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
