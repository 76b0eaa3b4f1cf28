r"""Iterative normalisation, the ``iternorm`` normaliser (SPEC.md §10.3): whitening with the
batch's own statistics, as [IterNorm] trains it.

The running ``whiten`` of :mod:`isojax.core.whitening` transforms with running estimates kept
outside the gradient step; ``iternorm`` whitens each training batch with its own masked
statistics and lets the gradient flow through them, as batch norm does. Per group of `g`
consecutive features (one group of `d` by default), on the `m` unmasked rows of a batch `X`:

.. math::
    \mu = \tfrac1m\textstyle\sum_i x_i,\quad X_c = X - \mu,\quad
    \Sigma = \epsilon I + X_c^\top X_c / m,\quad \Sigma_N = \Sigma / \operatorname{tr}\Sigma,

    P_0 = I,\quad P_{k+1} = \tfrac32 P_k - \tfrac12 P_k^3 \Sigma_N\ (k < T),\quad
    W = P_T / \sqrt{\operatorname{tr}\Sigma},\quad y = X_c W.

`T` (``iterations``, 5 by default) Newton–Schulz steps give a *partial* whitening on purpose:
it is not run to convergence (`whitening.inverse_sqrt` is). SPEC.md §10.3 and [IterNorm] use
T = 5; the rule accepts `0 ≤ T ≤ normalizers.MAX_ITERATIONS` (6). This uncoupled iteration
amplifies float32 rounding in the directions a batch does not span (a 32-row batch at
`d = 384` is rank-deficient, Σ's condition number about 1e6), and those directions reach the
running `W_r` that evaluation uses. Against the float64 value of the same recursion on the
float64 Σ, the float32 `W` is off by at most 5e-5 at T = 6 on every batch tried (2 rows of 8
features to 32 of 384: 1.5e-7 there), but by 2.4e-3 at T = 7 on 2 rows of 8, and on 32 rows of
384 by 8.6e-4 at T = 10, 13× at T = 12 and 1e27 at T = 15 (audit 6, finding 3). SPEC's fact
that large T (50) approaches `Σ^(−1/2)` holds for a well-conditioned Σ only;
`iterative_whitening` itself takes any T. The gradient flows through `μ`,
`Σ` and every `P_k` by plain autodiff (the reference's hand-written backward equals it), unless
``stop_gradient``: the same forward with `μ` and `W` detached, so that `∂y/∂x = W` only.

Running state, PyTorch's convention with momentum `ρ` (0.1): ``mean`` `μ_r ← (1 − ρ) μ_r + ρ μ`
(init 0) and ``wmat`` `W_r ← (1 − ρ) W_r + ρ W` (`[d / g, g, g]`, init `I`), on stop-gradient
copies, with the ``count``/``skipped`` counters and guard of :mod:`isojax.core.running`.
Evaluation: `y = (x − μ_r) W_r`. Statistics are float32 whatever the input dtype; under
`shard_map`/`pmap` the masked sums are psum-ed over ``axis_name`` (under plain `jit` with a
sharded batch they are global already).

A bad training batch (fewer than `MIN_ROWS["iternorm"]` = 2 unmasked rows, or non-finite
statistics) is skipped: the running state does not move, ``skipped`` counts it, and the
output is that of evaluation, `(x − μ_r) W_r` (`x` itself before any update), so a batch of
one real row gives a finite output rather than the constant `0` its own statistics would.
Non-finite input still gives non-finite output.

The optional affine (per-feature ``scale`` 1 and ``bias`` 0 at init, the reference's
`affine=True`) is off by default: in the classifier head a Dense layer follows, which absorbs
it. Why the running ``whiten`` fails to train and what ``iternorm`` changes is measured in
`docs/study/whitening.md`: its causal grid (5 seeds, CoLA, MRPC, STS-B) keeps the defaults
(one group, T = 5, the gradient through the statistics), since the detached statistics
(``stop_gradient=True``) do not train and groups of 16 are not detected to help.

References:
    Huang et al., `Iterative Normalization: Beyond Standardization towards Efficient
    Whitening <https://arxiv.org/abs/1904.03441>`_, CVPR 2019 [IterNorm] (reference
    huangleiBuaa/IterNorm-pytorch).
"""

import jax
import jax.numpy as jnp
from jax import lax

from isojax.core import running, stats, whitening
from isojax.core.normalizers import MIN_ROWS
from isojax.core.running import STATS_DTYPE
from isojax.core.stats import HIGHEST


def group_shape(d: int, group_size: int | None) -> tuple[int, int]:
    """`(G, g)`: `G = d / g` groups of `g` consecutive features (`g = d` for None).

    Raises:
        ValueError: `g` does not divide `d`.
    """
    g = d if group_size is None else int(group_size)
    if g < 1 or d % g:
        raise ValueError(f"group_size {group_size} does not divide the feature size {d}")
    return d // g, g


def iternorm_init(d: int, *, group_size: int | None = None) -> dict[str, jax.Array]:
    """The running state at start: ``mean`` `[d]` zeros, ``wmat`` `[d / g, g, g]` identities
    (float32), and the ``count``/``skipped`` counters."""
    groups, g = group_shape(d, group_size)
    eye = jnp.broadcast_to(jnp.eye(g, dtype=STATS_DTYPE), (groups, g, g))
    return {"mean": jnp.zeros((d,), STATS_DTYPE), "wmat": eye, **running.counters_init()}


def batch_covariance(
    x: jax.Array,
    mask: jax.Array | None,
    *,
    group_size: int | None,
    epsilon: float,
    axis_name: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    r"""`(m [], μ [d], Σ [G, g, g])` of the unmasked rows: `Σ_k = ε I + X_{c,k}^T X_{c,k} / m`
    per group (biased), in float32 (or wider), global over `axis_name`; differentiable.

    Two passes (mean, then centred products), masked rows zeroed before they are summed, so a
    NaN in a padding row does not reach the statistics; `m` is clamped to 1 in the divisions.
    """
    flat, w = stats.flatten_points(x, mask)  # [n, d], [n]
    groups, g = group_shape(flat.shape[-1], group_size)

    def total(a):
        return a if axis_name is None else lax.psum(a, axis_name)

    count = total(jnp.sum(w))
    denom = jnp.maximum(count, 1.0)
    mean = total(stats.contract("n,nd->d", w, flat)) / denom  # [d]
    centred = ((flat - mean) * (w > 0)[:, None]).reshape(-1, groups, g)  # masked rows 0
    weighted = centred * w[:, None, None]
    products = total(stats.contract("nki,nkj->kij", weighted, centred))  # [G, g, g]
    eye = jnp.eye(g, dtype=flat.dtype)
    return count, mean, epsilon * eye + products / denom


def iterative_whitening(sigma: jax.Array, iterations: int) -> jax.Array:
    r"""`W = P_T / sqrt(tr Σ)` of `[..., g, g]` covariances after `T = iterations` steps of
    `P_{k+1} = 1.5 P_k − 0.5 P_k³ Σ_N` from `P_0 = I`, `Σ_N = Σ / tr Σ` ([IterNorm]'s partial
    whitening; `T = 0` gives `I / sqrt(tr Σ)`). Differentiable through every step."""
    trace = jnp.trace(sigma, axis1=-2, axis2=-1)[..., None, None]  # [..., 1, 1]
    sigma_n = sigma / trace
    p = jnp.broadcast_to(jnp.eye(sigma.shape[-1], dtype=sigma.dtype), sigma.shape)
    for _ in range(int(iterations)):
        p2 = jnp.matmul(p, p, precision=HIGHEST)
        p3 = jnp.matmul(p2, p, precision=HIGHEST)
        p = 1.5 * p - 0.5 * jnp.matmul(p3, sigma_n, precision=HIGHEST)
    return p * lax.rsqrt(trace)


def _apply(x32: jax.Array, mean: jax.Array, wmat: jax.Array) -> jax.Array:
    return whitening.apply_whitening(x32, mean, wmat, jnp.ones((), x32.dtype))


def iternorm(
    state: dict,
    x: jax.Array,
    mask: jax.Array | None,
    *,
    train: bool,
    update: bool,
    momentum: float,
    iterations: int,
    epsilon: float,
    group_size: int | None,
    stop_gradient: bool,
    params: dict | None = None,
    axis_name: str | None = None,
    dtype=None,
) -> tuple[jax.Array, dict | None, jax.Array | None]:
    """The ``iternorm`` normaliser's step (`IterNorm` in both front ends), SPEC.md §10.3.

    Args:
        state: `iternorm_init(d, group_size=...)`'s dict.
        x: `[batch, d]` (or `[..., d]`), any float dtype; the maths runs in float32.
        mask: `[batch]` 1 for real rows, 0 for padding rows left out of the statistics.
        train: whiten with the batch's statistics (else the running ones).
        update: move the running state (training, outside linen's `init`).
        momentum: `ρ` of the running state, PyTorch's convention (0.1: 10 % of the batch).
        iterations: `T`, Newton–Schulz steps.
        epsilon: `ε` added to the covariance's diagonal.
        group_size: `g` dividing `d`, None for one group.
        stop_gradient: detach the batch's `μ` and `W` (same forward).
        params: ``scale`` / ``bias`` `[d]` of the optional affine, where used.
        axis_name: mapped axis to reduce the statistics over (shard_map/pmap), or None.
        dtype: output dtype; None keeps `x`'s.

    Returns:
        `(y` of `x`'s shape, `new state` or None, `ok` or None`)`: `ok` False for a skipped
        batch, whose output is the running one (see the module docstring).
    """
    x32 = x.astype(stats.stats_dtype(x.dtype))
    y, new, ok = _apply(x32, state["mean"], state["wmat"]), None, None
    if train:
        count, mean, sigma = batch_covariance(
            x32, mask, group_size=group_size, epsilon=epsilon, axis_name=axis_name
        )
        # A non-finite Σ is replaced before the iteration (the double `where`): the skipped
        # batch's gradient is then the evaluation output's, not 0 · inf = NaN.
        stats_ok = lax.stop_gradient(jnp.all(jnp.isfinite(sigma)))
        sigma = jnp.where(stats_ok, sigma, jnp.eye(sigma.shape[-1], dtype=sigma.dtype))
        wmat = iterative_whitening(sigma, iterations)
        ok = stats_ok & running.batch_ok(count, mean, wmat, min_count=MIN_ROWS["iternorm"])
        if stop_gradient:
            mean, wmat = lax.stop_gradient(mean), lax.stop_gradient(wmat)
        y = jnp.where(ok, _apply(x32, mean, wmat), y)
        if update:
            keep = 1.0 - momentum  # `running.ema`'s Flax form takes the weight of the old value
            moved = {
                "mean": running.ema(keep, state["mean"], lax.stop_gradient(mean)),
                "wmat": running.ema(keep, state["wmat"], lax.stop_gradient(wmat)),
            }
            new = running.guarded(state, moved, ok)
    params = params or {}
    if "scale" in params:
        y = y * params["scale"]
    if "bias" in params:
        y = y + params["bias"]
    return y.astype(dtype or x.dtype), new, ok
