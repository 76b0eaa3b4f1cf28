"""Sentence-embedding transforms: IsoBN, re-centring, batch and layer normalisation.

Every transform here is a pure function of arrays (where it has maths of its own) plus a thin
linen module, and every module has the same call signature,

    module(x [batch, d], use_running_average: bool, *, mask=None) -> [batch, d], x.dtype

so a model picks one by name with :func:`make_normalizer` (`none`, `recenter`, `batchnorm`,
`layernorm`, `isobn`). Running statistics live in the ``'batch_stats'`` collection, always in
float32, so `mutable=['batch_stats']`, train states and checkpoints treat them as Flax treats
`nn.BatchNorm`.

Bad batches. A training batch whose statistics are not finite (NaN or Inf in the input, or a
float16 overflow upstream) or that holds too few points (fewer than 2 for IsoBN and batch norm,
fewer than 1 for re-centring, counting only unmasked rows) leaves the running statistics exactly
as they were. The module then adds 1 to ``batch_stats['skipped']`` and sows
``intermediates['skipped_batch'] = True`` (a bool scalar; read it with
``mutable=['batch_stats', 'intermediates']``). It never raises inside `jit`; the output of such a
batch is still computed (from the running state for IsoBN), so NaN input gives NaN output.

Sharding. Under `jax.jit` with the batch sharded over a mesh the batch statistics are already
those of the global batch (XLA inserts the reductions). Under `shard_map`/`pmap` pass
`axis_name` and the modules reduce over it.
"""

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from isojax import running, stats
from isojax.running import STATS_DTYPE


def isobn_gain(
    cov: jax.typing.ArrayLike,
    std: jax.typing.ArrayLike,
    *,
    beta: float = 0.5,
    epsilon: float = 1e-3,
) -> jax.Array:
    r"""IsoBN's per-dimension gain from running statistics (SPEC.md §1).

    .. math::
        \rho = \mathrm{clip}\!\left(\frac{S}{s s^\top}, -1, 1\right),\quad
        \gamma_i = \frac1d \sum_j \rho_{ij}^2,\quad
        g_i = (\gamma_i s_i + \epsilon)^{-\beta},\quad
        c = \sqrt{\frac{\operatorname{tr} S}{\sum_i S_{ii} g_i^2 + \epsilon}},

    and the gain is :math:`c\,g`. Dimensions with a large standard deviation that are strongly
    correlated with many others are shrunk; `c` keeps the total variance unchanged. A pair with
    `s_i s_j = 0` gets `rho_ij = 0`, the limit of the formula (it then no longer matters, since
    `gamma_i s_i -> 0`); the reference divides 0 by 0 there.

    Args:
        cov: `[d, d]` running covariance `S`.
        std: `[d]` running standard deviation `s` (its own moving average, not
            `sqrt(diag(S))`).
        beta: exponent `β` (0.5 in the paper).
        epsilon: `ε` (1e-3 in the paper).

    Returns:
        `[d]` gain, float32 (float64 for float64 input). Zero statistics give a zero gain: the
        module returns gain 1 before its first update instead.

    References:
        Zhou, Lin, Ren, `IsoBN: Fine-Tuning BERT with Isotropic Batch Normalization
        <https://arxiv.org/abs/2005.02178>`_, AAAI 2021, Sec. 4 (Algorithm 1).
    """
    cov = jnp.asarray(cov)
    std = jnp.asarray(std)
    dtype = stats.stats_dtype(jnp.result_type(cov, std))
    cov, std = cov.astype(dtype), std.astype(dtype)
    outer = std[:, None] * std[None, :]  # [d, d]
    nonzero = outer > 0
    corr = jnp.where(nonzero, cov / jnp.where(nonzero, outer, 1.0), 0.0)
    corr = jnp.clip(corr, -1.0, 1.0)
    gamma = jnp.mean(corr**2, axis=1)  # [d]
    gain = (gamma * std + epsilon) ** (-beta)  # [d]
    var = jnp.diagonal(cov)  # [d]
    keep_total = jnp.sqrt(jnp.sum(var) / (jnp.sum(var * gain**2) + epsilon))
    return keep_total * gain


def _mean_var(
    x: jax.Array, mask: jax.Array | None, axis_name: str | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Masked per-feature mean and biased variance in float32, global over `axis_name`.

    Two passes (mean, then mean squared deviation) of sums and counts, so shards with different
    numbers of unmasked rows still give the statistics of the global batch.

    Args:
        x: `[..., d]` any float dtype.
        mask: broadcastable to `x.shape[:-1]`, 1 = keep; None keeps all.
        axis_name: mapped axis to reduce over (shard_map/pmap), or None.

    Returns:
        `(count [], mean [d], var [d])`, float32 (float64 for float64 input).
    """
    dtype = stats.stats_dtype(x.dtype)
    x = x.astype(dtype).reshape(-1, x.shape[-1])  # [n, d]
    if mask is None:
        w = jnp.ones(x.shape[:1], dtype)
    else:
        w = jnp.broadcast_to(jnp.asarray(mask), x.shape[:1]).astype(dtype)

    def total(a):
        return a if axis_name is None else lax.psum(a, axis_name)

    keep = w[:, None] > 0
    count = total(jnp.sum(w))
    denom = jnp.maximum(count, 1.0)
    mean = total(jnp.sum(jnp.where(keep, x * w[:, None], 0.0), axis=0)) / denom  # [d]
    dev = jnp.where(keep, x - mean, 0.0)  # [n, d]
    var = total(jnp.sum(w[:, None] * dev**2, axis=0)) / denom  # [d]
    return count, mean, var


def _running_mean_var(
    module: nn.Module,
    x: jax.Array,
    mask: jax.Array | None,
    use_running_average: bool,
    *,
    min_count: int,
    with_var: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`(x in float32, mean [d], var [d] or None)` of `Recenter` and `BatchNorm`.

    Training: the batch's masked mean and biased variance (`_mean_var`), and the running
    ``batch_stats['mean']`` (zeros) and ``['var']`` (ones, `with_var`) moved towards them by
    `running.ema` under the bad-batch guard (`min_count` unmasked rows). Evaluation: the
    running ones.
    """
    d = x.shape[-1]
    ra_mean = module.variable("batch_stats", "mean", jnp.zeros, (d,), STATS_DTYPE)
    ra_var = (
        module.variable("batch_stats", "var", jnp.ones, (d,), STATS_DTYPE) if with_var else None
    )
    counters = running.skip_counters(module)
    running.check_state_shape(module, "mean", ra_mean.value.shape, (d,), x.shape)
    x32 = x.astype(stats.stats_dtype(x.dtype))
    if use_running_average:
        return x32, ra_mean.value, ra_var.value if with_var else None
    initializing = module.is_initializing()
    count, mean, var = _mean_var(x32, mask, None if initializing else module.axis_name)
    if not initializing:
        pairs = [(ra_mean, mean)] + ([(ra_var, var)] if with_var else [])
        ok = running.batch_ok(count, *(new for _, new in pairs), min_count=min_count)
        moved = [
            (v, running.ema(module.momentum, v.value, lax.stop_gradient(new))) for v, new in pairs
        ]
        running.guarded_update(module, moved, counters, ok)
    return x32, mean, var if with_var else None


class IsoBN(nn.Module):
    r"""Isotropic batch normalisation: `x * stop_gradient(gain(S, s))` (SPEC.md §1).

    Running statistics in ``'batch_stats'`` (float32 whatever the input dtype):
    ``cov`` `[d, d]` (`S`), ``std`` `[d]` (`s`), ``count`` (updates applied) and ``skipped``
    (bad batches refused, see the module docstring of :mod:`isojax.norms`). All start at zero,
    as in the reference.

    Training (`use_running_average=False`), on a stop-gradient copy of the batch:
    `C_B = cov(X)` and `σ_B = sqrt(diag C_B)` (biased, divided by the number of unmasked rows),
    then `S ← m S + (1 − m) C_B`, `s ← m s + (1 − m) σ_B`, *before* the gain is computed, so the
    current batch already weighs in (reference behaviour). `momentum=0.95` is the reference's
    rate 0.05. With `use_running_average=True` the statistics are frozen but the gain is still
    applied: IsoBN always scales by its running state, never by the batch's. Before any update
    (`count == 0`) the gain is 1, where the reference returns NaN. With `debias=True` the
    running averages are divided by `1 − m^count` (Adam-style bias correction), since zero
    initialisation overstates correlations early; off by default for parity.

    The gain is stop-gradient, so `∂y/∂x = diag(gain)`: no gradient flows through statistics.

    Attributes:
        use_running_average: default for the call argument of the same name.
        momentum: decay `m` of the moving averages.
        beta: exponent `β` of the gain.
        epsilon: `ε` of the gain.
        debias: divide the running averages by `1 − m^count` before the gain.
        axis_name: mapped axis to reduce the batch statistics over (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.

    References:
        Zhou, Lin, Ren, `IsoBN: Fine-Tuning BERT with Isotropic Batch Normalization
        <https://arxiv.org/abs/2005.02178>`_, AAAI 2021, Sec. 4.
    """

    use_running_average: bool | None = None
    momentum: float = 0.95
    beta: float = 0.5
    epsilon: float = 1e-3
    debias: bool = False
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """Applies the gain.

        Args:
            x: `[batch, d]` (or `[..., d]`) embeddings, any float dtype.
            use_running_average: True freezes the statistics (evaluation).
            mask: `[batch]` 1 for real rows, 0 for padding rows left out of the statistics.

        Returns:
            `x * gain`, shape of `x`, dtype `self.dtype` or `x.dtype`.
        """
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        d = x.shape[-1]
        cov = self.variable("batch_stats", "cov", jnp.zeros, (d, d), STATS_DTYPE)
        std = self.variable("batch_stats", "std", jnp.zeros, (d,), STATS_DTYPE)
        counters = running.skip_counters(self)
        count = counters[0]
        running.check_state_shape(self, "cov", cov.value.shape, (d, d), x.shape)
        running.check_state_shape(self, "std", std.value.shape, (d,), x.shape)

        if not use_running_average and not self.is_initializing():
            batch = stats.batch_moments(lax.stop_gradient(x), mask, axis_name=self.axis_name)
            ok = running.batch_ok(batch.count, batch.cov, batch.std, min_count=2)
            running.guarded_update(
                self,
                [
                    (cov, running.ema(self.momentum, cov.value, batch.cov)),
                    (std, running.ema(self.momentum, std.value, batch.std)),
                ],
                counters,
                ok,
            )

        running_cov, running_std = cov.value, std.value
        if self.debias:
            correction = 1.0 - self.momentum ** count.value.astype(STATS_DTYPE)
            correction = jnp.where(count.value > 0, correction, 1.0)
            running_cov, running_std = running_cov / correction, running_std / correction
        gain = isobn_gain(running_cov, running_std, beta=self.beta, epsilon=self.epsilon)
        gain = lax.stop_gradient(jnp.where(count.value > 0, gain, jnp.ones_like(gain)))
        out_dtype = self.dtype or x.dtype
        y = x.astype(stats.stats_dtype(x.dtype)) * gain
        return y.astype(out_dtype)


class Recenter(nn.Module):
    """Subtracts a mean: the batch mean in training, the running mean in evaluation.

    SPEC.md §2 describes re-centring as "subtract the running mean". isojax keeps batch norm's
    convention instead, and this is the one behaviour: in training the *batch* mean is
    subtracted (so the gradient flows through it, as in batch normalisation, and the output
    is centred from the first step, before a zero-initialised running mean has warmed up);
    the running mean is what evaluation subtracts.

    Running mean ``batch_stats['mean']`` `[d]` float32 (zero-initialised), updated as Flax's
    `BatchNorm`: `mean ← m · mean + (1 − m) · batch_mean`; plus the ``count``/``skipped``
    counters. Gradients flow through the batch mean, as in batch normalisation.

    Attributes:
        use_running_average: default for the call argument.
        momentum: decay `m` of the running mean (Flax BatchNorm's default 0.99).
        axis_name: mapped axis to reduce over (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.

    References:
        Zhou, Du, Ren, `Improving BERT Fine-tuning with Embedding Normalization
        <https://arxiv.org/abs/1911.03918>`_, 2019 (non-zero-centred [CLS] embeddings).
    """

    use_running_average: bool | None = None
    momentum: float = 0.99
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` -> `x - mean`, dtype `self.dtype` or `x.dtype`; mask `[batch]`."""
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        x32, mean, _ = _running_mean_var(self, x, mask, use_running_average, min_count=1)
        return (x32 - mean).astype(self.dtype or x.dtype)


class BatchNorm(nn.Module):
    """Batch normalisation with `flax.linen.BatchNorm` semantics and the bad-batch guard.

    Same variables and maths as `nn.BatchNorm` over the feature axis -1: ``params`` ``scale``
    (ones) and ``bias`` (zeros); ``batch_stats`` ``mean`` (zeros) and ``var`` (ones), float32,
    `ra ← m · ra + (1 − m) · batch` after `init`; output
    `(x − mean) / sqrt(var + ε) · scale + bias`. It adds the ``count``/``skipped`` counters and
    refuses bad batches (see the module docstring), and it computes the variance in two passes
    (`nn.BatchNorm(use_fast_variance=False)`) from psum-ed sums and counts, so masked shards of
    unequal size still give the global statistics. The output dtype is `dtype` or the input's.

    References:
        Ioffe, Szegedy, `Batch Normalization <https://arxiv.org/abs/1502.03167>`_, ICML 2015.
    """

    use_running_average: bool | None = None
    momentum: float = 0.99
    epsilon: float = 1e-5
    use_bias: bool = True
    use_scale: bool = True
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    bias_init: Callable = nn.initializers.zeros
    scale_init: Callable = nn.initializers.ones

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` -> normalised `[batch, d]`; mask `[batch]` leaves rows out of stats."""
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        d = x.shape[-1]
        x32, mean, var = _running_mean_var(
            self, x, mask, use_running_average, min_count=2, with_var=True
        )
        y = (x32 - mean) * lax.rsqrt(var + self.epsilon)
        if self.use_scale:
            y = y * self.param("scale", self.scale_init, (d,), self.param_dtype)
        if self.use_bias:
            y = y + self.param("bias", self.bias_init, (d,), self.param_dtype)
        return y.astype(self.dtype or x.dtype)


class LayerNorm(nn.Module):
    """`flax.linen.LayerNorm` over the feature axis behind the common call signature.

    Per-example statistics (computed in float32 by Flax), so no ``batch_stats``;
    `use_running_average` and `mask` are accepted and ignored. Parameters ``scale`` and
    ``bias`` sit directly in this module's ``params``, as in `nn.LayerNorm`.

    References:
        Ba, Kiros, Hinton, `Layer Normalization <https://arxiv.org/abs/1607.06450>`_, 2016.
    """

    epsilon: float = 1e-6
    use_bias: bool = True
    use_scale: bool = True
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` -> layer-normalised `[batch, d]`, dtype `self.dtype` or `x.dtype`."""
        del use_running_average, mask  # per-example statistics: nothing runs or is masked
        x32 = x.astype(stats.stats_dtype(x.dtype))
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
        y = (x32 - mean) * lax.rsqrt(var + self.epsilon)
        d = x.shape[-1]
        if self.use_scale:
            y = y * self.param("scale", nn.initializers.ones, (d,), self.param_dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (d,), self.param_dtype)
        return y.astype(self.dtype or x.dtype)


class Identity(nn.Module):
    """The `none` normaliser: returns its input (cast to `dtype` when one is given)."""

    dtype: jax.typing.DTypeLike | None = None

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        del use_running_average, mask
        return x if self.dtype is None else x.astype(self.dtype)


# The registry: a normaliser's name (a `config.method`, `isojax finetune --method NAME`) -> its
# class. A new one is a module with the common call signature plus one line here
# (ARCHITECTURE.md, "Adding a normaliser").
_CLASSES = {
    "none": Identity,
    "recenter": Recenter,
    "batchnorm": BatchNorm,
    "layernorm": LayerNorm,
    "isobn": IsoBN,
}
NORMALIZERS = tuple(_CLASSES)


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {"parent"}


def check_hparams(name: str, **hparams) -> None:
    """Raises ValueError (one line) for an unknown normaliser, an unknown hyper-parameter of it,
    or a value out of range: momentum in (0, 1), beta >= 0, epsilon > 0."""
    if name not in _CLASSES:
        raise ValueError(f"unknown normalizer {name!r}; known: {', '.join(NORMALIZERS)}")
    unknown = sorted(set(hparams) - _fields(_CLASSES[name]))
    if unknown:
        raise ValueError(
            f"normalizer {name!r} has no hyper-parameter(s) {unknown}; "
            f"it takes {sorted(_fields(_CLASSES[name]))}"
        )
    momentum, beta = hparams.get("momentum", 0.5), hparams.get("beta", 0.0)
    if not 0.0 < momentum < 1.0:
        raise ValueError(f"momentum {momentum} not in (0, 1)")
    if beta < 0.0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if hparams.get("epsilon", 1.0) <= 0.0:
        raise ValueError(f"epsilon must be > 0, got {hparams['epsilon']}")


def make_normalizer(
    name: str,
    *,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
    axis_name: str | None = None,
    **hparams,
) -> nn.Module:
    """The sentence-embedding normaliser called `name`, as an unbound linen module.

    Every module returned has `__call__(x [batch, d], use_running_average, *, mask=None)
    -> [batch, d]` of dtype `dtype` (None: the input's), keeps its running statistics (if any)
    in ``'batch_stats'`` in float32, and ignores the arguments that do not apply to it
    (`param_dtype` where there are no parameters, `axis_name` where there are no batch
    statistics).

    Args:
        name: one of `NORMALIZERS`: `none`, `recenter`, `batchnorm`, `layernorm`, `isobn`.
        dtype: output dtype, None to keep the input's.
        param_dtype: dtype of learned parameters (batchnorm, layernorm).
        axis_name: mapped axis for batch statistics under shard_map/pmap.
        **hparams: fields of the chosen class, e.g. `momentum=0.95, beta=0.5` for `isobn`,
            `epsilon`, `debias`, or the module's `name`.

    Returns:
        The module.

    Raises:
        ValueError: unknown `name`, or a hyper-parameter the chosen class does not have.

    Example:
        >>> norm = make_normalizer("isobn", momentum=0.95)
        >>> x = jnp.ones((4, 3))
        >>> variables = norm.init(jax.random.key(0), x, use_running_average=True)
        >>> sorted(variables["batch_stats"])
        ['count', 'cov', 'skipped', 'std']
    """
    check_hparams(name, **hparams)
    fields = _fields(_CLASSES[name])
    common = {"dtype": dtype, "param_dtype": param_dtype, "axis_name": axis_name}
    kwargs = {k: v for k, v in common.items() if k in fields} | hparams
    return _CLASSES[name](**kwargs)
