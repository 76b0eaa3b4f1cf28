r"""Post-hoc transforms of sentence vectors for analysis (SPEC.md §10.2): fit once, apply to others.

Each transform is a pair of pure functions, `fit_*(points, mask=None, ...) -> NamedTuple` on a
set of vectors (the task's train sentences; no labels) and `apply_*(fit, points)` on others
(dev), jit-able (but `fit_bert_whitening`, which fits on the host), in float32 whatever the
input dtype (float64 stays float64):

- `fit_bert_whitening` / `apply_bert_whitening`: BERT-whitening [Whitening], PCA whitening to
  `k` components, `y = (x − μ) U diag(s^(−1/2))[:, :k]` with `U, s = svd(cov)` of the `n − 1`
  covariance;
- `fit_abtt` / `apply_abtt`: all-but-the-top [ABTT], `x − μ` without its projections on the top
  `D` principal directions;
- `fit_zca` / `apply_zca`: the ZCA whitening of the ``whiten`` normaliser (SPEC.md §10.1) with
  its shrinkage, fitted once on the whole set instead of as a running average.

Principal directions are only defined up to sign; `principal_axes` fixes it as scikit-learn's
`svd_flip` does (the largest-magnitude entry of each direction positive), so BERT-whitening's
output is reproducible. ABTT and ZCA do not depend on the signs.

References:
    Su et al., `Whitening Sentence Representations for Better Semantics and Faster Retrieval
    <https://arxiv.org/abs/2103.15316>`_, 2021, Sec. 3 (reference bojone/BERT-whitening
    `compute_kernel_bias`) [Whitening]. Mu & Viswanath, `All-but-the-Top: Simple and Effective
    Postprocessing for Word Representations <https://arxiv.org/abs/1702.01417>`_, ICLR 2018,
    Algorithm 1 [ABTT].
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from isojax.core import stats, whitening
from isojax.core.stats import HIGHEST


class BertWhitening(NamedTuple):
    """A fitted BERT-whitening: ``mean`` `[d]`, ``kernel`` `[d, k]` (`U diag(s^(−1/2))[:, :k]`)."""

    mean: jax.Array
    kernel: jax.Array


class AllButTheTop(NamedTuple):
    """A fitted all-but-the-top: ``mean`` `[d]`, ``directions`` `[D, d]` (orthonormal rows)."""

    mean: jax.Array
    directions: jax.Array


class Zca(NamedTuple):
    """A fitted ZCA whitening: ``mean`` `[d]`, ``w`` `[d / g, g, g]` (blocks of `Σ^(−1/2)`),
    ``scale`` `[]` (`sqrt(τ)` with `keep_scale`, else 1; the total variance is kept only for
    near-isotropic input, see :mod:`isojax.core.whitening`)."""

    mean: jax.Array
    w: jax.Array
    scale: jax.Array


def principal_axes(cov: jax.Array | np.ndarray) -> tuple[jax.Array, jax.Array]:
    """`(U [d, d], s [d])` from `svd(cov)`, singular values descending, each column of `U` signed
    so that its largest-magnitude entry is positive (scikit-learn's `svd_flip`). A NumPy `cov`
    is decomposed by NumPy (on the host, in its dtype), anything else by `jax.numpy`."""
    xp = np if isinstance(cov, np.ndarray) else jnp
    u, s, _ = xp.linalg.svd(cov)
    top = xp.argmax(xp.abs(u), axis=0)  # [d]
    signs = xp.sign(u[top, xp.arange(u.shape[1])])
    return u * xp.where(signs == 0, 1.0, signs), s


def fit_bert_whitening(
    points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None = None, *, k: int | None = None
) -> BertWhitening:
    r"""Fits BERT-whitening to a set of vectors.

    .. math::
        \mu = \frac1n\sum_i x_i,\quad
        \Sigma = \frac{1}{n-1}\sum_i (x_i-\mu)(x_i-\mu)^\top = U \operatorname{diag}(s) U^\top,
        \quad W = U \operatorname{diag}(s^{-1/2})_{[:, :k]}

    PCA whitening: the output basis is the principal axes, not the input's. A zero singular
    value among the first `k` gives an infinite column, as in the reference: keep `k` at most
    the rank (`n − 1` for `n` points).

    The fit runs on the host in float64 NumPy (not jit-able), and only its result is cast back:
    in float32 the SVD's `ε₃₂ κ` error on the small singular values, which `s^(−1/2)` weights
    most, moved `W` from a float64 fit by 2e-2 at a condition number of 1e4 and 64 % at 1e6
    (22 % on MiniLM-L6's pooled vectors, κ 2.1e6). In float64 it holds within 1e-5 up to
    κ ~ 1e9.

    Args:
        points: `[..., d]` vectors, any float dtype.
        mask: over the leading axes, 1 = use (as in `stats.batch_moments`); None uses all.
        k: number of components kept, `d` by default (256 in the paper's reduced variant).

    Returns:
        `BertWhitening` in float32 (float64 for float64 input).
    """
    points = jnp.asarray(points)
    dtype = stats.stats_dtype(points.dtype)
    d = points.shape[-1]
    k = d if k is None else k
    if not 1 <= k <= d:
        raise ValueError(f"k must be in [1, {d}] for d = {d}, got {k}")
    x, w = (np.asarray(a, np.float64) for a in stats.flatten_points(points, mask))
    count = w.sum()
    mean = w @ x / max(count, 1.0)
    centred = (x - mean) * (w > 0)[:, None]
    cov = (centred * w[:, None]).T @ centred / max(count - 1.0, 1.0)
    u, s = principal_axes(cov)
    with np.errstate(divide="ignore"):
        kernel = (u / np.sqrt(s))[:, :k]
    return BertWhitening(mean=jnp.asarray(mean, dtype), kernel=jnp.asarray(kernel, dtype))


def apply_bert_whitening(fit: BertWhitening, points: jax.typing.ArrayLike) -> jax.Array:
    """`(x − μ) W`: `[..., d]` -> `[..., k]`, float32 (or wider)."""
    x = jnp.asarray(points)
    x = x.astype(stats.stats_dtype(x.dtype))
    return jnp.einsum("...d,dk->...k", x - fit.mean, fit.kernel, precision=HIGHEST)


def fit_abtt(
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    num_directions: int | None = None,
) -> AllButTheTop:
    r"""Fits all-but-the-top: the mean and the top `D` principal directions `u_1 … u_D` of the
    `n − 1` covariance (as BERT-whitening's `U`).

    Args:
        points: `[..., d]` vectors, any float dtype.
        mask: over the leading axes, 1 = use; None uses all.
        num_directions: `D`, `round(d / 100)` by default (4 for d = 384; the paper's `d / 100`).

    Returns:
        `AllButTheTop` in float32 (float64 for float64 input).
    """
    moments = stats.batch_moments(points, mask, ddof=1)
    d = moments.mean.shape[-1]
    num = round(d / 100) if num_directions is None else num_directions
    if not 0 <= num <= d:
        raise ValueError(f"num_directions must be in [0, {d}] for d = {d}, got {num}")
    u, _ = principal_axes(moments.cov)
    return AllButTheTop(mean=moments.mean, directions=u[:, :num].T)


def apply_abtt(fit: AllButTheTop, points: jax.typing.ArrayLike) -> jax.Array:
    r""":math:`\tilde x - \sum_{j \le D} (u_j^\top \tilde x)\, u_j` with
    :math:`\tilde x = x - \mu`: `[..., d]` -> `[..., d]`, float32 (or wider)."""
    x = jnp.asarray(points)
    centred = x.astype(stats.stats_dtype(x.dtype)) - fit.mean  # [..., d]
    coef = jnp.einsum("...d,jd->...j", centred, fit.directions, precision=HIGHEST)  # [..., D]
    return centred - jnp.einsum("...j,jd->...d", coef, fit.directions, precision=HIGHEST)


def fit_zca(
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    alpha: float = 0.1,
    epsilon: float = 1e-5,
    keep_scale: bool = True,
    group_size: int | None = None,
) -> Zca:
    r"""Fits the ZCA whitening of SPEC.md §10.1 once, on the whole set: `μ` and the biased
    covariance `S` (divided by `n`, as §10.1's batch moments) in place of the debiased running
    `μ̂`, `Ŝ`, then `whitening.whitening_matrix`:

    .. math::
        \Sigma = (1-\alpha) S + (\alpha\tau + \epsilon) I,\quad \tau = \operatorname{tr} S / d,
        \quad W = \Sigma^{-1/2}\ \text{(symmetric)}.

    Args:
        points: `[..., d]` vectors, any float dtype.
        mask: over the leading axes, 1 = use; None uses all.
        alpha, epsilon, keep_scale, group_size: as the ``whiten`` normaliser's (same defaults).

    Returns:
        `Zca` in float32 (float64 for float64 input).
    """
    moments = stats.batch_moments(points, mask, ddof=0)
    w, tau = whitening.whitening_matrix(
        moments.cov, alpha=alpha, epsilon=epsilon, group_size=group_size
    )
    scale = jnp.sqrt(tau) if keep_scale else jnp.ones_like(tau)
    return Zca(mean=moments.mean, w=w, scale=scale)


def apply_zca(fit: Zca, points: jax.typing.ArrayLike) -> jax.Array:
    """`(x − μ) W · scale`: `[..., d]` -> `[..., d]`, float32 (or wider)."""
    x = jnp.asarray(points)
    x = x.astype(stats.stats_dtype(x.dtype))
    return whitening.apply_whitening(x, fit.mean, fit.w, fit.scale)
