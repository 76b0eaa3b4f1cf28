"""GLUE metrics from accumulated predictions, in float64 NumPy.

Every function returns a Python float in the usual range (accuracy and F1 in [0, 1], the
correlations in [-1, 1]); reports multiply by 100. Degenerate inputs (a constant prediction or
label, no positive class) give 0.0, without NaN or warnings, as scikit-learn does for MCC.

    acc = metrics.Accumulator()
    for batch in batching.batches(encoded, batch_size=32):
        acc.update(predict(batch), batch["labels"], batch["example_mask"])
    scores = acc.compute("mrpc")   # {'f1': ..., 'accuracy': ..., 'combined': ..., 'score': ...}

References:
  Wang et al., `GLUE <https://arxiv.org/abs/1804.07461>`_, ICLR 2019, Table 1 (the metric of
  each task; a task with two metrics is scored by their mean). SPEC.md §7.
"""

from __future__ import annotations

import numpy as np

from isojax.data import tasks


def _as_1d(name: str, values) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ValueError(f"{name} must be [n] (or [n, 1]), got shape {array.shape}")
    return array


def _pair(predictions, labels) -> tuple[np.ndarray, np.ndarray]:
    predictions = _as_1d("predictions", predictions)
    labels = _as_1d("labels", labels)
    if predictions.shape != labels.shape:
        raise ValueError(
            f"predictions {predictions.shape} and labels {labels.shape} differ in shape"
        )
    if predictions.size == 0:
        raise ValueError("no examples to score")
    return predictions, labels


def accuracy(predictions, labels) -> float:
    """Fraction of `predictions [n]` equal to `labels [n]` (class ids)."""
    predictions, labels = _pair(predictions, labels)
    return float(np.mean(predictions == labels))


def f1(predictions, labels, *, positive: int = 1) -> float:
    r"""Binary F1 of the `positive` class.

    .. math::
      F_1 = \frac{2\,TP}{2\,TP + FP + FN},

    0.0 when there is no positive label or prediction at all (scikit-learn's
    `zero_division=0`).
    """
    predictions, labels = _pair(predictions, labels)
    pred_pos, true_pos = predictions == positive, labels == positive
    tp = np.sum(pred_pos & true_pos)
    denominator = np.sum(pred_pos) + np.sum(true_pos)  # 2 TP + FP + FN
    return float(2 * tp / denominator) if denominator else 0.0


def matthews_correlation(predictions, labels) -> float:
    r"""Matthews correlation coefficient (multi-class form of Gorodkin 2004, as scikit-learn).

    With the confusion matrix `C` (rows: labels), `t = C 1` (label counts), `p = Cᵀ 1`
    (prediction counts), `c = tr C`, `s = n`:

    .. math::
      \mathrm{MCC} = \frac{c\,s - t\cdot p}{\sqrt{(s^2 - p\cdot p)(s^2 - t\cdot t)}},

    0.0 when a factor under the root is 0 (a constant prediction or label).
    """
    predictions, labels = _pair(predictions, labels)
    classes, encoded = np.unique(np.concatenate([labels, predictions]), return_inverse=True)
    k = len(classes)
    true, pred = encoded[: len(labels)], encoded[len(labels) :]
    confusion = np.zeros((k, k), np.float64)
    np.add.at(confusion, (true, pred), 1.0)
    t, p = confusion.sum(axis=1), confusion.sum(axis=0)  # [k], [k]
    c, s = np.trace(confusion), confusion.sum()
    cov_tp = c * s - t @ p
    cov_pp = s * s - p @ p
    cov_tt = s * s - t @ t
    if cov_pp == 0 or cov_tt == 0:
        return 0.0
    return float(cov_tp / np.sqrt(cov_tt * cov_pp))


def pearson(predictions, labels) -> float:
    r"""Pearson correlation :math:`\sum \tilde x \tilde y / \sqrt{\sum \tilde x^2 \sum \tilde y^2}`
    (centred float64 values); 0.0 if either input is constant."""
    x, y = _pair(predictions, labels)
    x, y = x.astype(np.float64), y.astype(np.float64)
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0
    x, y = x - x.mean(), y - y.mean()
    r = np.sum(x * y) / np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.clip(r, -1.0, 1.0))


def average_ranks(values: np.ndarray) -> np.ndarray:
    """`[n]` float64 ranks 1..n, ties given their mean rank (`scipy.stats.rankdata`)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])  # [groups]
    ends = np.r_[starts[1:], len(values)]
    group_rank = (starts + ends + 1) / 2.0  # mean of ranks starts+1 .. ends
    ranks = np.empty(len(values), np.float64)
    ranks[order] = np.repeat(group_rank, ends - starts)
    return ranks


def spearman(predictions, labels) -> float:
    """Spearman rank correlation: Pearson of the average ranks; 0.0 if either is constant."""
    x, y = _pair(predictions, labels)
    return pearson(average_ranks(x), average_ranks(y))


METRICS = {
    "accuracy": accuracy,
    "f1": f1,
    "matthews_correlation": matthews_correlation,
    "pearson": pearson,
    "spearman": spearman,
}


def compute_metrics(task: str | tasks.GlueTask, predictions, labels) -> dict[str, float]:
    """The GLUE metrics of a task.

    Args:
      task: a task name or `tasks.GlueTask`.
      predictions: class ids `[n]` or logits `[n, num_labels]` (argmax taken); for STS-B the
        scores `[n]` or `[n, 1]`.
      labels: `[n]` class ids or scores, padding examples already removed.

    Returns:
      `{metric: value}` for each of `task.metrics`, plus `'combined'` (their mean) where the
      task has two, and `'score'`: the task's single GLUE number (the metric or the mean).
      For MNLI call it once per dev split (matched, mismatched).
    """
    task = tasks.get_task(task)
    predictions = np.asarray(predictions)
    if not task.is_regression and predictions.ndim == 2 and predictions.shape[1] > 1:
        if predictions.shape[1] != task.num_labels:
            raise ValueError(
                f"{task.name}: logits have {predictions.shape[1]} classes, "
                f"expected {task.num_labels}"
            )
        predictions = predictions.argmax(axis=1)
    result = {name: METRICS[name](predictions, labels) for name in task.metrics}
    if len(result) > 1:
        result["combined"] = float(np.mean(list(result.values())))
    result["score"] = result.get("combined", result[task.metrics[0]])
    return result


class Accumulator:
    """Collects predictions and labels of the real examples of each batch, then scores them."""

    def __init__(self) -> None:
        self._predictions: list[np.ndarray] = []
        self._labels: list[np.ndarray] = []

    def update(self, predictions, labels, example_mask=None) -> None:
        """Adds a batch: predictions `[b]`|`[b, k]`, labels `[b]`, example_mask `[b]` (1: real)."""
        predictions, labels = np.asarray(predictions), np.asarray(labels)
        if predictions.ndim == 2:  # logits -> class ids; a [b, 1] regression output -> [b]
            predictions = predictions.argmax(1) if predictions.shape[1] > 1 else predictions[:, 0]
        if example_mask is not None:
            keep = np.asarray(example_mask).astype(bool)
            predictions, labels = predictions[keep], labels[keep]
        self._predictions.append(predictions)
        self._labels.append(labels)

    @property
    def count(self) -> int:
        """Number of real examples added so far."""
        return sum(len(labels) for labels in self._labels)

    def compute(self, task: str | tasks.GlueTask) -> dict[str, float]:
        """`compute_metrics` over everything added."""
        if not self._labels:
            raise ValueError("no batches were added")
        return compute_metrics(
            task, np.concatenate(self._predictions), np.concatenate(self._labels)
        )
