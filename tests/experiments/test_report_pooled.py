"""Tests for experiments/report/pooled.py, the statistics pooled over tasks, against rliable
(`rliable.metrics`, `rliable.library.get_interval_estimates`) and against worked examples.

rliable 1.2's `StratifiedBootstrap` draws its indices with `np.random.choice`, the global NumPy
RandomState, whatever `random_state` it is given: the tests seed the global state with the
module's seed before calling it (and restore it after), which gives rliable the draws that
`pooled` takes from its own `RandomState(seed)`."""

import numpy as np
import pytest
import scipy.stats
from rliable import library as rly
from rliable import metrics

from experiments.report import pooled as pool

DRAWS = 300  # fewer than the report's 2000: the equality holds draw by draw


def _matrix(seed: int, runs: int, tasks: int, decimals: int = 2) -> np.ndarray:
    """(runs, tasks) scores, rounded so that runs tie within a task."""
    return np.random.default_rng(seed).normal(0.8, 0.05, size=(runs, tasks)).round(decimals)


def _columns(x: np.ndarray) -> list[np.ndarray]:
    """rliable's (runs, tasks) matrix as `pooled`'s one array per task."""
    return [x[:, j] for j in range(x.shape[1])]


@pytest.fixture
def global_seed():
    """Seeds np.random (rliable's draws) and restores its state afterwards. The legacy global
    state is the point: it is what rliable draws from."""
    state = np.random.get_state()  # noqa: NPY002
    yield lambda: np.random.seed(pool.SEED)  # noqa: NPY002
    np.random.set_state(state)  # noqa: NPY002


@pytest.mark.parametrize(("runs_x", "runs_y", "tasks"), [(5, 5, 4), (3, 5, 4), (4, 2, 3)])
def test_probability_of_improvement_and_difference_equal_rliable(runs_x, runs_y, tasks):
    x, y = _matrix(1, runs_x, tasks), _matrix(2, runs_y, tasks)
    assert any(np.isin(x[:, j], y[:, j]).any() for j in range(tasks))  # ties between arms
    got = pool.probability_of_improvement(_columns(x), _columns(y))
    assert got == pytest.approx(metrics.probability_of_improvement(x, y), abs=1e-15)
    diff = pool.task_averaged_difference(_columns(x), _columns(y))
    ref = metrics.aggregate_mean(x) - metrics.aggregate_mean(y)
    assert diff == pytest.approx(ref, abs=1e-15)
    # Identical arms: ½ on every task (rliable's special case, here from the ties alone).
    assert pool.probability_of_improvement(_columns(x), _columns(x)) == 0.5


def test_probability_of_improvement_counts_a_tie_as_half():
    # Task 1: pairs (0.8 > 0.7), (0.8 = 0.8), (0.6 < 0.7), (0.6 < 0.8): (1 + ½) / 4 = 0.375.
    # Task 2: every arm run above every baseline run: 1. Average: 0.6875.
    got = pool.probability_of_improvement([[0.8, 0.6], [0.5, 0.6]], [[0.7, 0.8], [0.1, 0.2]])
    assert got == 0.6875
    x, y = np.array([[0.8, 0.5], [0.6, 0.6]]), np.array([[0.7, 0.1], [0.8, 0.2]])
    assert metrics.probability_of_improvement(x, y) == pytest.approx(0.6875, abs=1e-15)


@pytest.mark.parametrize(("runs", "tasks"), [(5, 4), (3, 3), (7, 2)])
def test_iqm_equals_rliable_and_scipy_trim_mean(runs, tasks):
    x = _matrix(3, runs, tasks, decimals=4)
    got = pool.iqm(_columns(x))
    assert got == pytest.approx(metrics.aggregate_iqm(x), abs=1e-15)
    assert got == pytest.approx(scipy.stats.trim_mean(x.ravel(), 0.25), abs=1e-15)


def test_iqm_worked_example():
    # Six runs sorted 1, 2, 3, 4, 5, 100: ⌊6/4⌋ = 1 cut from each end, mean(2, 3, 4, 5) = 3.5.
    assert pool.iqm([[100.0, 2.0, 4.0], [1.0, 5.0, 3.0]]) == 3.5


@pytest.mark.parametrize(("runs_x", "runs_y"), [(5, 5), (3, 5)])
def test_comparison_intervals_equal_rliable_stratified_independent_bootstrap(
    runs_x, runs_y, global_seed
):
    x, y = _matrix(4, runs_x, 4), _matrix(5, runs_y, 4)
    got = pool.compare(_columns(x), _columns(y), draws=DRAWS)

    def both(a, b):
        p = metrics.probability_of_improvement(a, b)
        return np.array([p, metrics.aggregate_mean(a) - metrics.aggregate_mean(b)])

    global_seed()
    point, interval = rly.get_interval_estimates({"k": (x, y)}, both, reps=DRAWS)
    assert (got["p"], got["diff"]) == pytest.approx(tuple(point["k"]), abs=1e-15)
    assert (got["p_lo"], got["diff_lo"]) == pytest.approx(tuple(interval["k"][0]), abs=1e-12)
    assert (got["p_hi"], got["diff_hi"]) == pytest.approx(tuple(interval["k"][1]), abs=1e-12)
    assert got["p_lo"] < got["p"] < got["p_hi"] and got["diff_lo"] < got["diff_hi"]
    assert got["n_arm"] == [runs_x] * 4 and got["n_base"] == [runs_y] * 4
    assert (got["draws"], got["seed"]) == (DRAWS, pool.SEED)


def test_iqm_interval_equals_rliable_stratified_bootstrap(global_seed):
    x = _matrix(6, 5, 3, decimals=4)
    got = pool.iqm_interval(_columns(x), draws=DRAWS)
    global_seed()
    point, interval = rly.get_interval_estimates(
        {"k": x}, lambda s: np.array([metrics.aggregate_iqm(s)]), reps=DRAWS
    )
    assert got["iqm"] == pytest.approx(point["k"][0], abs=1e-15)
    assert (got["lo"], got["hi"]) == pytest.approx(tuple(interval["k"][:, 0]), abs=1e-12)
    assert got["lo"] < got["iqm"] < got["hi"]


def test_the_report_s_default_draws_and_seed_equal_rliable(global_seed):
    x, y = _matrix(7, 3, 4), _matrix(8, 5, 4)
    got = pool.compare(_columns(x), _columns(y))
    assert (got["draws"], got["seed"]) == (2000, 0)
    global_seed()
    _, interval = rly.get_interval_estimates(
        {"k": (x, y)},
        lambda a, b: np.array([metrics.probability_of_improvement(a, b)]),
        reps=2000,
    )
    assert (got["p_lo"], got["p_hi"]) == pytest.approx(tuple(interval["k"][:, 0]), abs=1e-12)


def test_profile_equals_rliable_score_distribution():
    x = _matrix(9, 5, 3, decimals=3)
    taus = np.linspace(0.6, 1.0, 41)
    got = pool.profile(_columns(x), taus)
    np.testing.assert_allclose(got, rly.score_distributions(x, taus), rtol=0, atol=1e-15)


def test_normalise_worked_example():
    # chance 0.5, the baseline's median 0.7: 0.7 -> 1, 0.6 -> 0.5, 0.5 -> 0, 0.45 -> -0.25.
    got = pool.normalise([0.7, 0.6, 0.5, 0.45], chance=0.5, reference=0.7)
    np.testing.assert_allclose(got, [1.0, 0.5, 0.0, -0.25], rtol=0, atol=1e-12)


def _compare(p_lo: float, p_hi: float, diff_hi: float) -> dict:
    """A comparison whose paired tests (over the pairs and the seeds) pass in every direction
    (the pooled rule needs them with the intervals: tests/experiments/test_report_rule_words.py)."""
    flips = {f"{k}_{w}": 0.01 for k in ("flip", "cluster") for w in ("toward", "against", "below")}
    return {"p_lo": p_lo, "p_hi": p_hi, "diff_lo": -1.0, "diff_hi": diff_hi} | flips


@pytest.mark.parametrize(
    ("c", "expected"),
    [
        (_compare(0.51, 0.9, 0.02), "confirmed"),
        (_compare(0.1, 0.49, 0.02), "reversed"),
        (_compare(0.4, 0.6, 0.009), "not detected with these runs"),
        (_compare(0.5, 0.6, 0.02), "not detected with these runs"),  # 0.5 is not above
    ],
)
def test_pooled_verdict_rule(c, expected):
    assert pool.pooled_verdict(c) == expected


@pytest.mark.parametrize(
    ("c", "expected"),
    [(_compare(0.4, 0.6, 0.009), "smaller"), (_compare(0.4, 0.6, 0.011), "undecided")],
)
def test_pooled_size_rule(c, expected):
    assert pool.pooled_size_verdict(c, 0.010) == expected


def test_a_task_with_one_run_gives_no_interval():
    got = pool.compare([[0.8, 0.9], [0.7]], [[0.6, 0.7], [0.5, 0.6]])
    assert np.isnan(got["p_lo"]) and got["p"] == 1.0
    assert pool.pooled_verdict(got).startswith("not tested")


def test_many_comparisons_at_once_equal_compare_row_by_row():
    """`compare_many` (the calibration's splits) gives each row `compare`'s bounds exactly,
    across its chunks, with tied runs; the IQM interval's one-randint path equals the
    resample-by-resample `stratified_interval`."""
    rng = np.random.default_rng(9)
    arm, base = rng.normal(0.8, 0.02, (2, 11, 3, 3)).round(2)  # rounded: ties within a task
    got = pool.compare_many(arm, base, draws=500, chunk=4)
    for row in range(len(arm)):
        want = pool.compare(list(arm[row]), list(base[row]), draws=500)
        assert {k: float(v[row]) for k, v in got.items()} == {k: want[k] for k in got}
    runs = _columns(_matrix(3, 5, 4, decimals=2))
    lo, hi = pool.stratified_interval(lambda r: (pool.iqm(r),), runs, draws=500)
    assert pool.iqm_interval(runs, draws=500) == {"iqm": pool.iqm(runs), "lo": lo[0], "hi": hi[0]}
