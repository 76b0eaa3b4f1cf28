"""Sentence-embedding transforms: IsoBN, ZCA whitening, iterative normalisation, re-centring,
batch and layer norm.

Every transform here is a thin linen module over the pure functions of `isojax.core.normalizers`
(which `isojax.nnx.norms` runs too), and every module has the same call signature,

    module(x [batch, d], use_running_average: bool, *, mask=None) -> [batch, d], x.dtype

so a model picks one by name with :func:`make_normalizer` (`none`, `recenter`, `batchnorm`,
`layernorm`, `isobn`, `whiten`, `iternorm`). Running statistics live in the ``'batch_stats'``
collection, always in float32, so `mutable=['batch_stats']`, train states and checkpoints treat
them as Flax treats `nn.BatchNorm`.

Bad batches. A training batch whose statistics are not finite (NaN or Inf in the input, or a
float16 overflow upstream) or that holds too few points (fewer than 2 for IsoBN, whitening,
iterative normalisation and batch norm, fewer than 1 for re-centring, counting only unmasked
rows) leaves the running statistics exactly as they were. The module then adds 1 to
``batch_stats['skipped']`` and sows ``intermediates['skipped_batch'] = True`` (a bool scalar;
read it with ``mutable=['batch_stats', 'intermediates']``). It never raises inside `jit`; the
output of such a batch is still computed (from the running state for IsoBN, and for iterative
normalisation, which then falls back to its evaluation output), so NaN input gives NaN output.

Sharding. Under `jax.jit` with the batch sharded over a mesh the batch statistics are already
those of the global batch (XLA inserts the reductions). Under `shard_map`/`pmap` pass
`axis_name` and the modules reduce over it.
"""

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.core import iternorm, normalizers, whitening
from isojax.core.normalizers import NORMALIZERS
from isojax.linen import running as linen_running

# ----------------------------------------------------------------------------------------------
# The linen front end.
# ----------------------------------------------------------------------------------------------


def _linen_params(module: nn.Module, d: int, use_scale: bool, use_bias: bool) -> dict:
    """``scale`` (ones) and ``bias`` (zeros) in `module`'s ``params``, where they are used."""
    inits = {
        "scale": getattr(module, "scale_init", nn.initializers.ones),
        "bias": getattr(module, "bias_init", nn.initializers.zeros),
    }
    used = {"scale": use_scale, "bias": use_bias}
    return {
        name: module.param(name, init, (d,), module.param_dtype)
        for name, init in inits.items()
        if used[name]
    }


_ISOBN, _BN, _LN, _WHITEN, _ITERNORM = (
    normalizers.HPARAMS[name] for name in ("isobn", "batchnorm", "layernorm", "whiten", "iternorm")
)


def _checked(name: str):
    """A `__post_init__` running `normalizers.check_hparams` on the module's `HPARAMS` fields
    (as NNX's constructors do): a bad value is refused where the module is built."""

    def __post_init__(self):
        normalizers.check_hparams(name, **{k: getattr(self, k) for k in normalizers.HPARAMS[name]})
        nn.Module.__post_init__(self)

    return __post_init__


class IsoBN(nn.Module):
    r"""Isotropic batch normalisation: `x * stop_gradient(gain(S, s))` (SPEC.md §1).

    Running statistics in ``'batch_stats'`` (float32 whatever the input dtype):
    ``cov`` `[d, d]` (`S`), ``std`` `[d]` (`s`), ``count`` (updates applied) and ``skipped``
    (bad batches refused, see the module docstring of :mod:`isojax.linen.norms`). All start at zero,
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
    The maths is the pure step `isobn` (`isobn_update`, `isobn_running_gain`), which
    `isojax.nnx.IsoBN` runs too.

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
    momentum: float = _ISOBN["momentum"]
    beta: float = _ISOBN["beta"]
    epsilon: float = _ISOBN["epsilon"]
    debias: bool = _ISOBN["debias"]
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    __post_init__ = _checked("isobn")

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
        hparams = {k: getattr(self, k) for k in (*_ISOBN, "dtype")}
        step = (normalizers.isobn_init, normalizers.isobn)
        return linen_running.linen_step(self, *step, x, mask, use_running_average, **hparams)


class Whiten(nn.Module):
    r"""Running ZCA whitening, `(x − μ̂) W sqrt(τ)` with `W = Σ^(−1/2)` (SPEC.md §10.1).

    .. math::
        \Sigma = (1-\alpha)\hat S + (\alpha\tau + \epsilon) I,\qquad
        \tau = \operatorname{tr}\hat S / d,\qquad
        \hat\mu, \hat S = \frac{\mu,\ S}{1 - m^t}

    Running statistics in ``'batch_stats'`` (float32 whatever the input dtype): ``mean`` `[d]`,
    ``cov`` `[d, d]` (the full covariance whatever ``group_size``), ``count`` (`t`) and
    ``skipped``, all zero at start. Training (`use_running_average=False`) moves them towards
    the batch's biased moments (stop-gradient copy, masked rows left out) *before* the
    transform, as IsoBN; the transform always comes from the debiased running state, in
    training and evaluation alike, and is the identity before the first update. `μ̂`, `W` and
    `τ` are stop-gradient: `∂y/∂x = W sqrt(τ)`. A bad batch (non-finite, fewer than 2 unmasked
    rows) is skipped and counted (see the module docstring). The maths is the pure step
    `isojax.core.whitening.whiten`, which `isojax.nnx.Whiten` runs too. The study reverses it
    (`docs/study/whitening.md`); `IterNorm` is whitening as the literature trains it.

    Attributes:
        use_running_average: default for the call argument of the same name.
        momentum: decay `m` of the moving averages (0.99).
        alpha: shrinkage `α` towards `τ I` (0.1); keeps the condition number below ~`d / α`.
        epsilon: `ε` added to the diagonal (1e-5).
        keep_scale: multiply by `sqrt(τ)`, so the output covariance is about `τ I`; the total
            variance stays the input's only for a near-isotropic input (0.99 of it), not
            under a collapse (0.51 with 90 % of the variance on one direction, 0.09 with 99 %).
        group_size: None whitens all `d` features together; `g` (dividing `d`) whitens
            consecutive groups of `g` features (block-diagonal `W`, [DBN]'s groups).
        axis_name: mapped axis to reduce the batch statistics over (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.

    References:
        Huang et al., `Decorrelated Batch Normalization <https://arxiv.org/abs/1804.08450>`_,
        CVPR 2018; Huang et al., `Iterative Normalization <https://arxiv.org/abs/1904.03441>`_,
        CVPR 2019.
    """

    use_running_average: bool | None = None
    momentum: float = _WHITEN["momentum"]
    alpha: float = _WHITEN["alpha"]
    epsilon: float = _WHITEN["epsilon"]
    keep_scale: bool = _WHITEN["keep_scale"]
    group_size: int | None = _WHITEN["group_size"]
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    __post_init__ = _checked("whiten")

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` (or `[..., d]`) -> whitened, shape of `x`, dtype `self.dtype` or
        `x.dtype`; mask `[batch]` leaves padding rows out of the statistics."""
        hparams = {k: getattr(self, k) for k in (*_WHITEN, "dtype")}
        step = (whitening.whiten_init, whitening.whiten)
        return linen_running.linen_step(self, *step, x, mask, use_running_average, **hparams)


class IterNorm(nn.Module):
    r"""Iterative normalisation: whitening with the batch's own statistics (SPEC.md §10.3).

    .. math::
        \Sigma = \epsilon I + X_c^\top X_c / m,\quad P_{k+1} = \tfrac32 P_k
        - \tfrac12 P_k^3 \Sigma / \operatorname{tr}\Sigma,\quad
        y = X_c\, P_T / \sqrt{\operatorname{tr}\Sigma}

    per group of ``group_size`` consecutive features. Training (`use_running_average=False`)
    whitens with the batch's masked statistics (float32), the gradient flowing through the
    mean, the covariance and every Newton–Schulz step (``stop_gradient=True``: the same output,
    the statistics detached), and moves the running ``mean`` `[d]` and ``wmat``
    `[d / g, g, g]` in ``'batch_stats'`` by ``momentum`` (PyTorch's convention: the batch's
    weight); evaluation computes `(x − mean) wmat`. A bad batch (non-finite, fewer than 2
    unmasked rows) is skipped and counted (see the module docstring) and gets the evaluation
    output. The maths is the pure step `isojax.core.iternorm.iternorm`, which
    `isojax.nnx.IterNorm` runs too; `docs/study/whitening.md` measures why it trains where
    `Whiten` does not.

    Attributes:
        use_running_average: default for the call argument of the same name.
        momentum: `ρ`, the batch's weight in the running averages (0.1).
        iterations: `T`, Newton–Schulz steps, 0 to 6 (5: a partial whitening; 0: `I/sqrt(tr Σ)`).
        epsilon: `ε` added to the covariance's diagonal (1e-5).
        group_size: None whitens all `d` features together; `g` (dividing `d`) whitens
            consecutive groups of `g` features (block-diagonal `W`).
        stop_gradient: detach the batch's mean and whitening matrix (same forward).
        affine: a learned per-feature ``scale`` (ones) and ``bias`` (zeros) after the
            whitening; off by default, since the classifier head's Dense layer follows.
        axis_name: mapped axis to reduce the batch statistics over (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.
        param_dtype: dtype of the affine parameters.

    References:
        Huang et al., `Iterative Normalization <https://arxiv.org/abs/1904.03441>`_, CVPR 2019.
    """

    use_running_average: bool | None = None
    momentum: float = _ITERNORM["momentum"]
    iterations: int = _ITERNORM["iterations"]
    epsilon: float = _ITERNORM["epsilon"]
    group_size: int | None = _ITERNORM["group_size"]
    stop_gradient: bool = _ITERNORM["stop_gradient"]
    affine: bool = _ITERNORM["affine"]
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    __post_init__ = _checked("iternorm")

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` (or `[..., d]`) -> whitened, shape of `x`, dtype `self.dtype` or
        `x.dtype`; mask `[batch]` leaves padding rows out of the statistics."""
        params = _linen_params(self, x.shape[-1], self.affine, self.affine)
        init = functools.partial(iternorm.iternorm_init, group_size=self.group_size)
        hparams = {k: getattr(self, k) for k in (*_ITERNORM, "dtype") if k != "affine"}
        return linen_running.linen_step(
            self, init, iternorm.iternorm, x, mask, use_running_average, params=params, **hparams
        )


class Recenter(nn.Module):
    """Subtracts a mean: the batch mean in training, the running mean in evaluation.

    SPEC.md §2 describes re-centring as "subtract the running mean". isojax keeps batch norm's
    convention instead, and this is the one behaviour: in training the *batch* mean is
    subtracted (so the gradient flows through it, as in batch normalisation, and the output
    is centred from the first step, before a zero-initialised running mean has warmed up);
    the running mean is what evaluation subtracts.

    Running mean ``batch_stats['mean']`` `[d]` float32 (zero-initialised), updated as Flax's
    `BatchNorm`: `mean ← m · mean + (1 − m) · batch_mean`; plus the ``count``/``skipped``
    counters. Gradients flow through the batch mean, as in batch normalisation. The maths is
    the pure step `recenter`.

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
    momentum: float = normalizers.HPARAMS["recenter"]["momentum"]
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    __post_init__ = _checked("recenter")

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` -> `x - mean`, dtype `self.dtype` or `x.dtype`; mask `[batch]`."""
        init = functools.partial(normalizers.mean_var_init, with_var=False)
        hparams = {"momentum": self.momentum, "dtype": self.dtype}
        return linen_running.linen_step(
            self, init, normalizers.recenter, x, mask, use_running_average, **hparams
        )


class BatchNorm(nn.Module):
    """Batch normalisation with `flax.linen.BatchNorm` semantics and the bad-batch guard.

    Same variables and maths as `nn.BatchNorm` over the feature axis -1: ``params`` ``scale``
    (ones) and ``bias`` (zeros); ``batch_stats`` ``mean`` (zeros) and ``var`` (ones), float32,
    `ra ← m · ra + (1 − m) · batch` after `init`; output
    `(x − mean) / sqrt(var + ε) · scale + bias`. It adds the ``count``/``skipped`` counters and
    refuses bad batches (see the module docstring), and it computes the variance in two passes
    (`nn.BatchNorm(use_fast_variance=False)`) from psum-ed sums and counts, so masked shards of
    unequal size still give the global statistics. The output dtype is `dtype` or the input's.
    The maths is the pure step `batch_norm`.

    References:
        Ioffe, Szegedy, `Batch Normalization <https://arxiv.org/abs/1502.03167>`_, ICML 2015.
    """

    use_running_average: bool | None = None
    momentum: float = _BN["momentum"]
    epsilon: float = _BN["epsilon"]
    use_bias: bool = _BN["use_bias"]
    use_scale: bool = _BN["use_scale"]
    axis_name: str | None = None
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    bias_init: Callable = _BN["bias_init"]
    scale_init: Callable = _BN["scale_init"]
    __post_init__ = _checked("batchnorm")

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        """`[batch, d]` -> normalised `[batch, d]`; mask `[batch]` leaves rows out of stats."""
        params = _linen_params(self, x.shape[-1], self.use_scale, self.use_bias)
        init = functools.partial(normalizers.mean_var_init, with_var=True)
        hparams = {"momentum": self.momentum, "epsilon": self.epsilon, "dtype": self.dtype}
        step = (init, normalizers.batch_norm)
        return linen_running.linen_step(
            self, *step, x, mask, use_running_average, params=params, **hparams
        )


class LayerNorm(nn.Module):
    """`flax.linen.LayerNorm` over the feature axis behind the common call signature.

    Per-example statistics in float32 (the pure `layer_norm`), so no ``batch_stats``;
    `use_running_average` and `mask` are accepted and ignored. Parameters ``scale`` and
    ``bias`` sit directly in this module's ``params``, as in `nn.LayerNorm`.

    References:
        Ba, Kiros, Hinton, `Layer Normalization <https://arxiv.org/abs/1607.06450>`_, 2016.
    """

    epsilon: float = _LN["epsilon"]
    use_bias: bool = _LN["use_bias"]
    use_scale: bool = _LN["use_scale"]
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    __post_init__ = _checked("layernorm")

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
        params = _linen_params(self, x.shape[-1], self.use_scale, self.use_bias)
        return normalizers.layer_norm(params, x, epsilon=self.epsilon, dtype=self.dtype)


class Identity(nn.Module):
    """The `none` normaliser: returns its input (cast to `dtype` when one is given)."""

    dtype: jax.typing.DTypeLike | None = None
    __post_init__ = _checked("none")

    def __call__(
        self,
        x: jax.Array,
        use_running_average: bool | None = None,
        *,
        mask: jax.Array | None = None,
    ) -> jax.Array:
        del use_running_average, mask
        return normalizers.identity(x, self.dtype)


# The registry: a normaliser's name (`config.normalizer`, `isojax finetune --normalizer NAME`)
# -> its class. A new one is a module with the common call signature, a line here and its entries in
# `HPARAMS` and `STRUCTURAL` (ARCHITECTURE.md, "Adding a normaliser").
CLASSES = {
    "none": Identity,
    "recenter": Recenter,
    "batchnorm": BatchNorm,
    "layernorm": LayerNorm,
    "isobn": IsoBN,
    "whiten": Whiten,
    "iternorm": IterNorm,
}
assert tuple(CLASSES) == NORMALIZERS  # one registry: the names of `isojax.core.normalizers`


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - {"parent"}


def make_normalizer(
    name: str,
    /,
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
    statistics). `isojax.nnx.make_normalizer` is its NNX twin over the same names and table.

    Args:
        name: one of `NORMALIZERS`: `none`, `recenter`, `batchnorm`, `layernorm`, `isobn`,
            `whiten`, `iternorm`.
        dtype: output dtype, None to keep the input's.
        param_dtype: dtype of learned parameters (batchnorm, layernorm, iternorm's affine).
        axis_name: mapped axis for batch statistics under shard_map/pmap.
        **hparams: the chosen normaliser's `HPARAMS` (e.g. `momentum=0.95, beta=0.5` for
            `isobn`, `epsilon`, `debias`) or `STRUCTURAL` entries, or the module's `name`.

    Returns:
        The module.

    Raises:
        ValueError: unknown `name`, a hyper-parameter the chosen class does not have
            (`normalizers.check_names`: all it checks before it dispatches), or a value out
            of range (the class's own `__post_init__`, `normalizers.check_hparams`).

    Example:
        >>> norm = make_normalizer("isobn", momentum=0.95)
        >>> x = jnp.ones((4, 3))
        >>> variables = norm.init(jax.random.key(0), x, use_running_average=True)
        >>> sorted(variables["batch_stats"])
        ['count', 'cov', 'skipped', 'std']
    """
    normalizers.check_names(name, hparams)
    fields = _fields(CLASSES[name])
    common = {"dtype": dtype, "param_dtype": param_dtype, "axis_name": axis_name}
    kwargs = {k: v for k, v in common.items() if k in fields} | hparams
    return CLASSES[name](**kwargs)
