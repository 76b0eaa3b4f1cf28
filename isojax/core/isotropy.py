r"""Isotropy measures: IsoScore, IsoScore*, participation ratio, EV_k, mean cosine, and the
summary of streamed sentence vectors (`summarize`) that the dev evaluation and `isojax analyze`
both report.

IsoScore is computed without an eigendecomposition (SPEC.md §3). With eigenvalues
``λ`` of the covariance ``C``, ``Σλ = tr C`` and ``Σλ² = ‖C‖_F²``, and the chain of
the IsoScore algorithm (rescale to ``√d λ/‖λ‖``, defect, fraction φ, score) collapses to

.. math::
  \iota = \frac{\mathrm{PR}(C) - 1}{d - 1},\qquad
  \mathrm{PR}(C) = \frac{(\operatorname{tr} C)^2}{\lVert C\rVert_F^2}.

This costs one covariance plus O(d²), is smooth wherever ``C ≠ 0`` (eigenvalue and
singular-value gradients are not smooth at repeated eigenvalues, which isotropy is),
and is plain matmuls on TPU and GPU, where ``eigh``/``svd`` are slow.

All functions are pure, jit-able, and return float32 (float64 for float64 input)
whatever the input dtype. Degenerate input has a defined value, never NaN: an all-zero
covariance scores 0 (no direction of space is used), zero vectors have cosine 0.

References:
  Rudman, Gillman, Rayne & Eickhoff, `IsoScore: Measuring the Uniformity of Embedding
  Space Utilization <https://arxiv.org/abs/2108.07344>`_, Findings of ACL 2022.
  Rudman & Eickhoff, `Stable Anisotropic Regularization
  <https://arxiv.org/abs/2305.19358>`_, ICLR 2024 (IsoScore*, Eq. 4–5).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from isojax.core import geometry, stats
from isojax.core.stats import HIGHEST

EV_KS = (1, 3)  # the EV_k of a summary (`summarize`: "ev1", "ev3")
# `geometry.geometry_from_moments`'s keys (SPEC.md §10.4), in a summary's order.
GEOMETRY = ("erank", "rankme", "outliers", "principal_outlier", "principal_outlier_share")
# A summary's scalars (`summarize`), in the order `isojax analyze`'s summary.json lists them.
SCALARS = ("count", *(f"ev{k}" for k in EV_KS), "isoscore", "participation_ratio",
           "mean_cosine", *GEOMETRY)  # fmt: skip


def _check_cov(cov: jax.Array, name: str = "cov") -> None:
    if cov.ndim != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"{name} must be a square [d, d] matrix, got shape {cov.shape}")
    if cov.shape[0] < 2:
        raise ValueError(f"isotropy needs d >= 2 dimensions, got {name} of shape {cov.shape}")


def check_zeta(zeta) -> None:
    """Raises ValueError unless the shrinkage ``ζ`` lies in ``[0, 1]``; a traced ``ζ`` (a
    hyper-parameter swept under ``vmap``) passes unchecked."""
    if isinstance(zeta, jax.core.Tracer):
        return
    if not 0.0 <= float(zeta) <= 1.0:
        raise ValueError(f"zeta must lie in [0, 1], got {zeta}")


def _score_from_trace_and_frobenius(tr: jax.Array, fro2: jax.Array, d: int) -> jax.Array:
    r"""``(PR − 1)/(d − 1)`` from ``tr C`` and ``‖C‖_F²``; 0 when ``C = 0``.

    Double ``where``: the unused branch must not produce NaN, or its gradient poisons the
    used one (0/0 at the all-zero cloud).
    """
    positive = fro2 > 0
    pr = jnp.where(positive, tr**2 / jnp.where(positive, fro2, 1), 1)
    return (pr - 1) / (d - 1)


def participation_ratio(cov: jax.typing.ArrayLike) -> jax.Array:
    r"""Participation ratio ``(tr C)² / ‖C‖_F² = (Σλ)²/Σλ²`` in ``[1, d]``; 0 for ``C = 0``.

    Args:
      cov: ``[d, d]`` covariance.

    Returns:
      Scalar, float32 at least: the effective number of dimensions the cloud uses.
    """
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    _check_cov(cov)
    tr, fro2 = jnp.trace(cov), jnp.sum(cov**2)
    positive = fro2 > 0
    return jnp.where(positive, tr**2 / jnp.where(positive, fro2, 1), 0)


def isoscore_from_cov(cov: jax.typing.ArrayLike) -> jax.Array:
    r"""IsoScore of a covariance matrix: ``(PR(C) − 1)/(d − 1)`` in ``[0, 1]``.

    Args:
      cov: ``[d, d]`` covariance (any scale: the score is scale-invariant).

    Returns:
      Scalar float32 (float64 for float64 input); 1 is isotropic, 0 is rank 1 or ``C = 0``.
    """
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    _check_cov(cov)
    return _score_from_trace_and_frobenius(jnp.trace(cov), jnp.sum(cov**2), cov.shape[0])


def shrunk_covariance(
    cov: jax.typing.ArrayLike, c0: jax.typing.ArrayLike | None, zeta
) -> jax.Array:
    r"""``C_ζ = (1 − ζ) C + ζ C₀`` (``C₀ = I`` when None), the IsoScore* shrinkage."""
    check_zeta(zeta)
    cov = jnp.asarray(cov)
    c0 = jnp.eye(cov.shape[-1], dtype=cov.dtype) if c0 is None else jnp.asarray(c0, cov.dtype)
    if c0.shape != cov.shape:
        raise ValueError(f"c0 has shape {c0.shape} but the covariance has shape {cov.shape}")
    return (1 - zeta) * cov + zeta * c0


def isoscore_star_from_cov(
    cov: jax.typing.ArrayLike, *, c0: jax.typing.ArrayLike | None = None, zeta=0.0
) -> jax.Array:
    r"""IsoScore* of a covariance: IsoScore of ``C_ζ = (1 − ζ) C + ζ C₀``.

    Args:
      cov: ``[d, d]`` batch covariance.
      c0: ``[d, d]`` stabilising covariance; the identity when None.
      zeta: shrinkage weight in ``[0, 1]``; 0 is IsoScore of ``cov``, 1 ignores it.

    Returns:
      Scalar float32 at least, in ``[0, 1]``.
    """
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    _check_cov(cov)
    return isoscore_from_cov(shrunk_covariance(cov, c0, zeta))


def isoscore(
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    axis_name: str | None = None,
) -> jax.Array:
    r"""IsoScore of a point cloud (SPEC.md §3), eigen-free.

    .. math::
      \iota(X) = \frac{\mathrm{PR}(\mathrm{cov}\,X) - 1}{d - 1}

    Args:
      points: ``[..., d]`` points (leading axes flattened), any float dtype.
      mask: optional ``[...]`` weights, 1 keeps a point, 0 drops it (padding).
      axis_name: a mapped axis (``shard_map``/``pmap``) over which the points are split; the
        score is then that of the global cloud (see :func:`isoscore_star`).

    Returns:
      Scalar float32 at least, in ``[0, 1]``.
    """
    return isoscore_star(points, mask=mask, zeta=0.0, axis_name=axis_name)


def _centred_points(points, mask, *, min_points: int = 2):
    """``[m, d]`` centred, masked points (rows of dropped points are 0) and the count."""
    x, w = stats.flatten_points(points, mask)
    if x.shape[0] < min_points:
        raise ValueError(f"need at least two points, got points of shape {jnp.shape(points)}")
    if x.shape[1] < 2:
        raise ValueError(f"isotropy needs d >= 2 dimensions, got points of shape {x.shape}")
    count = jnp.sum(w)
    mean = stats.contract("m,md->d", w, x) / jnp.maximum(count, 1)
    return (x - mean) * w[:, None] ** 0.5, count


def isoscore_star(
    points: jax.typing.ArrayLike,
    *,
    c0: jax.typing.ArrayLike | None = None,
    zeta=0.0,
    mask: jax.typing.ArrayLike | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    r"""IsoScore* of a point cloud, differentiable, with covariance shrinkage.

    .. math::
      C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta C_0,\qquad
      \iota^* = \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},\qquad
      \lVert C_\zeta\rVert_F^2 = (1-\zeta)^2\lVert C\rVert_F^2
        + 2\zeta(1-\zeta)\langle C, C_0\rangle + \zeta^2\lVert C_0\rVert_F^2

    ``cov`` is the unbiased covariance (``torch.cov``, as in the reference). With at least as
    many points as dimensions the score is :func:`isoscore_star_from_cov` of
    :func:`isojax.core.stats.batch_moments` (the one implementation, which the I-STAR train step
    runs); with fewer (m < d), ``‖C‖_F²`` and ``⟨C, C₀⟩`` come from the ``[m, m]`` Gram matrix
    and ``[m, d]`` products instead of a ``[d, d]`` covariance (the expansion above).

    Sharded points. Under ``jax.jit`` with the points sharded over a mesh the score is that of
    the global cloud already. Under ``shard_map``/``pmap`` each device holds a slice; pass the
    mapped ``axis_name`` and the count, mean and centred second moment are summed over it
    (:func:`isojax.core.stats.batch_moments`), so every device gets the global score and the
    gradient of its own points. With ``axis_name`` the covariance route is taken whatever
    ``m``: the Gram route needs every pair of points, which no device holds.

    Args:
      points: ``[..., d]`` embeddings (leading axes flattened), any float dtype.
      c0: ``[d, d]`` stabilising covariance; the identity when None.
      zeta: shrinkage weight in ``[0, 1]``; 0 recovers IsoScore, 1 ignores the points
        (and gives a zero gradient).
      mask: optional ``[...]`` weights over points (token padding: 0).
      axis_name: mapped axis to reduce the moments over (``shard_map``/``pmap``); None under
        ``jax.jit`` or on one device.

    Returns:
      Scalar float32 (float64 for float64 input) in ``[0, 1]``; 1 means isotropic.

    References:
      Rudman & Eickhoff, `Stable Anisotropic Regularization
      <https://arxiv.org/abs/2305.19358>`_, ICLR 2024, Algorithm 1.
    """
    check_zeta(zeta)
    # Under shard_map a device's slice may hold a single point of a larger global cloud.
    y, count = _centred_points(points, mask, min_points=1 if axis_name is not None else 2)
    m, d = y.shape
    if c0 is not None and jnp.shape(c0) != (d, d):
        raise ValueError(
            f"c0 has shape {jnp.shape(c0)} but the points {jnp.shape(points)} have d={d}: "
            f"expected ({d}, {d})"
        )
    if m >= d or axis_name is not None:  # the covariance route, as the train step runs it
        cov = stats.batch_moments(points, mask, ddof=1, axis_name=axis_name).cov
        return isoscore_star_from_cov(cov, c0=c0, zeta=zeta)
    # The Gram route: ‖C‖_F² and ⟨C, C₀⟩ from [m, m] and [m, d] products, never [d, d].
    c0 = jnp.eye(d, dtype=y.dtype) if c0 is None else jnp.asarray(c0).astype(y.dtype)
    scale = 1 / jnp.maximum(count - 1, 1)  # unbiased covariance, as torch.cov
    tr_c = jnp.sum(y**2) * scale
    gram = stats.contract("md,nd->mn", y, y)  # [m, m]
    fro2_c = jnp.sum(gram**2) * scale**2
    inner = jnp.sum(jnp.einsum("md,de->me", y, c0, precision=HIGHEST) * y) * scale
    tr = (1 - zeta) * tr_c + zeta * jnp.trace(c0)
    fro2 = (1 - zeta) ** 2 * fro2_c + 2 * zeta * (1 - zeta) * inner + zeta**2 * jnp.sum(c0**2)
    return _score_from_trace_and_frobenius(tr, fro2, d)


def explained_variance_ratio(cov: jax.typing.ArrayLike) -> jax.Array:
    r"""Share of the total variance on each principal axis, ``λ_i / Σλ``, descending.

    Analysis only: uses ``eigh``. Zeros for an all-zero covariance.

    Args:
      cov: ``[d, d]`` covariance.

    Returns:
      ``[d]`` float32 at least, non-increasing, summing to 1 (or all 0).
    """
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    _check_cov(cov)
    eig = jnp.clip(jnp.linalg.eigvalsh(cov)[::-1], 0, None)  # round-off can give -1e-9
    total = jnp.sum(eig)
    return jnp.where(total > 0, eig / jnp.where(total > 0, total, 1), 0)


def explained_variance(cov: jax.typing.ArrayLike, k: int) -> jax.Array:
    r"""``EV_k = Σ_{i≤k} λ_i / Σ_i λ_i``: variance on the top ``k`` principal axes.

    The [IsoBN] analysis reports EV_3 of pre-trained [CLS] embeddings near 0.86.
    """
    cov = jnp.asarray(cov)
    if not 1 <= k <= cov.shape[-1]:
        raise ValueError(f"k must lie in [1, d={cov.shape[-1]}], got {k}")
    return jnp.sum(explained_variance_ratio(cov)[:k])


def mean_cosine_similarity(
    points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None
) -> jax.Array:
    r"""Mean cosine similarity over all pairs ``i ≠ j`` of points, without an ``[N, N]`` matrix.

    .. math::
      \frac{1}{N(N-1)} \sum_{i \neq j} \hat x_i^\top \hat x_j
      = \frac{\lVert \sum_i \hat x_i \rVert^2 - \sum_i \lVert \hat x_i\rVert^2}{N(N-1)}

    A zero vector has cosine 0 with every other point. 0 for fewer than two points.

    Args:
      points: ``[..., d]`` points (leading axes flattened).
      mask: optional ``[...]`` 0/1 mask over points.

    Returns:
      Scalar float32 at least, in ``[-1, 1]``.
    """
    x, w = stats.flatten_points(points, mask)
    unit_sum, unit_sq, n = unit_vector_sums(x, w)
    return mean_cosine_from_sums(unit_sum, unit_sq, n)


def unit_vector_sums(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""``(Σ x̂_i [d], Σ ‖x̂_i‖² [], n [])`` over the kept points, ``x̂ = x/‖x‖`` (0 for x = 0).

    The sufficient statistics of the mean cosine and of CosReg, summed over every leading axis
    of ``x [..., d]``; ``weight [...]`` keeps a point where > 0. The norm is ``rsqrt`` of the
    squared norm, guarded at the dtype's smallest normal (a zero vector adds nothing).
    """
    sq_norm = jnp.sum(x * x, axis=-1, keepdims=True)  # [..., 1]
    tiny = jnp.finfo(x.dtype).tiny
    unit = jnp.where(sq_norm > tiny, x * lax.rsqrt(jnp.maximum(sq_norm, tiny)), 0.0)
    keep = jnp.where(weight > 0, 1.0, 0.0)  # [...]
    unit = unit * keep[..., None]  # dropped points contribute nothing
    axes = tuple(range(x.ndim - 1))
    return jnp.sum(unit, axis=axes), jnp.sum(unit * unit), jnp.sum(keep)


def mean_cosine_from_sums(unit_sum: jax.Array, unit_sq: jax.Array, count: jax.Array) -> jax.Array:
    r"""Mean off-diagonal cosine ``(‖Σ x̂‖² − Σ‖x̂‖²)/(n(n − 1))`` from streamed sums; 0 if n < 2."""
    pairs = count * (count - 1)
    off_diagonal = jnp.sum(unit_sum**2) - unit_sq
    return jnp.where(pairs > 0, off_diagonal / jnp.where(pairs > 0, pairs, 1), 0)


class SentenceStats(NamedTuple):
    """Streaming statistics of one kind of sentence embedding.

    Attributes:
      moments: count ``[]``, mean ``[d]``, centred second moment ``[d, d]`` (float32).
      unit_sum: ``[d]`` sum of the unit vectors ``x / ‖x‖`` (zero vectors add 0).
      unit_sq: ``[]`` ``Σ ‖x̂_i‖²``, the number of non-zero vectors up to rounding.

    `unit_vector_sums` computes the sums; the mean cosine is
    `mean_cosine_from_sums(unit_sum, unit_sq, moments.count)`. The dev evaluation of
    the training loop (`steps.eval_step`) accumulates its sentence vectors in the same state.
    """

    moments: stats.MomentState
    unit_sum: jax.Array
    unit_sq: jax.Array


def sentence_stats_init(d: int) -> SentenceStats:
    """Empty statistics for ``d``-dimensional sentence embeddings."""
    return SentenceStats(
        moments=stats.moments_init(d),
        unit_sum=jnp.zeros((d,), jnp.float32),
        unit_sq=jnp.zeros((), jnp.float32),
    )


def sentence_stats_update(
    state: SentenceStats, points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None
) -> SentenceStats:
    """Add ``[n, d]`` embeddings (``mask [n]``: 1 real, 0 filler) to ``state``."""
    points = jnp.asarray(points)
    x = points.astype(stats.stats_dtype(points.dtype)).astype(state.unit_sum.dtype)  # [n, d]
    w = jnp.ones(x.shape[:1], x.dtype) if mask is None else jnp.asarray(mask).astype(x.dtype)
    unit_sum, unit_sq, _ = unit_vector_sums(x, w)
    return SentenceStats(
        moments=stats.moments_update(state.moments, x, w),
        unit_sum=state.unit_sum + unit_sum,
        unit_sq=state.unit_sq + unit_sq,
    )


def summarize(state: SentenceStats, ddof: int = 0) -> dict[str, jax.Array]:
    r"""The isotropy of one kind of sentence vector from its streamed statistics: the one
    summary that the dev evaluation (``ddof=0``, `isojax.training.evaluation`) and
    `isojax analyze` (``ddof=1``, as ``torch.cov``; `isojax.analysis.encoder.sentence_report`)
    report, each under its own key names.

    Args:
      state: the `SentenceStats` of the vectors.
      ddof: the covariance's ``n − ddof`` denominator (EV_k, IsoScore and the participation
        ratio are scale-free; ``std`` is not). The geometry (SPEC.md §10.4) is always that of
        the ``ddof=0`` covariance.

    Returns:
      float32 arrays (the geometry's counts int32), the `SCALARS`: ``count``,
      ``ev1``, ``ev3`` (`EV_KS`: the variance on the top 1 / 3 principal axes), ``isoscore``,
      ``participation_ratio``, ``mean_cosine`` (over all pairs, `mean_cosine_from_sums`), the
      `GEOMETRY` keys (`geometry.geometry_from_moments`: ``erank``, ``rankme``,
      ``outliers``, ``principal_outlier``, ``principal_outlier_share``); then ``ev_ratio
      [d]`` (the descending eigenvalue shares, whose cumulative sum is the EV_k curve) and
      ``std [d]`` (the per-dimension standard deviation).
    """
    moments = stats.moments_finalize(state.moments, ddof=ddof)
    ratio = explained_variance_ratio(moments.cov)  # [d]
    return {
        "count": moments.count,
        **{f"ev{k}": jnp.sum(ratio[:k]) for k in EV_KS},
        "isoscore": isoscore_from_cov(moments.cov),
        "participation_ratio": participation_ratio(moments.cov),
        "mean_cosine": mean_cosine_from_sums(state.unit_sum, state.unit_sq, moments.count),
        **geometry.geometry_from_moments(state.moments),
        "ev_ratio": ratio,
        "std": moments.std,
    }
