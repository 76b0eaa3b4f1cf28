r"""Running ZCA whitening of the sentence vector, the ``whiten`` normaliser (SPEC.md §10.1).

IsoBN's gain is diagonal: it rescales dimensions but cannot rotate, so it leaves a collapse onto
a direction that is not aligned with the axes almost unchanged. ZCA whitening,

.. math::
    y = (x - \hat\mu)\,\Sigma^{-1/2}\sqrt{\tau},\qquad
    \Sigma = (1-\alpha)\hat S + (\alpha\tau + \epsilon) I,\qquad \tau = \operatorname{tr}\hat S/d,

can. The pure step `whiten` has the form of :mod:`isojax.core.normalizers`' steps,
`(state, x, mask, *, update, axis_name, ...) -> (y, new state or None, ok or None)`, with
IsoBN's conventions: running mean ``mean`` `[d]` and covariance ``cov`` `[d, d]` in float32 on a
stop-gradient copy of the batch (masked rows left out, global over ``axis_name``; under plain
`jit` with a sharded batch the moments are global already), the update before the transform,
the transform from the running state in training and evaluation alike, the identity before the
first update, the guarded update and ``count``/``skipped`` counters of
:mod:`isojax.core.running` (a non-finite batch or one with fewer than 2 unmasked rows is skipped
and counted, never absorbed). The state keeps the full ``cov`` whatever ``group_size``: the
block-diagonal part is taken at transform time, so the state's shape depends on `d` only.

`W = Σ^(−1/2)` comes from coupled Newton–Schulz iterations run to convergence (`inverse_sqrt`),
not from `eigh`. `experiments/bench/whiten_cost.py` measured both in float32 on this project's
CPU (2 cores shared with other jobs, load average 7.8–9.2, so the timings are noisy: medians of
5 interleaved rounds) on a Σ near the worst conditioning the shrinkage allows (κ ≈ 0.9 d / α:
3321, 6403, 8337 at d = 384, 768, 1024). Accuracy decided it: float32 `eigh`'s `W` was off
float64 `eigh`'s by 2.8e-4, 5.7e-4, 7.1e-4 (relative Frobenius), above SPEC.md's 1e-4, since
its backward error `~ε₃₂‖Σ‖` is an `ε₃₂ κ` relative error on the small eigenvalues that dominate
`W`; Newton–Schulz, converged after 15–17 steps, was off by 3.2e-5, 6.3e-5, 6.5e-5. Time did
not argue against it: medians 40 / 379 / 742 ms for Newton–Schulz against 163 / 691 / 1767 ms
for `eigh` (min–max spreads 7–2132 ms for `eigh`, so no more than "not slower" is claimed). On
GPU, matrix products are fast and `eigh` is slow, which favours Newton–Schulz further. The step
count is not fixed ([IterNorm]'s T = 5 does not converge at κ ~ d / α): it is that of the
scalar recursion on the smallest eigenvalue the shrinkage guarantees
(`newton_schulz_iterations`, at most 19 steps for any normalised eigenvalue down to 1e-5).
Newton–Schulz's float32 error still grows like `ε₃₂ κ`, so an `α` that lets κ pass
`MAX_CONDITION` (1e4; α below 0.037 at d = 384) is refused at trace time (`check_conditioning`).

``keep_scale`` multiplies by `sqrt(τ)`: the output covariance is then about `τ I` in the
directions the shrinkage does not dominate, and the total variance equals the input's only for
a near-isotropic input. Under a collapse it falls a lot: 0.99 of the input's for an isotropic
input, 0.51 with 90 % of the variance on one direction, 0.09 with 99 % (SPEC.md §10.1).
`docs/study/whitening.md` measures what this transform does to fine-tuning (it is reversed by
the study) and `isojax.core.iternorm` the whitening the literature trains.

References:
    Huang et al., `Decorrelated Batch Normalization <https://arxiv.org/abs/1804.08450>`_,
    CVPR 2018 (ZCA, groups) [DBN]. Huang et al., `Iterative Normalization
    <https://arxiv.org/abs/1904.03441>`_, CVPR 2019 (Newton–Schulz) [IterNorm].
"""

import jax
import jax.numpy as jnp
from jax import lax

from isojax.core import running, stats
from isojax.core.running import STATS_DTYPE
from isojax.core.stats import HIGHEST

# The largest condition number of the shrunk covariance for which float32 Newton–Schulz meets
# SPEC.md's 1e-4 (relative Frobenius against float64 `eigh`): its error grows like `ε₃₂ κ`,
# measured at d = 384 on a 99.9 %-collapsed covariance as 2.9e-5 at κ = 3457 (α = 0.1), 7.5e-5
# at κ = 9995 (α = 0.037), 1.3e-4 at κ = 18817 (α = 0.02). `check_conditioning` refuses more.
MAX_CONDITION = 10_000.0


def min_alpha(d: int) -> float:
    """The smallest shrinkage `α` whose worst condition number `((1 − α) d + α) / α` at feature
    size `d` is at most `MAX_CONDITION`: `d / (MAX_CONDITION + d − 1)` (0.037 at d = 384, 0.071
    at 768, 0.093 at 1024)."""
    return d / (MAX_CONDITION + d - 1.0)


def check_conditioning(d: int, alpha: float) -> None:
    """Raises ValueError (one line, at trace time) when `alpha` lets the shrunk covariance of
    `d` features be worse conditioned than `MAX_CONDITION`, where the float32 whitening matrix
    would miss SPEC.md's 1e-4."""
    if alpha < min_alpha(d):
        raise ValueError(
            f"alpha {alpha} at feature size {d} allows condition numbers above "
            f"{MAX_CONDITION:g}, where the float32 whitening matrix misses SPEC.md's 1e-4; "
            f"use alpha >= {min_alpha(d):.4f}"
        )


def whiten_init(d: int) -> dict[str, jax.Array]:
    """The running state at zero: ``mean`` `[d]`, ``cov`` `[d, d]` (float32) and the
    ``count`` (the step count `t`) / ``skipped`` counters."""
    return {
        "mean": jnp.zeros((d,), STATS_DTYPE),
        "cov": jnp.zeros((d, d), STATS_DTYPE),
        **running.counters_init(),
    }


def whiten_update(
    state: dict, x: jax.Array, mask: jax.Array | None, *, momentum: float, axis_name=None
) -> tuple[dict, jax.Array]:
    r"""Moves the running moments towards the batch's, under the bad-batch guard.

    .. math::
        \mu \leftarrow m\mu + (1-m)\mu_B,\qquad S \leftarrow m S + (1-m) C_B,\qquad
        C_B = \frac{1}{m_B}\sum_i (x_i - \mu_B)(x_i - \mu_B)^\top,

    on a stop-gradient copy of the unmasked rows (biased, divided by their number `m_B`).

    Args:
        state: `whiten_init`'s dict.
        x: `[batch, d]` (or `[..., d]`), any float dtype.
        mask: `[batch]` (aligned with `x`'s leading axes), 1 = keep; None keeps every row.
        momentum: `m`.
        axis_name: mapped axis (shard_map/pmap) to reduce the moments over, or None.

    Returns:
        `(new state, ok)`: `ok` is False (and the state unchanged but for ``skipped``) for a
        batch with fewer than 2 unmasked rows or non-finite moments.
    """
    batch = stats.batch_moments(lax.stop_gradient(x), mask, axis_name=axis_name)
    ok = running.batch_ok(batch.count, batch.mean, batch.cov, min_count=2)
    new = {
        "mean": running.ema(momentum, state["mean"], batch.mean),
        "cov": running.ema(momentum, state["cov"], batch.cov),
    }
    return running.guarded(state, new, ok), ok


def debiased_moments(state: dict, *, momentum: float) -> tuple[jax.Array, jax.Array]:
    r"""`(μ̂ [d], Ŝ [d, d])`: the running moments divided by :math:`1 - m^t`, `t` = ``count``.

    The correction is `-expm1(t log m)`, exact to float32 rounding even at `t = 1`; it is 1 at
    `t = 0` (where the transform is the identity anyway) so nothing divides by zero.
    """
    t = state["count"].astype(STATS_DTYPE)
    correction = -jnp.expm1(t * jnp.log(jnp.asarray(momentum, STATS_DTYPE)))
    correction = jnp.where(state["count"] > 0, correction, 1.0)
    return state["mean"] / correction, state["cov"] / correction


def diagonal_blocks(cov: jax.Array, group_size: int | None) -> jax.Array:
    """`[d, d]` -> `[d / g, g, g]`, the diagonal blocks of consecutive groups of `g` features
    (one block of `d` for None).

    Raises:
        ValueError: `g` does not divide `d`.
    """
    d = cov.shape[-1]
    g = d if group_size is None else group_size
    if g < 1 or d % g:
        raise ValueError(f"group_size {group_size} does not divide the feature size {d}")
    blocks = cov.reshape(d // g, g, d // g, g)  # [G, g, G, g]
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=0, axis2=2), -1, 0)  # [G, g, g]


def newton_schulz_iterations(
    x_min: jax.Array, *, tol: float | None = None, cap: int = 100
) -> jax.Array:
    """The number of coupled Newton–Schulz steps after which the smallest normalised eigenvalue
    `x_min` (the hardest one: every larger one in (0, 1] converges sooner) has converged: the
    scalar recursion `t = (3 − z y) / 2, y ← y t, z ← t z` from `(x_min, 1)` until
    `|z y − 1| < tol`, plus one step; at most `cap`. An int32 scalar.

    `tol` defaults to 8 ulps of `x_min`'s dtype (9.5e-7 in float32): the recursion can settle
    one ulp away from 1 (`z y = 1 − 2⁻²³` in float32) and never meet a tolerance below it, which
    sent about 5 % of covariances to the cap. The error contracts quadratically
    (`e ← (3/4) e²` near 1), so the one step after `|e| < 8 ulps` leaves it below rounding."""
    one = jnp.ones((), x_min.dtype)
    tol = 8.0 * float(jnp.finfo(x_min.dtype).eps) if tol is None else tol

    def running(carry):
        k, y, z = carry
        return (jnp.abs(z * y - 1.0) >= tol) & (k < cap - 1)

    def step(carry):
        k, y, z = carry
        t = 0.5 * (3.0 - z * y)
        return k + 1, y * t, t * z

    k, _, _ = lax.while_loop(running, step, (jnp.zeros((), jnp.int32), x_min, one))
    return k + 1


def inverse_sqrt(sigma: jax.Array, floor: jax.typing.ArrayLike) -> jax.Array:
    r"""Symmetric inverse square root of symmetric positive definite matrices by coupled
    Newton–Schulz iterations run to convergence ([IterNorm] runs a fixed T = 5).

    .. math::
        Y_0 = \frac{\Sigma}{\operatorname{tr}\Sigma},\; Z_0 = I,\qquad
        T_k = \tfrac12 (3I - Z_k Y_k),\; Y_{k+1} = Y_k T_k,\; Z_{k+1} = T_k Z_k,\qquad
        \Sigma^{-1/2} = \frac{Z_K}{\sqrt{\operatorname{tr}\Sigma}},

    `Z_k → (Σ / tr Σ)^(−1/2)` quadratically once close, for eigenvalues in (0, 1]. `K` is
    `newton_schulz_iterations` of the smallest eigenvalue that `floor` guarantees, so the
    iteration runs until converged for the worst condition number `sigma` can have. `Z_K` is a
    polynomial in `Σ`, hence symmetric (symmetrised against rounding) and rotation-equivariant.

    Args:
        sigma: `[..., g, g]` symmetric positive definite.
        floor: `[]` a lower bound on the eigenvalues of every matrix in `sigma`, `> 0`
            (`α τ + ε` for the shrunk covariance of `whitening_matrix`).

    Returns:
        `[..., g, g]`, dtype of `sigma`.
    """
    trace = jnp.trace(sigma, axis1=-2, axis2=-1)[..., None, None]  # [..., 1, 1]
    eye = jnp.broadcast_to(jnp.eye(sigma.shape[-1], dtype=sigma.dtype), sigma.shape)
    iters = newton_schulz_iterations(jnp.min(floor / trace).astype(sigma.dtype))

    def step(_, yz):
        y, z = yz
        t = 0.5 * (3.0 * eye - jnp.matmul(z, y, precision=HIGHEST))
        return jnp.matmul(y, t, precision=HIGHEST), jnp.matmul(t, z, precision=HIGHEST)

    _, z = lax.fori_loop(0, iters, step, (sigma / trace, eye))
    w = z * lax.rsqrt(trace)
    return 0.5 * (w + jnp.swapaxes(w, -1, -2))


def whitening_matrix(
    cov: jax.typing.ArrayLike,
    *,
    alpha: float,
    epsilon: float,
    group_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    r"""ZCA whitening blocks of a (debiased) covariance, with shrinkage towards `τ I`.

    .. math::
        \tau = \frac{\operatorname{tr}\hat S}{d},\qquad
        \Sigma_k = (1-\alpha)\hat S_{kk} + (\alpha\tau + \epsilon) I,\qquad
        W_k = \Sigma_k^{-1/2},

    with :math:`\hat S_{kk}` the `k`-th diagonal block of `g` consecutive features ([DBN]'s
    groups; one block of `d` for `group_size=None`). `τ` is the global one, so every block is
    scaled alike and `W = blockdiag(W_k)` is `Σ^(−1/2)` of the block-diagonal shrunk covariance
    (SPEC.md §10.1 with `Ŝ` replaced by its block-diagonal part). The condition number of
    `Σ_k` is at most `((1 − α) d + α) / α`. ZCA, not PCA: `W` is symmetric, so the output keeps
    the input's basis and rotating the input by `Q` rotates the output by `Q`.

    Args:
        cov: `[d, d]` covariance `Ŝ` (float32 or wider).
        alpha: shrinkage `α` in [`min_alpha(d)`, 1] (`check_conditioning`).
        epsilon: `ε > 0`.
        group_size: `g` dividing `d`, or None for full whitening.

    Returns:
        `(W [d / g, g, g], τ [])` in `cov`'s statistics dtype.

    Raises:
        ValueError: `alpha` below `min_alpha(d)`, or `group_size` not dividing `d`.
    """
    cov = jnp.asarray(cov)
    cov = cov.astype(stats.stats_dtype(cov.dtype))
    check_conditioning(cov.shape[-1], alpha)
    tau = jnp.trace(cov) / cov.shape[-1]
    blocks = diagonal_blocks(cov, group_size)  # [G, g, g]
    eye = jnp.eye(blocks.shape[-1], dtype=cov.dtype)
    sigma = (1.0 - alpha) * blocks + (alpha * tau + epsilon) * eye
    return inverse_sqrt(sigma, floor=alpha * tau + epsilon), tau


def apply_whitening(x: jax.Array, mean: jax.Array, w: jax.Array, scale: jax.Array) -> jax.Array:
    """`(x − mean) · blockdiag(w) · scale`: `x` `[..., d]`, `mean` `[d]`, `w` `[G, g, g]`,
    `scale` `[]` -> `[..., d]` in the dtype of `x` promoted with the statistics'."""
    groups, g = w.shape[0], w.shape[-1]
    centred = (x - mean).reshape(*x.shape[:-1], groups, g)  # [..., G, g]
    y = jnp.einsum("...ki,kij->...kj", centred, w, precision=HIGHEST)  # [..., G, g]
    return y.reshape(x.shape) * scale


def whiten_running_transform(
    state: dict,
    *,
    momentum: float,
    alpha: float,
    epsilon: float,
    keep_scale: bool,
    group_size: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(μ̂ [d], W [G, g, g], scale [])` of the running state, stop-gradient: `scale` is `sqrt(τ)`
    with `keep_scale` (which keeps the total variance only for near-isotropic input; see the
    module docstring), else 1; before the first update (`count == 0`) the identity transform
    (`μ̂ = 0`, `W = I`, `scale = 1`)."""
    mean, cov = debiased_moments(state, momentum=momentum)
    w, tau = whitening_matrix(cov, alpha=alpha, epsilon=epsilon, group_size=group_size)
    scale = jnp.sqrt(tau) if keep_scale else jnp.ones_like(tau)
    seen = state["count"] > 0
    mean = jnp.where(seen, mean, 0.0)
    w = jnp.where(seen, w, jnp.broadcast_to(jnp.eye(w.shape[-1], dtype=w.dtype), w.shape))
    scale = jnp.where(seen, scale, 1.0)
    return lax.stop_gradient(mean), lax.stop_gradient(w), lax.stop_gradient(scale)


def whiten(
    state: dict, x: jax.Array, mask: jax.Array | None, *, update: bool, dtype=None, **hparams
) -> tuple[jax.Array, dict | None, jax.Array | None]:
    r"""The ``whiten`` normaliser's step (`Whiten` in both front ends), SPEC.md §10.1.

    Update the running moments (if `update`; `whiten_update`), then, from the (new) running
    state,

    .. math::
        y = (x - \hat\mu)\,W\,\sqrt{\tau}\quad(\texttt{keep\_scale}),\qquad
        \frac{\partial y}{\partial x} = W\sqrt{\tau}

    (`whiten_running_transform`, `apply_whitening`): `μ̂`, `W` and `τ` are stop-gradient, so the
    gradient flows through `x` only; before the first update the output is `x`.

    Args:
        state: `whiten_init(d)`'s dict.
        x: `[batch, d]` (or `[..., d]`), any float dtype; the maths runs in float32.
        mask: `[batch]` 1 for real rows, 0 for padding rows left out of the statistics.
        update: move the running state (training); ``train`` is not read, since the transform
            always comes from the running state.
        dtype: output dtype; None keeps `x`'s.
        **hparams: ``momentum``, ``alpha``, ``epsilon``, ``keep_scale``, ``group_size`` and
            ``axis_name``.

    Returns:
        `(y` of `x`'s shape, `new state` or None, `ok` or None`)`.
    """
    momentum, axis_name = hparams["momentum"], hparams.get("axis_name")
    new, ok = (None, None)
    if update:
        new, ok = whiten_update(state, x, mask, momentum=momentum, axis_name=axis_name)
        state = new
    transform = {k: hparams[k] for k in ("alpha", "epsilon", "keep_scale", "group_size")}
    mean, w, scale = whiten_running_transform(state, momentum=momentum, **transform)
    y = apply_whitening(x.astype(stats.stats_dtype(x.dtype)), mean, w, scale)
    return y.astype(dtype or x.dtype), new, ok
