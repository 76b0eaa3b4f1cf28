"""GLUE metrics against scikit-learn and SciPy, degenerate inputs, and the accumulator."""

import warnings

import numpy as np
import pytest
import scipy.stats
import sklearn.metrics

from isojax.data import metrics


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [2, 17, 500])
def test_binary_metrics_match_sklearn(seed, n):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    labels[:2] = (0, 1)  # both classes present: sklearn warns on a single one
    predictions = np.where(rng.random(n) < 0.7, labels, rng.integers(0, 2, n))
    np.testing.assert_allclose(
        metrics.accuracy(predictions, labels),
        sklearn.metrics.accuracy_score(labels, predictions),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        metrics.f1(predictions, labels),
        sklearn.metrics.f1_score(labels, predictions, zero_division=0),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        metrics.matthews_correlation(predictions, labels),
        sklearn.metrics.matthews_corrcoef(labels, predictions),
        rtol=1e-12,
        atol=1e-15,
    )


@pytest.mark.parametrize("seed", range(3))
def test_multiclass_mcc_and_accuracy_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, 300)
    predictions = np.where(rng.random(300) < 0.5, labels, rng.integers(0, 3, 300))
    np.testing.assert_allclose(
        metrics.matthews_correlation(predictions, labels),
        sklearn.metrics.matthews_corrcoef(labels, predictions),
        rtol=1e-12,
    )
    assert metrics.accuracy(predictions, labels) == sklearn.metrics.accuracy_score(
        labels, predictions
    )


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ties", [False, True])
def test_correlations_match_scipy(seed, ties):
    rng = np.random.default_rng(seed)
    labels = rng.uniform(0, 5, 400)
    predictions = labels + rng.normal(0, 1.5, 400)
    if ties:  # STS-B scores come in steps of 0.2; predictions may tie too.
        labels, predictions = np.round(labels * 5) / 5, np.round(predictions)
    np.testing.assert_allclose(
        metrics.pearson(predictions.astype(np.float32), labels),
        scipy.stats.pearsonr(predictions.astype(np.float32).astype(np.float64), labels)[0],
        rtol=1e-10,
    )
    np.testing.assert_allclose(
        metrics.spearman(predictions, labels),
        scipy.stats.spearmanr(predictions, labels)[0],
        rtol=1e-10,
    )


def test_average_ranks_match_scipy():
    values = np.array([3.0, 1.0, 3.0, 2.0, 3.0, 1.0, 0.5])
    np.testing.assert_array_equal(metrics.average_ranks(values), scipy.stats.rankdata(values))


@pytest.mark.parametrize(
    "metric, predictions, labels",
    [
        (metrics.matthews_correlation, [1, 1, 1, 1], [0, 1, 0, 1]),  # constant prediction
        (metrics.matthews_correlation, [0, 1, 0, 1], [1, 1, 1, 1]),  # constant label
        (metrics.f1, [0, 0, 0, 0], [0, 0, 0, 0]),  # no positive anywhere: 0/0
        (metrics.f1, [0, 0, 0, 0], [0, 1, 0, 1]),  # no positive prediction
        (metrics.pearson, [2.5, 2.5, 2.5, 2.5], [0.0, 1.0, 4.0, 5.0]),
        (metrics.pearson, [0.1, 0.2, 0.3, 0.4], [3.3, 3.3, 3.3, 3.3]),
        (metrics.spearman, [2.5, 2.5, 2.5, 2.5], [0.0, 1.0, 4.0, 5.0]),
    ],
)
def test_degenerate_inputs_give_zero_without_warning(metric, predictions, labels):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = metric(np.asarray(predictions), np.asarray(labels))
    assert value == 0.0 and isinstance(value, float)


def test_constant_float_that_does_not_average_exactly_is_still_constant():
    # mean([0.1] * 3) != 0.1 in float64: centring alone would leave rounding noise.
    assert metrics.pearson(np.full(3, 0.1), np.array([1.0, 2.0, 4.0])) == 0.0


def test_perfect_and_inverse_correlations_stay_in_range():
    x = np.linspace(0, 5, 101)
    assert metrics.pearson(x, 3 * x + 1) == pytest.approx(1.0, abs=1e-12)
    assert -1.0 <= metrics.pearson(x, -x) <= -1.0 + 1e-12
    assert metrics.matthews_correlation([0, 1, 1], [0, 1, 1]) == 1.0


def test_compute_metrics_per_task():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    logits = rng.normal(size=(200, 2)) + 2.0 * np.eye(2)[labels]
    predictions = logits.argmax(1)
    mrpc = metrics.compute_metrics("mrpc", logits, labels)
    f1 = sklearn.metrics.f1_score(labels, predictions)
    acc = sklearn.metrics.accuracy_score(labels, predictions)
    assert mrpc == pytest.approx(
        {"f1": f1, "accuracy": acc, "combined": (f1 + acc) / 2, "score": (f1 + acc) / 2}
    )
    cola = metrics.compute_metrics("cola", predictions, labels)
    mcc = sklearn.metrics.matthews_corrcoef(labels, predictions)
    assert cola == pytest.approx({"matthews_correlation": mcc, "score": mcc})
    assert metrics.compute_metrics("rte", predictions, labels) == pytest.approx(
        {"accuracy": acc, "score": acc}
    )

    scores = rng.uniform(0, 5, 150)
    outputs = (scores + rng.normal(0, 1, 150))[:, None]  # [n, 1] regression head
    stsb = metrics.compute_metrics("stsb", outputs, scores)
    p = scipy.stats.pearsonr(outputs[:, 0], scores)[0]
    s = scipy.stats.spearmanr(outputs[:, 0], scores)[0]
    assert stsb == pytest.approx(
        {"pearson": p, "spearman": s, "combined": (p + s) / 2, "score": (p + s) / 2}
    )


def test_compute_metrics_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"classes, expected 3"):
        metrics.compute_metrics("mnli", np.zeros((4, 2)), np.zeros(4))
    with pytest.raises(ValueError, match=r"differ in shape"):
        metrics.accuracy(np.zeros(4), np.zeros(5))
    with pytest.raises(ValueError, match=r"no examples"):
        metrics.accuracy(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match=r"unknown GLUE task 'wnli'.*'cola'"):
        metrics.compute_metrics("wnli", np.zeros(4), np.zeros(4))


def test_accumulator_counts_only_real_examples():
    acc = metrics.Accumulator()
    acc.update([1, 0, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0])  # last row is padding
    acc.update(np.array([[0.1, 0.9], [0.8, 0.2]]), [1, 1], [1, 0])  # logits, half padding
    assert acc.count == 4
    assert acc.compute("rte")["accuracy"] == pytest.approx(3 / 4)
