"""Moments of point clouds: masked batch moments and a streaming accumulator.

Every function here is pure and jit-able, computes in float32 at least whatever the
input dtype (bfloat16/float16 in, float32 out; float64 stays float64), and runs its
covariance matmuls at ``precision=HIGHEST`` (float32 ``DEFAULT`` is TF32 on A100/H100
and bfloat16 passes on TPU).

Points are ``[..., d]``: the leading axes are flattened into one axis of ``m`` points.
A mask is aligned with those leading axes from the left: its axis ``i`` is the points' axis
``i``, and it repeats over the leading axes it lacks. A ``[batch]`` mask on ``[batch, len, d]``
token vectors keeps or drops whole examples; a ``[batch, len]`` attention mask on
``[batch, len, d]`` keeps single tokens. Hidden states of several layers ``[layers, batch,
len, d]`` take a ``[layers, batch, len]`` mask (``jnp.broadcast_to(attention_mask,
hidden.shape[:-1])``); a ``[batch, len]`` mask there is an error, never silently aligned with
``[len]`` or ``[layers]`` (NumPy broadcasting, which aligns from the right, would pair a
``[batch]`` mask with the ``len`` axis of ``[batch, len, d]`` whenever batch == len).

The covariance is centred on the batch mean before the outer product (two passes over
the batch), never formed as ``E[xxᵀ] − μμᵀ``: that difference loses every digit when
the mean is large next to the spread, which is the case for BERT's [CLS] vectors.
Batches and devices are combined with the parallel update of Chan, Golub & LeVeque
(1979), which is exact in exact arithmetic and as stable as the two-pass formula.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST


class Moments(NamedTuple):
    """First and second moments of a point cloud.

    Attributes:
      count: ``[]`` number of (unmasked) points.
      mean: ``[d]`` mean.
      cov: ``[d, d]`` covariance, ``Σ (x − μ)(x − μ)ᵀ / (count − ddof)``.
      std: ``[d]`` per-dimension standard deviation, ``sqrt(diag(cov))``.
    """

    count: jax.Array
    mean: jax.Array
    cov: jax.Array
    std: jax.Array


class MomentState(NamedTuple):
    """Streaming moment accumulator: O(d²) memory whatever the number of points.

    Attributes:
      count: ``[]`` points seen.
      mean: ``[d]`` their mean.
      m2: ``[d, d]`` sum of centred outer products ``Σ (x − μ)(x − μ)ᵀ``.
    """

    count: jax.Array
    mean: jax.Array
    m2: jax.Array


def stats_dtype(dtype: jax.typing.DTypeLike) -> jnp.dtype:
    """The dtype statistics are computed in: float32, or wider if the input is wider."""
    return jnp.promote_types(dtype, jnp.float32)


def _leading_aligned(mask: jax.Array, lead: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """`mask` over the first `mask.ndim` of the `lead` axes, repeated over the rest -> `lead`.

    Each mask axis has the size of the points' axis it covers, or 1.

    Raises:
      ValueError: more mask axes than leading axes, or an axis of another size; the message
        names both shapes.
    """
    k = mask.ndim
    if k > len(lead) or any(m not in (1, n) for m, n in zip(mask.shape, lead, strict=False)):
        raise ValueError(
            f"mask of shape {mask.shape} does not cover the leading axes {lead} of the points "
            f"{shape}: a mask's axes are the points' first axes (size equal or 1), e.g. "
            f"[batch] or [batch, len] for [batch, len, d]; for [layers, batch, len, d] "
            f"broadcast the attention mask to [layers, batch, len] first"
        )
    return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(lead) - k)), lead)


def flatten_points(points: jax.typing.ArrayLike, mask: jax.typing.ArrayLike | None):
    """`[..., d]` points, mask over leading `[...]` -> `[m, d]` points (stats dtype), `[m]` weights.

    The mask is aligned with the points' leading axes from the left (`_leading_aligned`).
    """
    points = jnp.asarray(points)
    if points.ndim < 2:
        raise ValueError(f"points must be [..., d] with at least 2 dims, got shape {points.shape}")
    if not jnp.issubdtype(points.dtype, jnp.floating):
        raise ValueError(f"points must be floating point, got dtype {points.dtype}")
    lead, d = points.shape[:-1], points.shape[-1]
    x = points.astype(stats_dtype(points.dtype)).reshape(-1, d)
    if mask is None:
        w = jnp.ones(x.shape[:1], x.dtype)
    else:
        w = _leading_aligned(jnp.asarray(mask), lead, points.shape).reshape(-1).astype(x.dtype)
        # Dropped points are zeroed, not only weighted by 0: NaN * 0 is NaN, and a NaN in a
        # padding row must not poison the moments of the real ones.
        x = jnp.where(w[:, None] > 0, x, 0)
    return x, w


def contract(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum`` at HIGHEST precision whose output is replicated over the mesh.

    Under explicit sharding (``jax.make_mesh`` makes explicit axes by default) a
    contraction over a sharded axis (the points axis of a sharded batch) must name its
    output sharding; the moments of the global batch are replicated. Elsewhere (no mesh,
    automatic axes, inside ``shard_map``) this is a plain einsum.
    """
    mesh = jax.typeof(a).sharding.mesh
    if mesh.empty or jax.sharding.AxisType.Explicit not in mesh.axis_types:
        return jnp.einsum(subscripts, a, b, precision=HIGHEST)
    with jax.sharding.use_abstract_mesh(mesh):
        return jnp.einsum(subscripts, a, b, precision=HIGHEST, out_sharding=jax.P())


def _psum(x, axis_name):
    return x if axis_name is None else lax.psum(x, axis_name)


def _local_moment_state(x: jax.Array, w: jax.Array, axis_name) -> MomentState:
    """Count, mean and centred second moment of weighted points, global over ``axis_name``."""
    count = _psum(jnp.sum(w), axis_name)
    total = _psum(contract("m,md->d", w, x), axis_name)
    mean = total / jnp.maximum(count, 1)
    centred = (x - mean) * w[:, None]  # [m, d]; masked rows are exactly zero
    m2 = _psum(contract("md,me->de", centred, x - mean), axis_name)
    return MomentState(count=count, mean=mean, m2=m2)


def moments_finalize(state: MomentState, *, ddof: int = 0) -> Moments:
    r"""Mean, covariance and standard deviation from accumulated moments.

    .. math::
      \Sigma = \frac{M_2}{\max(n - \mathrm{ddof},\, 1)}

    With fewer than ``ddof + 1`` points the denominator is clamped to 1, so an empty or
    one-point state gives a zero covariance, never NaN.
    """
    denom = jnp.maximum(state.count - ddof, 1).astype(state.m2.dtype)
    cov = state.m2 / denom
    std = jnp.sqrt(jnp.maximum(jnp.diagonal(cov), 0))
    return Moments(count=state.count, mean=state.mean, cov=cov, std=std)


def batch_moments(
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    ddof: int = 0,
    axis_name: str | None = None,
) -> Moments:
    r"""Mean, covariance and per-dimension std of a (masked) point cloud.

    .. math::
      n = \sum_i w_i,\quad \mu = \frac{1}{n}\sum_i w_i x_i,\quad
      \Sigma = \frac{1}{n - \mathrm{ddof}} \sum_i w_i (x_i - \mu)(x_i - \mu)^\top

    Args:
      points: ``[..., d]`` points, any float dtype.
      mask: optional weights over the leading axes ``points.shape[:-1]``, aligned from the
        left (``[batch]`` on ``[batch, len, d]`` covers the examples; see the module
        docstring); 1 keeps a point, 0 drops it (token padding).
      ddof: 0 for the biased covariance (IsoBN, SPEC.md §1), 1 for the unbiased one
        (``torch.cov``, I-STAR, SPEC.md §4).
      axis_name: a mapped axis (``shard_map``/``pmap``) to reduce over, so that the
        moments are those of the global batch. Under plain ``jax.jit`` with a sharded
        array the moments are global already and no axis name is needed.

    Returns:
      ``Moments`` in float32 (float64 for float64 input).
    """
    x, w = flatten_points(points, mask)
    return moments_finalize(_local_moment_state(x, w, axis_name), ddof=ddof)


def moments_init(d: int, dtype: jax.typing.DTypeLike = jnp.float32) -> MomentState:
    """An empty accumulator for ``d``-dimensional points."""
    dtype = stats_dtype(dtype)
    return MomentState(
        count=jnp.zeros((), dtype), mean=jnp.zeros((d,), dtype), m2=jnp.zeros((d, d), dtype)
    )


def moments_merge(a: MomentState, b: MomentState) -> MomentState:
    r"""Moments of the union of two disjoint sets (Chan, Golub & LeVeque 1979).

    .. math::
      n = n_a + n_b,\quad \delta = \mu_b - \mu_a,\quad
      \mu = \mu_a + \delta\,\frac{n_b}{n},\quad
      M_2 = M_{2,a} + M_{2,b} + \delta\delta^\top \frac{n_a n_b}{n}
    """
    if a.mean.shape != b.mean.shape:
        raise ValueError(f"cannot merge moments of d={a.mean.shape} and d={b.mean.shape}")
    count = a.count + b.count
    safe = jnp.maximum(count, 1)
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / safe)
    m2 = a.m2 + b.m2 + jnp.outer(delta, delta) * (a.count * b.count / safe)
    return MomentState(count=count, mean=mean, m2=m2)


def moments_update(
    state: MomentState,
    points: jax.typing.ArrayLike,
    mask: jax.typing.ArrayLike | None = None,
    *,
    axis_name: str | None = None,
) -> MomentState:
    """Add a batch of ``[..., d]`` points (masked as in `batch_moments`, global over
    ``axis_name``) to ``state``."""
    x, w = flatten_points(points, mask)
    if x.shape[-1] != state.mean.shape[-1]:
        raise ValueError(
            f"points have d={x.shape[-1]} (shape {jnp.shape(points)}) but the accumulator "
            f"holds d={state.mean.shape[-1]}"
        )
    batch = _local_moment_state(x.astype(state.m2.dtype), w.astype(state.m2.dtype), axis_name)
    return moments_merge(state, batch)
