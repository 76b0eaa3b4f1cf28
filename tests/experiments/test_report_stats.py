"""Tests for experiments/report/stats.py, the report's small-n statistics, against SciPy and
against exhaustive enumerations written here."""

import itertools
import math

import numpy as np
import pytest
import scipy.stats

from experiments.report import stats

# The STS-B IsoBN − none differences of the committed normalizers.jsonl (best epoch, seeds 1-3).
STSB_ISOBN = [0.0046, 0.0009, 0.0034]
SAMPLES = [
    STSB_ISOBN,
    [0.5, -0.2],
    [0.03, 0.03, 0.04, 0.02],
    [-0.0371, -0.1999, -0.6047],
    [1.2, -0.3, 0.8, 2.1, 0.4, -0.1, 0.9, 1.5],
]


@pytest.mark.parametrize("diffs", SAMPLES)
def test_t_interval_and_p_equal_scipy(diffs):
    got = stats.t_test(diffs)
    ref = scipy.stats.ttest_1samp(diffs, 0.0)
    assert got["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    lo, hi = scipy.stats.t.interval(
        0.95, len(diffs) - 1, loc=np.mean(diffs), scale=scipy.stats.sem(diffs)
    )
    assert (got["lo"], got["hi"]) == pytest.approx((lo, hi), rel=1e-10, abs=1e-15)
    ci = ref.confidence_interval(0.95)
    assert (got["lo"], got["hi"]) == pytest.approx((ci.low, ci.high), rel=1e-10, abs=1e-15)
    assert got["mean"] == pytest.approx(np.mean(diffs), abs=1e-15)


def test_t_test_of_the_stsb_isobn_differences_is_the_issue_s():
    # The issue's p = 0.12 and [-0.0018, +0.0077] are of the unrounded scores; the rounded
    # differences give 0.113 and [-0.0017, +0.0077]: 0 inside, the paper's +0.010 outside.
    got = stats.t_test(STSB_ISOBN)
    assert round(got["mean"], 4) == 0.0030 and round(got["p"], 3) == 0.113
    assert (round(got["lo"], 4), round(got["hi"], 4)) == (-0.0017, 0.0077)


def test_t_test_degenerate_cases():
    assert all(math.isnan(v) for k, v in stats.t_test([0.1]).items() if k != "mean")
    # Equal differences: t = inf, as SciPy's p = 0; all zero: no difference, p = 1.
    assert stats.t_test([0.25, 0.25, 0.25]) == {"mean": 0.25, "lo": 0.25, "hi": 0.25, "p": 0.0}
    assert stats.t_test([0.0, 0.0])["p"] == 1.0


def _enumerated_sign_flip(diffs, direction) -> float:
    """The exact one-sided p, by listing every sign pattern."""
    d = [direction * x for x in diffs]
    observed = sum(d)
    hits = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        flipped = sum(s * abs(x) for s, x in zip(signs, d, strict=True))
        hits += flipped >= observed - 1e-12
    return hits / 2 ** len(d)


@pytest.mark.parametrize("diffs", SAMPLES + [[0.01, 0.0, -0.02, 0.03, 0.04]])
@pytest.mark.parametrize("direction", [+1, -1])
def test_sign_flip_p_equals_enumeration_and_scipy_permutation_test(diffs, direction):
    got = stats.sign_flip_p(diffs, direction)
    assert got["p"] == pytest.approx(_enumerated_sign_flip(diffs, direction), abs=1e-15)
    ref = scipy.stats.permutation_test(
        (np.asarray(diffs),),
        lambda x, axis: np.mean(x, axis=axis),
        permutation_type="samples",
        n_resamples=np.inf,
        alternative="greater" if direction > 0 else "less",
    )
    assert got["p"] == pytest.approx(ref.pvalue, abs=1e-12)
    assert got["min_p"] == 2.0 ** -len(diffs)
    assert got["method"] == f"exact, 2^{len(diffs)} patterns"


def test_sign_flip_floor_is_two_to_the_minus_n():
    # Three differences of one sign reach only 1/8; six reach 1/64.
    assert stats.sign_flip_p(STSB_ISOBN, +1)["p"] == 0.125
    assert stats.sign_flip_p([0.05, 0.051, 0.049] * 2, +1)["p"] == 1 / 64
    assert stats.sign_flip_p(STSB_ISOBN, -1)["p"] == 1.0


def test_sign_flip_above_16_is_monte_carlo_with_stated_draws_and_seed():
    rng = np.random.default_rng(3)
    diffs = list(rng.normal(0.15, 1.0, size=18))
    exact = _exact_numpy(diffs)
    got = stats.sign_flip_p(diffs, +1)
    assert got["method"] == f"Monte Carlo, {stats.MC_DRAWS} draws, default_rng({stats.MC_SEED})"
    se = math.sqrt(exact * (1 - exact) / stats.MC_DRAWS)
    assert abs(got["p"] - exact) < 5 * se
    assert stats.sign_flip_p(diffs, +1)["p"] == got["p"]  # the fixed seed: reproducible


def _exact_numpy(diffs) -> float:
    """The exact p over 2^18 patterns, in chunks (independent of `stats`' layout)."""
    d = np.asarray(diffs)
    observed, n, hits = d.sum(), len(d), 0
    for start in range(0, 2**n, 2**14):
        codes = np.arange(start, start + 2**14)
        signs = np.where((codes[:, None] >> np.arange(n)) & 1, -1.0, 1.0)
        hits += int(np.sum(signs @ np.abs(d) >= observed - 1e-12))
    return hits / 2**n


def test_holm_worked_example():
    # p sorted: 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1 = 0.04, raised
    # to the running maximum 0.06); returned in the input order.
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # A NaN line keeps NaN and leaves the family at m = 3: 0.02 x3 = 0.06, 0.5 x2 = 1.0 (capped
    # at 1), 0.7 x1 raised to the running maximum 1.0.
    got = stats.holm([0.7, float("nan"), 0.02, 0.5])
    assert math.isnan(got[1]) and [got[0], got[2], got[3]] == pytest.approx([1.0, 0.06, 1.0])
    assert stats.holm([]) == []


def test_pearson_spearman_and_leave_one_value_out():
    x = [0.1, 0.12, 0.2, 0.22, 0.3, 0.31, 0.9, 0.95]
    y = [0.80, 0.79, 0.77, 0.78, 0.75, 0.74, 0.95, 0.97]
    values = [-1, -1, 0, 0, 1, 1, 5, 5]
    got = stats.correlation(x, y, values)
    assert got["pearson"]["r"] == pytest.approx(scipy.stats.pearsonr(x, y).statistic, abs=1e-12)
    assert got["pearson"]["p"] == pytest.approx(scipy.stats.pearsonr(x, y).pvalue, rel=1e-9)
    assert got["spearman"]["r"] == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert got["spearman"]["p"] == pytest.approx(scipy.stats.spearmanr(x, y).pvalue, rel=1e-9)
    rs = {}
    for v in set(values):
        keep = [i for i, w in enumerate(values) if w != v]
        rs[v] = np.corrcoef([x[i] for i in keep], [y[i] for i in keep])[0, 1]
    loo = got["leave_one_out"]
    assert loo["min"] == pytest.approx(min(rs.values()), abs=1e-12)
    assert loo["max"] == pytest.approx(max(rs.values()), abs=1e-12)
    # The value 5 alone makes r positive: without it, r is negative.
    assert got["pearson"]["r"] > 0 and loo["argmin"] == 5 and loo["min"] < 0
    assert loo["n_groups"] == 4
    # Fewer than 3 values: no leave-one-out range.
    assert math.isnan(stats.leave_one_out(x[:4], y[:4], values[:4])["min"])


def test_bootstrap_ci_is_numpy_percentiles_of_resampled_means():
    d = np.asarray(STSB_ISOBN)
    idx = np.random.default_rng(0).integers(0, 3, size=(10_000, 3))
    ref = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    assert stats.bootstrap_ci(STSB_ISOBN) == pytest.approx(tuple(ref), abs=1e-15)
    # With 3 seeds of one sign the bootstrap excludes 0 although the t interval does not.
    assert stats.bootstrap_ci(STSB_ISOBN)[0] > 0 > stats.t_test(STSB_ISOBN)["lo"]


def test_row_statistics_equal_the_scalar_ones_row_by_row():
    """The calibration's every-split-at-once forms give, row by row, exactly what `t_test`,
    `t_below`, `holm` and `sign_flip_exact` give (rows with s = 0 and tied p included), and
    the sign flips equal the enumeration."""
    rng = np.random.default_rng(5)
    for n in (2, 3, 5, 12, 20):  # 20: the pooled pairs of four tasks at five seeds
        x = rng.normal(0.002, 0.01, (30, n)).round(3)
        x[0], x[1] = 0.0, 0.004  # s = 0: p of 1, then of 0
        mean, p = stats.t_test_rows(x)
        for row, m, q in zip(x, mean, p, strict=True):
            want = stats.t_test(row.tolist())
            assert (m, q) == (want["mean"], want["p"])
        for bound in (0.01, -0.01):
            got = stats.t_below_rows(x, bound)
            assert got.tolist() == [stats.t_below(row.tolist(), bound) for row in x]
        toward, against = stats.sign_flip_exact_rows(x)
        assert toward.tolist() == [stats.sign_flip_exact(row.tolist(), +1) for row in x]
        assert against.tolist() == [stats.sign_flip_exact(row.tolist(), -1) for row in x]
        if n <= 5:
            assert toward.tolist() == [_enumerated_sign_flip(row, +1) for row in x]
    p = rng.choice([0.001, 0.01, 0.02, 0.2, 0.9], size=(50, 5))
    assert stats.holm_rows(p).tolist() == [stats.holm(row.tolist()) for row in p]
