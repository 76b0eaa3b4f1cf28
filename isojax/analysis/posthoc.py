r"""Post-hoc transforms of an encoder's sentence vectors (SPEC.md §10.2, ``analyze --posthoc``).

Each transform is fitted once on the task's train sentences (no labels; both sentences of each
pair) and applied to the analysed split's (dev) sentences, for three sentence vectors of a
pre-trained encoder: the last layer's [CLS] vector, the pooler output (where the family has
one) and the mean of the last layer's tokens (mask-weighted: every real token, special tokens
included, as sentence-transformers' mean pooling). The transforms (`isojax.core.posthoc`):

- ``whiten``: the ZCA whitening of the ``whiten`` normaliser (SPEC.md §10.1: shrinkage
  ``α = 0.1``, ``ε = 1e-5``, total variance kept), fitted once instead of as a running average;
- ``abtt``: all-but-the-top, the mean and the top ``round(d / 100)`` principal directions
  removed [ABTT];
- ``bert-whitening``: PCA whitening to ``k = d`` components and, for ``d > 256``, also to the
  paper's reduced ``k = 256`` (label ``bert-whitening-256``) [Whitening].

Before (transform ``none``) and after each, the dev vectors' EV_1, EV_3, IsoScore and mean
cosine (`isojax.core.isotropy`, the sample covariance as in `encoder.sentence_report`) and, for
a pair task, the unsupervised dev score of the cosine similarity of each pair's two vectors:
the Spearman correlation with the gold score (STS-B), or the ROC AUC of the cosine for the
"similar" class (`SIMILAR_CLASS`: MRPC's ``equivalent``, QQP's ``duplicate``, RTE's and QNLI's
``entailment``), the Mann–Whitney form with average ranks for ties.

References:
  Su et al., `Whitening Sentence Representations <https://arxiv.org/abs/2103.15316>`_, 2021
  [Whitening]. Mu & Viswanath, `All-but-the-Top <https://arxiv.org/abs/1702.01417>`_, ICLR 2018
  [ABTT].
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from isojax import errors
from isojax.core import isotropy, stats
from isojax.core import posthoc as core_posthoc
from isojax.data import batching, metrics, tasks
from isojax.models import heads as model_heads

logger = logging.getLogger(__name__)

TRANSFORMS = ("whiten", "abtt", "bert-whitening")
REDUCED_K = 256  # BERT-whitening's reduced variant [Whitening].
VECTORS = ("cls", "pooled", "mean")
SIMILAR_CLASS = {"mrpc": "equivalent", "qqp": "duplicate", "rte": "entailment",
                 "qnli": "entailment"}  # fmt: skip
STAT_KEYS = ("EV_1", "EV_3", "isoscore", "mean_cosine")
# A singular value of the centred train vectors (float64) below this fraction of the largest is
# rounding noise. On 600 RTE train sentences MiniLM-L6's cls and mean vectors have three such
# (1.3e-10, 8.8e-17, 5.6e-17: three gains of its last LayerNorm are 0 to 1e-9, so three
# coordinates are constant) and their smallest real one is near 4e-4 (pooled: 3.7e-4).
RANK_RTOL = 1e-5


class TooFewSentences(errors.InputError):
    """BERT-whitening to `k = d` components asked of at most `d` train sentences (a singular
    covariance); `isojax` prints it in one line with exit status 2."""


class RankDeficient(errors.InputError):
    """BERT-whitening to `k` components of train vectors whose covariance has numerical rank
    below `k` (repeated sentences, or fewer distinct ones than `k`): the missing directions'
    rounding noise would be scaled up to huge values. One line naming the task, split, vector
    and rank; `isojax` exits with status 2."""


def roc_auc(scores, positives) -> float:
    r"""Area under the ROC curve of ``scores [n]`` for the boolean ``positives [n]``.

    The Mann–Whitney form, ties counted one half through average ranks ``r``:

    .. math::
      \mathrm{AUC} = \frac{\sum_{i \in P} r_i - n_P (n_P + 1) / 2}{n_P\, n_N}

    Raises:
      ValueError: one class is empty (the AUC is undefined, as scikit-learn).
    """
    scores = np.asarray(scores, np.float64)
    positives = np.asarray(positives, bool)
    if scores.shape != positives.shape or scores.ndim != 1:
        raise ValueError(f"scores {scores.shape} and positives {positives.shape}: need [n] each")
    n_pos = int(positives.sum())
    n_neg = positives.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC AUC needs both classes among the labels")
    ranks = metrics.average_ranks(scores)
    u = ranks[positives].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def pair_cosines(a, b) -> np.ndarray:
    """`[n]` float64 cosine similarity of rows ``a[i]`` and ``b[i]`` (0 where one is zero)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = np.sum(a * b, axis=1)
    return np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)


def pair_score(task, cosines, labels) -> tuple[str, float | None]:
    """``(name, value)`` of the unsupervised score of pair ``cosines [n]`` against gold
    ``labels [n]``: ``("spearman", ρ)`` for a regression task, ``("roc_auc", AUC)`` of the
    task's `SIMILAR_CLASS`, ``(name, None)`` where one class is missing; ``("", None)`` for a
    task without one."""
    task = tasks.get_task(task)
    if task.is_regression:
        return "spearman", metrics.spearman(cosines, labels)
    if task.name not in SIMILAR_CLASS:
        return "", None
    positive = task.label_names.index(SIMILAR_CLASS[task.name])
    try:
        return "roc_auc", roc_auc(cosines, np.asarray(labels) == positive)
    except ValueError as err:
        logger.warning("%s: no ROC AUC on these rows: %s", task.name, err)
        return "roc_auc", None


@jax.jit
def vector_stats(points: jax.Array) -> dict[str, jax.Array]:
    """EV_1, EV_3, IsoScore (sample covariance, ``ddof=1``) and mean cosine of ``[n, d]``."""
    cov = stats.batch_moments(points, ddof=1).cov
    ratio = isotropy.explained_variance_ratio(cov)
    return {
        "EV_1": ratio[0],
        "EV_3": jnp.sum(ratio[:3]),
        "isoscore": isotropy.isoscore_from_cov(cov),
        "mean_cosine": isotropy.mean_cosine_similarity(points),
    }


def check_fit_size(names: Sequence[str], n: int, d: int) -> None:
    """Raises `TooFewSentences` if ``names`` holds ``bert-whitening`` and ``n <= d``."""
    if "bert-whitening" in names and n <= d:
        raise TooFewSentences(
            f"bert-whitening to k = d = {d} needs more than {d} train sentences, got {n}"
        )


def numerical_rank(points: np.ndarray) -> int:
    """The rank of the covariance of ``points [n, d]``: its centred singular values (float64)
    above `RANK_RTOL` of the largest."""
    x = np.asarray(points, np.float64)
    s = np.linalg.svd(x - x.mean(axis=0), compute_uv=False)
    return int(np.sum(s > RANK_RTOL * s[0])) if s.size and s[0] > 0 else 0


def whitening_ks(d: int, null_directions: int = 0) -> tuple[int, ...]:
    """BERT-whitening's components: ``d - null_directions`` (the full variant), and
    `REDUCED_K` too when ``d > REDUCED_K``."""
    return (d - null_directions, REDUCED_K) if d > REDUCED_K else (d - null_directions,)


def check_rank(
    names: Sequence[str], train: np.ndarray, null_directions: int = 0, where: str = "train"
) -> None:
    """Raises `RankDeficient` (naming ``where``: task, split, vector) when ``names`` holds
    ``bert-whitening`` and the numerical rank of ``train [n, d]`` is below the largest `k`."""
    if "bert-whitening" not in names:
        return
    k = max(whitening_ks(train.shape[1], null_directions))
    rank = numerical_rank(train)
    if rank < k:
        raise RankDeficient(
            f"{where}: {len(train)} vectors of numerical rank {rank} (d = {train.shape[1]}), "
            f"fewer than the k = {k} components bert-whitening inverts: repeated or too few "
            "distinct sentences (use more train rows, or drop bert-whitening)"
        )


def check_distinct(names: Sequence[str], sentences: Sequence[str], d: int, where: str) -> None:
    """Raises `RankDeficient` (before any encoding) when ``names`` holds ``bert-whitening`` and
    ``sentences`` has too few distinct ones for its ``k = d`` (rank at most distinct - 1)."""
    distinct = len(set(sentences))
    if "bert-whitening" in names and distinct - 1 < d:
        raise RankDeficient(
            f"{where}: {distinct} distinct sentences among {len(sentences)}, so rank at most "
            f"{distinct - 1}, fewer than the k = {d} components bert-whitening inverts "
            "(use more train rows, or drop bert-whitening)"
        )


def encoder_null_directions(names: Sequence[str], train: np.ndarray, where: str) -> int:
    """The directions of the vectors ``train [n, d]`` of more than ``d`` distinct sentences
    that stay empty, ``d`` - `numerical_rank`: the encoder's own (MiniLM-L6's cls and mean
    vectors: 3, a LayerNorm output with gains of 0), which BERT-whitening's full variant leaves
    out (logged); 0 without ``bert-whitening``."""
    if "bert-whitening" not in names:
        return 0
    d, rank = train.shape[1], numerical_rank(train)
    if rank < d:
        logger.info(
            "post-hoc: %s vectors have numerical rank %d of d = %d (directions the encoder never "
            "fills): bert-whitening keeps %d components",
            where,
            rank,
            d,
            rank,
        )
    return d - rank


def fit_transforms(
    names: Sequence[str], train: np.ndarray, null_directions: int = 0, where: str = "train"
) -> dict[str, Callable[[np.ndarray], jax.Array]]:
    """``{label: apply}`` of each transform of ``names`` (`TRANSFORMS`) fitted on ``train
    [n, d]``, ``bert-whitening`` giving ``k = d - null_directions`` (directions the vectors
    never fill, `encoder_null_directions`) and, for ``d > 256``, ``k = 256``.

    Raises:
      ValueError: an unknown name.
      TooFewSentences: ``bert-whitening`` on ``n <= d`` vectors (a singular covariance:
        whitening to ``d`` components needs at least ``d + 1``).
      RankDeficient: ``bert-whitening`` on vectors of numerical rank below its ``k``
        (`check_rank`, the message naming ``where``).
    """
    unknown = [name for name in names if name not in TRANSFORMS]
    if unknown:
        raise ValueError(f"unknown post-hoc transform {unknown[0]!r}; choose from {TRANSFORMS}")
    check_fit_size(names, *train.shape)
    check_rank(names, train, null_directions, where)
    d = train.shape[1]
    out = {}
    for name in names:
        if name == "whiten":
            fit = core_posthoc.fit_zca(train)
            out[name] = lambda x, fit=fit: core_posthoc.apply_zca(fit, x)
        elif name == "abtt":
            fit = core_posthoc.fit_abtt(train)
            out[name] = lambda x, fit=fit: core_posthoc.apply_abtt(fit, x)
        else:
            for k in whitening_ks(d, null_directions):
                fit = core_posthoc.fit_bert_whitening(train, k=k)
                label = name if k == d - null_directions else f"{name}-{k}"
                out[label] = lambda x, fit=fit: core_posthoc.apply_bert_whitening(fit, x)
    return out


def sentence_vectors(
    module,
    params,
    tokenizer,
    sentences: Sequence[str],
    *,
    max_length: int = 128,
    batch_size: int = 32,
    buckets: Sequence[int] | None = batching.DEFAULT_BUCKETS,
) -> dict[str, np.ndarray]:
    """``{"cls", "pooled" (a family with a pooler), "mean"}: [n, d]`` float32 vectors of each
    sentence, in order, from one eval-mode pass of the encoder (no dropout)."""
    if not sentences:
        raise ValueError("sentence_vectors needs at least one sentence")
    examples = [tasks.Example(text, None, 0, i) for i, text in enumerate(sentences)]

    @jax.jit
    def step(params, ids, mask, types):
        types = model_heads.segment_ids(module, types)  # None for ModernBERT
        out = module.apply({"params": params}, ids, mask, types, deterministic=True)
        weights = mask.astype(jnp.float32)[..., None]  # [b, t, 1]
        last = out.hidden_states[-1].astype(jnp.float32)  # [b, t, d]
        mean = jnp.sum(last * weights, axis=1) / jnp.maximum(jnp.sum(weights, axis=1), 1.0)
        vectors = {"cls": out.cls.astype(jnp.float32), "mean": mean}
        if out.pooled is not None:
            vectors["pooled"] = out.pooled.astype(jnp.float32)
        return vectors

    parts: dict[str, list[np.ndarray]] = {}
    encoded = batching.encode(examples, tokenizer, max_length)
    for batch in batching.batches(encoded, batch_size=batch_size, buckets=buckets):
        keys = ("input_ids", "attention_mask", "token_type_ids")
        vectors = step(params, *(batch[key] for key in keys))
        real = batch["example_mask"].astype(bool)
        for name, value in vectors.items():
            parts.setdefault(name, []).append(np.asarray(value)[real])
    return {name: np.concatenate(parts[name]) for name in VECTORS if name in parts}


def split_sentences(examples: Sequence) -> list[str]:
    """The sentences of ``examples``: every ``text_a``, then every ``text_b`` of a pair task."""
    sentences = [example.text_a for example in examples]
    if examples and examples[0].text_b is not None:
        sentences += [example.text_b for example in examples]
    return sentences


class PosthocReport(NamedTuple):
    """The numbers of a post-hoc analysis.

    Attributes:
      task: the GLUE task's name.
      fit_sentences, eval_sentences: the number of train sentences fitted on and of dev
        sentences transformed (twice the rows for a pair task).
      score: the pair score's name (``"spearman"``, ``"roc_auc"``) or "" (no pair score).
      rows: ``{vector: {transform: {"d", "EV_1", "EV_3", "isoscore", "mean_cosine",
        "score"}}}``, transform ``"none"`` first (before any), ``score`` None without one.
    """

    task: str
    fit_sentences: int
    eval_sentences: int
    score: str
    rows: dict[str, dict[str, dict[str, Any]]]

    def summary(self) -> dict[str, Any]:
        """JSON-able: everything, as plain floats and ints."""
        return self._asdict()


def transform_rows(
    task,
    transforms: Sequence[str],
    train: np.ndarray,
    dev: np.ndarray,
    labels,
    null_directions: int = 0,
    where: str = "train",
) -> tuple[str, dict[str, dict[str, Any]]]:
    """``(score name, {transform: numbers})`` of one kind of vector: ``none`` and each
    transform of ``transforms`` fitted on ``train [n, d]`` (`fit_transforms`, with
    ``null_directions`` and ``where``) and applied to ``dev [m, d]`` (``m = 2 ×`` pairs for a
    pair task with gold ``labels [pairs]``, else ``labels`` None)."""
    applies = {"none": lambda x: jnp.asarray(x, jnp.float32)}
    applies.update(fit_transforms(transforms, train, null_directions, where))
    rows, score_name = {}, ""
    for label, apply in applies.items():
        out = np.asarray(apply(dev), np.float32)
        row: dict[str, Any] = {"d": int(out.shape[1])}
        row.update({key: float(value) for key, value in vector_stats(out).items()})
        row["score"] = None
        if labels is not None:
            cosines = pair_cosines(out[: len(labels)], out[len(labels) :])
            score_name, row["score"] = pair_score(task, cosines, labels)
        rows[label] = row
    return score_name, rows


def analyze_posthoc(
    module,
    params,
    tokenizer,
    task,
    train_examples: Sequence,
    eval_examples: Sequence,
    *,
    transforms: Sequence[str] = TRANSFORMS,
    max_length: int = 128,
    batch_size: int = 32,
    buckets: Sequence[int] | None = batching.DEFAULT_BUCKETS,
) -> PosthocReport:
    """Fit each of ``transforms`` on the train sentences, apply it to the dev sentences.

    Args:
      module, params, tokenizer: a pre-trained `isojax.linen` encoder, its ``'params'`` and
        its tokenizer.
      task: a GLUE task name or `tasks.GlueTask`.
      train_examples: ``tasks.Example`` rows to fit on (labels unused).
      eval_examples: labelled ``tasks.Example`` rows to transform and score.
      transforms: names from `TRANSFORMS`.
      max_length, batch_size, buckets: as `encoder.analyze_encoder`'s.

    Raises:
      TooFewSentences: ``bert-whitening`` asked of at most ``d`` train sentences (checked
        before anything is encoded), or fewer than 2 train or eval rows.
      RankDeficient: ``bert-whitening`` of train vectors of numerical rank below its ``k``
        (checked before the eval sentences are encoded).
    """
    task = tasks.get_task(task)
    for split, examples in (("train", train_examples), ("eval", eval_examples)):
        if len(examples) < 2:
            raise TooFewSentences(
                f"{task.name}: analyze_posthoc needs at least 2 {split} rows, got {len(examples)}"
            )
    kwargs = {"max_length": max_length, "batch_size": batch_size, "buckets": buckets}
    fit_sentences = split_sentences(train_examples)
    eval_sentences = split_sentences(eval_examples)
    check_fit_size(transforms, len(fit_sentences), module.config.hidden_size)
    check_distinct(transforms, fit_sentences, module.config.hidden_size, f"{task.name} train")
    logger.info("post-hoc: encoding %d train sentences", len(fit_sentences))
    train = sentence_vectors(module, params, tokenizer, fit_sentences, **kwargs)
    nulls = {}
    for name, points in train.items():
        nulls[name] = encoder_null_directions(transforms, points, f"{task.name} train {name}")
        check_rank(transforms, points, nulls[name], f"{task.name} train {name} vectors")
    logger.info("post-hoc: encoding %d eval sentences", len(eval_sentences))
    dev = sentence_vectors(module, params, tokenizer, eval_sentences, **kwargs)
    labels = None
    if task.is_pair:
        labels = np.asarray([example.label for example in eval_examples])
    rows, score = {}, ""
    for name in train:
        where = f"{task.name} train {name} vectors"
        score, rows[name] = transform_rows(
            task, transforms, train[name], dev[name], labels, nulls[name], where
        )
    return PosthocReport(task.name, len(fit_sentences), len(eval_sentences), score, rows)


SCORE_TITLES = {"spearman": "Spearman", "roc_auc": "ROC AUC"}


def format_markdown(report: PosthocReport, title: str = "") -> str:
    """A Markdown table of a `PosthocReport`: one row per (vector, transform)."""
    score = SCORE_TITLES.get(report.score)
    heads = ["vector", "transform", "d", "EV_1", "EV_3", "IsoScore", "mean cos"]
    heads += [f"dev {score} of cos"] if score else []
    lines = [f"{title}\n" if title else ""]
    lines[0] += (
        f"{report.task}: fitted on {report.fit_sentences} train sentences, "
        f"applied to {report.eval_sentences} dev sentences.\n"
    )
    lines += ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for vector, rows in report.rows.items():
        for transform, row in rows.items():
            cells = [vector, transform, str(row["d"])]
            cells += [f"{row[key]:.4f}" for key in STAT_KEYS]
            if score:
                cells.append("—" if row["score"] is None else f"{row['score']:.4f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_report(
    report: PosthocReport, out_dir: str | os.PathLike, title: str = ""
) -> list[pathlib.Path]:
    """Write ``posthoc.md`` (`format_markdown`) and ``posthoc.json`` (`PosthocReport.summary`)
    into ``out_dir``; returns their paths."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table, summary = out / "posthoc.md", out / "posthoc.json"
    table.write_text(format_markdown(report, title))
    summary.write_text(json.dumps(report.summary(), indent=2) + "\n")
    return [table, summary]
