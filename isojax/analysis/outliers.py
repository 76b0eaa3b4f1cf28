"""The principal outlier's 1-D task score of an encoder or a run (SPEC.md §10.4, `analyze
--outlier-score`).

Rudman, Chen & Eickhoff (EMNLP 2023) find that after fine-tuning one dimension of the sentence
vector, the principal outlier (the highest-variance one), can do the task alone. The score
here is theirs (the reference's ``max_var_predict``), per sentence vector (``cls``, ``pooled``,
a run's ``pre_logits``):

1. the principal outlier is the highest-variance dimension of the **train** vectors;
2. a rule on that one coordinate is fitted on train: for classification the threshold and
   the pair of classes (below, above) with the best train accuracy, by brute force over every
   distinct cut (`isojax.core.geometry.fit_threshold`); for regression (STS-B) the sign of its
   train covariance with the score (`geometry.fit_sign`), the prediction being ``sign · x``;
3. the rule's predictions on the **dev** vectors are scored with the task's GLUE metrics
   (`isojax.data.metrics.compute_metrics`: Matthews for CoLA, F1 and accuracy for MRPC,
   Pearson and Spearman for STS-B), so the 1-D ``score`` is on the scale of the run's.

The vectors are kept on the host, float32 (``[n, d]`` per split; CoLA's train is 13 MB).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import numpy as np

from isojax.core import geometry
from isojax.data import metrics, tasks


def sentence_vectors(
    apply_fn: Callable, variables, batches: Iterable[dict]
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The sentence vectors of every real row and their labels, in batch order.

    Args:
      apply_fn: ``(variables, batch) -> (EncoderOutput, head input [b, d] or None)`` in eval
        mode, as `isojax.analysis.encoder.accumulate` takes it.
      variables: the model's variables.
      batches: dicts with ``input_ids``, ``attention_mask``, ``token_type_ids``, ``labels``
        and ``example_mask``.

    Returns:
      ``({"cls": [n, d], "pooled": ..., "pre_logits": ...}`` float32 (pooled and pre_logits
      where the model has them), ``labels [n]``).
    """

    @jax.jit
    def step(variables, batch):
        out, head_input = apply_fn(variables, batch)
        vectors = {"cls": out.hidden_states[-1][:, 0]}
        if out.pooled is not None:
            vectors["pooled"] = out.pooled
        if head_input is not None:
            vectors["pre_logits"] = head_input
        return jax.tree.map(lambda v: v.astype(np.float32), vectors)

    keys = ("input_ids", "attention_mask", "token_type_ids", "example_mask")
    rows: dict[str, list[np.ndarray]] = {}
    labels = []
    for batch in batches:
        real = np.asarray(batch["example_mask"]) > 0
        for name, value in jax.device_get(step(variables, {k: batch[k] for k in keys})).items():
            rows.setdefault(name, []).append(np.asarray(value)[real])
        labels.append(np.asarray(batch["labels"])[real])
    if not labels:
        raise ValueError("sentence_vectors got no batches")
    return {name: np.concatenate(v) for name, v in rows.items()}, np.concatenate(labels)


def principal_outlier_score(
    task: str | tasks.GlueTask,
    train: np.ndarray,
    train_labels: np.ndarray,
    dev: np.ndarray,
    dev_labels: np.ndarray,
) -> dict:
    """The principal outlier of ``train [n, d]`` and its 1-D rule's dev metrics.

    Returns:
      ``{"dimension": int, "train_share": its share of the train variance, "rule": the fitted
      rule (``{"threshold", "below", "above", "train_accuracy"}`` or ``{"sign"}``), "dev":
      compute_metrics of the dev predictions, "score": their GLUE score}``.
    """
    task = tasks.get_task(task)
    if len(train) < 2 or len(dev) < 1:
        raise ValueError(f"principal_outlier_score needs 2 train and 1 dev rows, got {len(train)}")
    out = geometry.outlier_dimensions(train)
    dim = int(out.principal)
    x_train, x_dev = train[:, dim], dev[:, dim]
    if task.is_regression:
        sign = float(geometry.fit_sign(x_train, train_labels))
        rule = {"sign": sign}
        predictions = sign * x_dev.astype(np.float64)
    else:
        fitted = geometry.fit_threshold(x_train, train_labels, task.num_labels)
        rule = {
            "threshold": float(fitted.threshold),
            "below": int(fitted.below),
            "above": int(fitted.above),
            "train_accuracy": float(fitted.train_accuracy),
        }
        predictions = np.asarray(geometry.apply_threshold(fitted, x_dev))
    dev_metrics = metrics.compute_metrics(task, predictions, dev_labels)
    return {
        "dimension": dim,
        "train_share": float(out.share),
        "rule": rule,
        "dev": dev_metrics,
        "score": dev_metrics["score"],
    }


def scores(
    task: str | tasks.GlueTask,
    train: tuple[dict[str, np.ndarray], np.ndarray],
    dev: tuple[dict[str, np.ndarray], np.ndarray],
) -> dict[str, dict]:
    """`principal_outlier_score` of each sentence vector `sentence_vectors` gave for both
    splits: ``{name: ...}``."""
    (train_vectors, train_labels), (dev_vectors, dev_labels) = train, dev
    return {
        name: principal_outlier_score(
            task, train_vectors[name], train_labels, dev_vectors[name], dev_labels
        )
        for name in train_vectors
    }
