r"""Geometry of a set of vectors: effective rank, RankMe, outlier dimensions (SPEC.md §10.4).

For vectors ``X [n, d]`` (masked rows dropped):

- **effective rank** (Roy & Vetterli 2007): the singular values ``σ`` of the centred ``X``,
  ``p_i = σ_i / Σσ``, ``erank = exp(−Σ p_i log p_i)``, in ``[1, min(n, d)]``;
- **RankMe** (Garrido et al. 2023): the same on the uncentred ``X``, with
  ``p_i = σ_i / ‖σ‖₁ + 1e-7`` over its ``min(n, d)`` singular values;
- **outlier dimensions** (Rudman, Chen & Eickhoff 2023): the dimensions whose variance is at
  least `OUTLIER_MULTIPLE` (5) times the mean variance over the ``d`` dimensions; the
  **principal outlier** is the highest-variance dimension, its **share** that variance over
  the total;
- the principal outlier's **1-D task score**: a rule on that one coordinate fitted on train
  vectors, applied to dev ones (`fit_threshold` / `apply_threshold` for classification,
  `fit_sign` for regression); the task metric of the predictions is the score (the data
  layer's metrics, `isojax.analysis`).

Each measure has two forms that agree: one of the vectors (`effective_rank`, `rankme`,
`outlier_dimensions`: SVD of the rows) and one of streamed moments (`effective_rank_from_cov`,
`rankme_from_moments`, `outliers_from_variances`, and `geometry_from_moments` of a
`stats.MomentState`), which is what the dev evaluation and `isojax analyze` keep. The moment
forms take ``σ_i ∝ sqrt(λ_i)`` from the eigenvalues of the covariance (effective rank) or
the singular values of a factor of the uncentred ``XᵀX = M₂ + nμμᵀ`` (RankMe). Every measure
is invariant to the scale of the vectors, so any ``ddof`` gives the same value; the moment
forms only down to vectors of about ``1e-18``, where float32 ``M₂`` underflows (at ``1e-20``
their effective rank is 0 and RankMe 1). Of the covariance's float32 eigenvalues, those
beyond its rank (``n − 1`` for ``n`` rows) and those below `ROUNDING_MULTIPLE` ``· eps ·
λ_max`` count as 0: rounding, not spread, whose square root (``~3e-4 σ_max``) would otherwise
add entropy. Everything above is kept, so on collapsed clouds (EV_1 0.99 and 0.999 at
``d = 384``) the two forms agree within 1 % (audit 6 found a cut at ``d · eps · λ_max`` made
the moment forms 7.2 for 89.9 and 1.0 for 17.4 there).

Every function is pure and jit-able (``fit_threshold``'s search too: one sort, one cumulative
sum), and computes in float32 at least whatever the input dtype. Degenerate input has a value,
never NaN: an all-zero set has effective rank, RankMe, outlier count and share 0. Equal rows
give effective rank 0 only where float32 centring is exact; otherwise the centred rows are
rounding noise, of effective rank about 1 and with a "principal outlier" of that noise.

References:
  Roy & Vetterli, `The effective rank: a measure of effective dimensionality
  <https://infoscience.epfl.ch/record/110188>`_, EUSIPCO 2007.
  Garrido, Balestriero, Najman & LeCun, `RankMe: Assessing the downstream performance of
  pretrained self-supervised representations by their rank
  <https://arxiv.org/abs/2210.02885>`_, ICML 2023.
  Rudman, Chen & Eickhoff, `Outlier dimensions encode task-specific knowledge
  <https://arxiv.org/abs/2310.17715>`_, EMNLP 2023.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from isojax.core import stats

OUTLIER_MULTIPLE = 5.0  # Rudman, Chen & Eickhoff 2023, §3: variance >= 5 × the mean variance.
RANKME_EPSILON = 1e-7  # Garrido et al. 2023, Eq. 1.
# A float32 eigenvalue of a covariance below this many ``eps · λ_max`` is rounding: that of a
# direction the rows do not span comes out at about 1.3 eps·λ_max (d = 64 to 768), while a
# collapsed cloud's real tail (EV_1 0.999 at d = 384) starts at 3.4 eps·λ_max.
ROUNDING_MULTIPLE = 2.0


class Outliers(NamedTuple):
    """The outlier dimensions of a set of vectors.

    Attributes:
      count: ``[]`` int32, dimensions whose variance is at least ``multiple`` × the mean.
      principal: ``[]`` int32, the index of the highest-variance dimension (the first on ties).
      share: ``[]`` float32 at least, its variance over the total variance.
    """

    count: jax.Array
    principal: jax.Array
    share: jax.Array


class Threshold(NamedTuple):
    """A 1-D rule: predict ``below`` where ``x <= threshold``, else ``above``.

    Attributes:
      threshold: ``[]`` the cut (``±inf`` puts every value on one side).
      below, above: ``[]`` int32 classes.
      train_accuracy: ``[]`` the rule's accuracy on the vectors it was fitted on.
    """

    threshold: jax.Array
    below: jax.Array
    above: jax.Array
    train_accuracy: jax.Array


def _kept_rows(points, mask) -> tuple[jax.Array, jax.Array]:
    """``[m, d]`` rows (dropped ones zero) and ``[m]`` 0/1 keep weights."""
    x, w = stats.flatten_points(points, mask)
    keep = (w > 0).astype(x.dtype)
    return x * keep[:, None], keep


def _entropy_rank(sigma: jax.Array, epsilon: float = 0.0, valid: jax.Array | None = None):
    """``exp(−Σ p log p)`` with ``p = σ/Σσ + epsilon`` over the ``valid`` values; 0 if σ = 0."""
    total = jnp.sum(sigma)
    valid = jnp.ones_like(sigma) if valid is None else valid
    p = jnp.where(total > 0, sigma / jnp.where(total > 0, total, 1), 0) + epsilon
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1)), 0) * valid
    return jnp.where(total > 0, jnp.exp(-jnp.sum(plogp)), 0)


def _sigma_from_eigenvalues(eig: jax.Array, rank: jax.typing.ArrayLike | None = None):
    """``sqrt(λ)``, descending, keeping the ``rank`` largest and, of those, the ones above
    rounding (``> ROUNDING_MULTIPLE · eps · λ_max``); the rest are 0."""
    eig = eig[::-1]  # eigvalsh is ascending
    tol = ROUNDING_MULTIPLE * jnp.finfo(eig.dtype).eps * jnp.max(eig)
    keep = eig > tol
    if rank is not None:
        keep &= jnp.arange(eig.shape[0]) < rank
    return jnp.sqrt(jnp.where(keep, eig, 0))


def effective_rank(
    points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None
) -> jax.Array:
    r"""Effective rank of the centred vectors (Roy & Vetterli 2007).

    .. math::
      p_i = \frac{\sigma_i}{\sum_j \sigma_j},\qquad
      \mathrm{erank} = \exp\Big(-\sum_i p_i \log p_i\Big)

    with ``σ`` the singular values of ``X − mean(X)`` over the kept rows.

    Args:
      points: ``[..., d]`` vectors (leading axes flattened), any float dtype.
      mask: optional ``[...]``; a point is kept where it is > 0.

    Returns:
      Scalar float32 at least, in ``[1, min(n − 1, d)]``; 0 when the centred vectors are
      exactly 0 (equal rows whose float32 mean is exact; other equal rows give about 1).
    """
    x, keep = _kept_rows(points, mask)
    mean = jnp.sum(x, axis=0) / jnp.maximum(jnp.sum(keep), 1)
    sigma = jnp.linalg.svd((x - mean) * keep[:, None], compute_uv=False)
    return _entropy_rank(sigma)


def rankme(points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None) -> jax.Array:
    r"""RankMe of the vectors, uncentred (Garrido et al. 2023, Eq. 1).

    .. math::
      p_k = \frac{\sigma_k}{\lVert\sigma\rVert_1} + 10^{-7},\qquad
      \mathrm{RankMe} = \exp\Big(-\sum_{k \le \min(n, d)} p_k \log p_k\Big)

    with ``σ`` the singular values of ``X`` over its ``n`` kept rows (the reference's
    ``svdvals``: ``min(n, d)`` of them, masked rows adding none).

    Returns:
      Scalar float32 at least; 0 for all-zero vectors.
    """
    x, keep = _kept_rows(points, mask)
    sigma = jnp.linalg.svd(x, compute_uv=False)  # descending, min(m, d) values
    valid = jnp.arange(sigma.shape[0]) < jnp.sum(keep)
    return _entropy_rank(sigma, RANKME_EPSILON, valid.astype(sigma.dtype))


def outlier_dimensions(
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    multiple: float = OUTLIER_MULTIPLE,
) -> Outliers:
    """`outliers_from_variances` of the kept vectors' per-dimension variance."""
    x, keep = _kept_rows(points, mask)
    n = jnp.maximum(jnp.sum(keep), 1)
    mean = jnp.sum(x, axis=0) / n
    var = jnp.sum(((x - mean) * keep[:, None]) ** 2, axis=0) / n
    return outliers_from_variances(var, multiple=multiple)


def outliers_from_variances(
    variances: jax.typing.ArrayLike, *, multiple: float = OUTLIER_MULTIPLE
) -> Outliers:
    """Outlier dimensions from per-dimension variances ``[d]`` (any ``ddof``, any scale).

    A dimension is an outlier when its variance is at least ``multiple`` times the mean
    variance; the default 5 is Rudman, Chen & Eickhoff's (2023, §3), after Kovaleva et al.
    (2021) and Puccetti et al. (2022). The principal outlier is the highest-variance
    dimension (``argmax``, as the reference's ``max_var_predict``), whether or not it passes
    the multiple.
    """
    var = jnp.asarray(variances)
    var = var.astype(stats.stats_dtype(var.dtype))
    total = jnp.sum(var)
    mean = total / var.shape[-1]
    count = jnp.where(total > 0, jnp.sum(var >= multiple * mean), 0)
    principal = jnp.argmax(var)
    share = jnp.where(total > 0, var[principal] / jnp.where(total > 0, total, 1), 0)
    return Outliers(count.astype(jnp.int32), principal.astype(jnp.int32), share)


def effective_rank_from_cov(
    cov: jax.typing.ArrayLike, count: jax.typing.ArrayLike | None = None
) -> jax.Array:
    """`effective_rank` from the covariance ``[d, d]`` (``σ_i ∝ sqrt(λ_i)``, any ``ddof``).

    ``count``, the number of rows behind ``cov``, bounds its rank by ``count − 1``: give it
    when there may be fewer rows than dimensions, whose null eigenvalues a float32 ``eigvalsh``
    puts at about ``eps · λ_max``, above the rounding cut."""
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    rank = None if count is None else count - 1
    return _entropy_rank(_sigma_from_eigenvalues(jnp.linalg.eigvalsh(cov), rank))


def rankme_from_moments(state: stats.MomentState) -> jax.Array:
    """`rankme` from streamed moments: the singular values of ``X`` are those of any ``A`` with
    ``AᵀA = XᵀX = M₂ + n μμᵀ``, here ``A = [√Λ Vᵀ; √n μᵀ]`` (``M₂ = V Λ Vᵀ``, its rank at
    most ``n − 1``, rounding-level ``λ`` set to 0). Forming ``XᵀX`` itself would lose the
    spread in float32 wherever the mean dominates it, as in BERT's sentence vectors (its small
    eigenvalues fall below ``eps · ‖μ‖²``); the factor keeps the singular values to
    ``eps · σ_max``."""
    m2 = jnp.asarray(state.m2)
    m2 = m2.astype(stats.stats_dtype(m2.dtype))
    eig, vectors = jnp.linalg.eigh(m2)
    root = _sigma_from_eigenvalues(eig, state.count - 1)[::-1]  # ascending, as `vectors`
    factor = jnp.concatenate(
        [root[:, None] * vectors.T, (jnp.sqrt(state.count) * state.mean)[None].astype(m2.dtype)]
    )  # [d + 1, d]
    sigma = jnp.linalg.svd(factor, compute_uv=False)[: m2.shape[0]]
    valid = jnp.arange(sigma.shape[0]) < state.count
    return _entropy_rank(sigma, RANKME_EPSILON, valid.astype(sigma.dtype))


def geometry_from_moments(
    state: stats.MomentState, *, multiple: float = OUTLIER_MULTIPLE
) -> dict[str, jax.Array]:
    """Every measure from streamed moments (count, mean, centred ``M₂``).

    Returns:
      ``{"erank", "rankme", "outliers" (int32), "principal_outlier" (int32),
      "principal_outlier_share"}``: the vector forms' values on the same rows, the effective
      rank and RankMe within 1 % on collapsed float32 clouds (``tests/core/test_geometry.py``)
      and for vectors larger than about ``1e-18``.
    """
    moments = stats.moments_finalize(state)
    outliers = outliers_from_variances(jnp.diagonal(moments.cov), multiple=multiple)
    return {
        "erank": effective_rank_from_cov(moments.cov, state.count),
        "rankme": rankme_from_moments(state),
        "outliers": outliers.count,
        "principal_outlier": outliers.principal,
        "principal_outlier_share": outliers.share,
    }


def fit_threshold(values: jax.typing.ArrayLike, labels: jax.typing.ArrayLike, num_classes: int):
    """The best 1-D rule on ``values [n]`` for integer ``labels [n]``, by brute force.

    Every cut between two consecutive distinct sorted values (and the two cuts with every
    value on one side) is tried with every ordered pair of distinct classes (below, above);
    the rule with the highest train accuracy wins, the lowest cut and then the first pair on
    ties. The reference (``max_var_predict``) tries ``mean + linspace(−25, 25, 101)`` and both
    directions; that grid suits BERT's outliers (tens of units) and misses the cuts of a
    unit-scale coordinate, so here every distinct cut is tried, which attains the exact
    training optimum whatever the scale. The threshold is the midpoint of its two values.

    Returns:
      `Threshold` (``threshold`` float32 at least).
    """
    x = jnp.asarray(values)
    x = x.astype(stats.stats_dtype(x.dtype)).reshape(-1)
    y = jnp.asarray(labels).reshape(-1).astype(jnp.int32)
    n = x.shape[0]
    order = jnp.argsort(x, stable=True)
    xs, onehot = x[order], jax.nn.one_hot(y[order], num_classes, dtype=jnp.int32)
    below = jnp.concatenate([jnp.zeros((1, num_classes), jnp.int32), jnp.cumsum(onehot, 0)])
    above = below[-1] - below  # [n + 1, k]: the cut j leaves the first j sorted values below
    pairs = jnp.array([(a, b) for a in range(num_classes) for b in range(num_classes) if a != b])
    correct = below[:, pairs[:, 0]] + above[:, pairs[:, 1]]  # [n + 1, pairs]
    distinct = jnp.concatenate([jnp.array([True]), xs[1:] > xs[:-1], jnp.array([True])])
    correct = jnp.where(distinct[:, None], correct, -1)
    best = jnp.argmax(correct.reshape(-1))
    cut, pair = best // pairs.shape[0], best % pairs.shape[0]
    lo = jnp.concatenate([jnp.array([-jnp.inf], xs.dtype), xs])[cut]
    hi = jnp.concatenate([xs, jnp.array([jnp.inf], xs.dtype)])[cut]
    threshold = jnp.where(cut == 0, -jnp.inf, jnp.where(cut == n, jnp.inf, (lo + hi) / 2))
    accuracy = correct.reshape(-1)[best] / n
    return Threshold(threshold, pairs[pair, 0], pairs[pair, 1], accuracy.astype(xs.dtype))


def apply_threshold(rule: Threshold, values: jax.typing.ArrayLike) -> jax.Array:
    """The classes ``[n]`` (int32) `rule` predicts for ``values [n]``."""
    x = jnp.asarray(values)
    x = x.astype(stats.stats_dtype(x.dtype))
    return jnp.where(x <= rule.threshold, rule.below, rule.above).astype(jnp.int32)


def fit_sign(values: jax.typing.ArrayLike, targets: jax.typing.ArrayLike) -> jax.Array:
    """The 1-D rule of a regression task: ``+1`` or ``−1``, the sign of the train covariance of
    ``values [n]`` with ``targets [n]`` (``+1`` on 0). The prediction is ``sign · x``: its
    Pearson and Spearman correlations with dev targets are the coordinate's own, oriented by
    train (a threshold would throw away the order that both correlations score)."""
    x = jnp.asarray(values)
    x = x.astype(stats.stats_dtype(x.dtype)).reshape(-1)
    t = jnp.asarray(targets).astype(x.dtype).reshape(-1)
    cov = jnp.mean((x - jnp.mean(x)) * (t - jnp.mean(t)))
    return jnp.where(cov < 0, -1.0, 1.0).astype(x.dtype)
