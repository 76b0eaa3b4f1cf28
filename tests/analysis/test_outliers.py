"""The principal outlier's 1-D task score against a brute-force NumPy search written here."""

import itertools

import numpy as np
import pytest
from scipy import stats as scipy_stats

from isojax.analysis import outliers


def brute_force_score(train, y_train, dev, y_dev, k):
    """The reference's recipe in float64: the highest-variance train dimension, every
    threshold (midpoints of distinct train values and ±inf) with every ordered class pair, the
    first best train accuracy; its dev predictions."""
    dim = int(np.argmax(np.var(train, axis=0)))
    x = train[:, dim].astype(np.float64)
    u = np.unique(x)
    best = (-1.0, None)
    for t in [-np.inf, *((u[:-1] + u[1:]) / 2), np.inf]:
        for a, b in itertools.permutations(range(k), 2):
            accuracy = np.mean(np.where(x <= t, a, b) == y_train)
            if accuracy > best[0]:
                best = (accuracy, (t, a, b))
    t, a, b = best[1]
    return dim, best[0], np.where(dev[:, dim] <= t, a, b)


def planted(rng, n, d, dim, labels):
    """Rows whose dimension `dim` has the largest variance and moves with the label."""
    x = rng.normal(size=(n, d)).astype(np.float32)
    x[:, dim] = 4 * (labels - labels.mean()) + rng.normal(size=n) * 3
    return x


@pytest.mark.parametrize("task, metric", [("rte", "accuracy"), ("cola", "matthews_correlation")])
def test_classification_score_is_the_brute_force_one(task, metric):
    rng = np.random.default_rng(0)
    y_train, y_dev = rng.integers(0, 2, 400), rng.integers(0, 2, 150)
    train, dev = planted(rng, 400, 12, 7, y_train), planted(rng, 150, 12, 7, y_dev)
    dim, train_accuracy, predictions = brute_force_score(train, y_train, dev, y_dev, 2)
    got = outliers.principal_outlier_score(task, train, y_train, dev, y_dev)
    assert got["dimension"] == dim == 7
    np.testing.assert_allclose(got["rule"]["train_accuracy"], train_accuracy, rtol=1e-6)
    if metric == "accuracy":
        want = np.mean(predictions == y_dev)
    else:
        want = np.corrcoef(predictions, y_dev)[0, 1]  # Matthews = Pearson of two 0/1 series
    np.testing.assert_allclose(got["score"], want, rtol=1e-6)
    np.testing.assert_allclose(got["dev"][metric], want, rtol=1e-6)
    assert got["score"] > 0.3 if metric != "accuracy" else got["score"] > 0.65
    var = np.var(train.astype(np.float64), axis=0)
    np.testing.assert_allclose(got["train_share"], var.max() / var.sum(), rtol=1e-5)


def test_regression_score_is_the_coordinates_correlation_signed_on_train():
    """STS-B: the prediction is sign · x, the sign fitted on train, so the score is the mean
    of the dev Pearson and Spearman of the coordinate, oriented by train."""
    rng = np.random.default_rng(1)
    y_train, y_dev = rng.uniform(0, 5, 300), rng.uniform(0, 5, 100)
    train, dev = planted(rng, 300, 10, 2, -y_train), planted(rng, 100, 10, 2, -y_dev)
    got = outliers.principal_outlier_score("stsb", train, y_train, dev, y_dev)
    assert got["dimension"] == 2 and got["rule"] == {"sign": -1.0}
    x = -dev[:, 2].astype(np.float64)
    pearson = scipy_stats.pearsonr(x, y_dev)[0]
    spearman = scipy_stats.spearmanr(x, y_dev)[0]
    np.testing.assert_allclose(got["dev"]["pearson"], pearson, rtol=1e-6)
    np.testing.assert_allclose(got["score"], (pearson + spearman) / 2, rtol=1e-6)
    assert got["score"] > 0.5
