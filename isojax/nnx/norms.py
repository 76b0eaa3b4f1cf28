"""The sentence-embedding transforms as native Flax NNX modules, over the maths of
`isojax.core.normalizers`.

IsoBN, ZCA whitening, iterative normalisation, batch norm, layer norm, re-centring and `none`
with the call signature of their linen twins in :mod:`isojax.linen.norms`,

    module(x [batch, d], use_running_average: bool | None = None, *, mask=None) -> [batch, d]

and NNX's conventions: the feature size and `rngs` at construction, `dtype`/`param_dtype`,
learned weights as `nnx.Param`, running statistics as float32 `nnx.BatchStat` attributes under
the linen names (``cov``, ``std``, ``mean``, ``var``, and the ``count``/``skipped`` counters of
:mod:`isojax.core.running`). The mode is the call argument, else the attribute (None by default, as
`nnx.BatchNorm`'s), which `.train()`, `.eval()` and `nnx.view(model, use_running_average=...)`
set (the `set_view` hook; a view that gives only `deterministic` sets it to that, as the head's
call does); with neither, the call raises and names the three ways.

Each call runs the same pure step of :mod:`isojax.core.normalizers` as the linen module (`isobn`,
`recenter`, `batch_norm`, `layer_norm`, `identity`) on the values of its Variables and
writes the new state back through them only (`Variable.set_value`), so graph mode, tree mode
(`nnx.set_graph_mode(False)`), `nnx.jit`, `nnx.remat` and `nnx.scan` all carry the update. A bad
batch leaves the statistics as they were and adds 1 to ``skipped``, as in linen (NNX has no
``intermediates['skipped_batch']``: compare ``skipped`` before and after). The hyper-parameters
and their defaults are `normalizers.HPARAMS`, checked by `normalizers.check_hparams` in every
constructor (`_configure`, one loop over the table's fields).
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.core import iternorm, normalizers, running, whitening

_ISOBN, _BN, _LN, _WHITEN, _ITERNORM = (
    normalizers.HPARAMS[name] for name in ("isobn", "batchnorm", "layernorm", "whiten", "iternorm")
)


def _mode_error(owner: str) -> str:
    return (
        f"{owner}: no use_running_average given; pass it to the call or the constructor, "
        "call model.train() / model.eval(), or use nnx.view(model, use_running_average=...)"
    )


def _configure(module: nnx.Module, name: str, arguments: dict) -> None:
    """A constructor's settings from its `locals()`: `normalizers.check_hparams` (as linen's
    `__post_init__` runs it) on normaliser `name`'s `HPARAMS` fields, then each of them and of
    its `STRUCTURAL` fields (`dtype`, `axis_name`, ...) an attribute of the same name, and
    `num_features`."""
    hparams = {field: arguments[field] for field in normalizers.HPARAMS[name]}
    normalizers.check_hparams(name, front="nnx", **hparams)
    module.num_features = arguments["num_features"]
    for field in (*hparams, *normalizers.STRUCTURAL[name]):
        setattr(module, field, arguments[field])


class RunningModule(nnx.Module):
    """A transform whose running state is float32 `nnx.BatchStat` attributes, moved by a pure
    step of :mod:`isojax.core.normalizers` or :mod:`isojax.core.istar`; `set_view` sets its mode."""

    use_running_average: bool | None
    axis_name: str | None

    def init_state(self, state: dict[str, jax.Array]) -> None:
        """Makes each entry of `state` a `BatchStat` attribute of the same name."""
        self.state_names = tuple(state)
        for name, value in state.items():
            setattr(self, name, nnx.BatchStat(value))

    def state_values(self) -> dict[str, jax.Array]:
        """The running state, by name (the dict the pure steps take)."""
        return {name: getattr(self, name).get_value() for name in self.state_names}

    def write_state(self, new: dict[str, jax.Array] | None) -> None:
        """Writes a step's new state (None: it did not move) through the Variables."""
        for name, value in (new or {}).items():
            getattr(self, name).set_value(value)

    def mode(self, use_running_average: bool | None) -> bool:
        """The call argument, else the attribute; raises when both are None."""
        for value in (use_running_average, self.use_running_average):
            if value is not None:
                return value
        raise ValueError(_mode_error(type(self).__name__))

    def check_input(self, init, x_shape: tuple) -> None:
        """`running.check_shapes` of the state against `init(d)` for the input's `d`."""
        want = jax.eval_shape(lambda: init(x_shape[-1]))
        running.check_shapes(type(self).__name__, self.state_values(), want, x_shape)

    def run(self, init, step, x, mask, use_running_average, **hparams) -> jax.Array:
        """One pure step on the state (`update` in training) with the new state written back."""
        train = not self.mode(use_running_average)
        self.check_input(init, x.shape)
        y, new, _ = step(
            self.state_values(),
            x,
            mask,
            train=train,
            update=train,
            axis_name=self.axis_name,
            **hparams,
        )
        self.write_state(new)
        return y

    def set_view(
        self, use_running_average: bool | None = None, deterministic: bool | None = None
    ) -> None:
        """The hook of `nnx.view`: sets the default mode when one is given, else follows
        `deterministic` as the head's call and linen's `apply(deterministic=...)` do, so that
        `nnx.view(model, deterministic=True)` also freezes the running statistics."""
        if use_running_average is None:
            use_running_average = deterministic
        if use_running_average is not None:
            self.use_running_average = use_running_average


def _affine(module: nnx.Module, d: int, rngs: nnx.Rngs | None, param_dtype, **inits) -> None:
    """``scale`` and ``bias`` `nnx.Param`s `[d]` (or None where unused), made by
    `normalizers.affine_params`; `rngs.params()` keys the initialisers (the defaults ignore it)."""
    key = rngs.params() if rngs is not None else None
    params = normalizers.affine_params(d, param_dtype=param_dtype, key=key, **inits)
    for name in ("scale", "bias"):
        value = nnx.Param(params[name]) if name in params else nnx.data(None)
        setattr(module, name, value)


def _affine_values(module: nnx.Module) -> dict[str, jax.Array]:
    return {
        name: getattr(module, name)[...]
        for name in ("scale", "bias")
        if getattr(module, name) is not None
    }


class IsoBN(RunningModule):
    r"""Isotropic batch normalisation, `x * stop_gradient(gain(S, s))` (SPEC.md §1), in NNX.

    The maths and the defaults of `isojax.linen.norms.IsoBN` (the pure step `normalizers.isobn`):
    running
    ``cov`` `[d, d]` and ``std`` `[d]` moved by the batch before the gain is computed in
    training, the gain still applied (frozen) in evaluation, gain 1 before the first update,
    optional debiasing by `1 − m^count`; `∂y/∂x = diag(gain)`.

    Args:
        num_features: `d`.
        use_running_average: default mode (None: set by `.train()`/`.eval()`/`nnx.view`).
        momentum, beta, epsilon, debias: as in `isojax.linen.norms.IsoBN`.
        axis_name: mapped axis of the batch statistics (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.
        rngs: accepted for a uniform signature; unused (no parameters).

    Example:
        >>> norm = IsoBN(8)
        >>> y = norm(jnp.ones((4, 8)), use_running_average=False)
        >>> int(norm.count[...])
        1
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        momentum: float = _ISOBN["momentum"],
        beta: float = _ISOBN["beta"],
        epsilon: float = _ISOBN["epsilon"],
        debias: bool = _ISOBN["debias"],
        axis_name: str | None = None,
        dtype: jax.typing.DTypeLike | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        _configure(self, "isobn", locals())
        self.init_state(normalizers.isobn_init(num_features))

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> `x * gain`, dtype `self.dtype` or `x.dtype`; mask `[batch]`."""
        hparams = {name: getattr(self, name) for name in _ISOBN}
        return self.run(
            normalizers.isobn_init,
            normalizers.isobn,
            x,
            mask,
            use_running_average,
            dtype=self.dtype,
            **hparams,
        )


class Whiten(RunningModule):
    r"""Running ZCA whitening, `(x − μ̂) W sqrt(τ)` with `W = Σ^(−1/2)` (SPEC.md §10.1), in NNX.

    The maths and defaults of `isojax.linen.norms.Whiten` (the pure step
    `isojax.core.whitening.whiten`): float32 `BatchStat`s ``mean`` `[d]`, ``cov`` `[d, d]`,
    ``count``, ``skipped``, moved by the batch before the transform in training; the transform
    from the debiased running state in training and evaluation alike, the identity before the
    first update; `∂y/∂x = W sqrt(τ)`. ``keep_scale`` keeps the total variance only for a
    near-isotropic input (0.09 of it with 99 % of the variance on one direction); see
    `docs/study/whitening.md` for what it does to fine-tuning.

    Args:
        num_features: `d`.
        use_running_average: default mode (None: set by `.train()`/`.eval()`/`nnx.view`).
        momentum, alpha, epsilon, keep_scale, group_size: as in `isojax.linen.norms.Whiten`.
        axis_name: mapped axis of the batch statistics (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.
        rngs: accepted for a uniform signature; unused (no parameters).

    Example:
        >>> norm = Whiten(8)
        >>> y = norm(jnp.arange(32.0).reshape(4, 8) % 5, use_running_average=False)
        >>> int(norm.count[...]), norm.cov[...].dtype
        (1, dtype('float32'))
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        momentum: float = _WHITEN["momentum"],
        alpha: float = _WHITEN["alpha"],
        epsilon: float = _WHITEN["epsilon"],
        keep_scale: bool = _WHITEN["keep_scale"],
        group_size: int | None = _WHITEN["group_size"],
        axis_name: str | None = None,
        dtype: jax.typing.DTypeLike | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        _configure(self, "whiten", locals())
        self.init_state(whitening.whiten_init(num_features))

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> whitened `[batch, d]`, dtype `self.dtype` or `x.dtype`; mask
        `[batch]`."""
        hparams = {name: getattr(self, name) for name in _WHITEN}
        return self.run(
            whitening.whiten_init,
            whitening.whiten,
            x,
            mask,
            use_running_average,
            dtype=self.dtype,
            **hparams,
        )


class IterNorm(RunningModule):
    r"""Iterative normalisation, whitening with the batch's own statistics (SPEC.md §10.3), in
    NNX.

    The maths and defaults of `isojax.linen.norms.IterNorm` (the pure step
    `isojax.core.iternorm.iternorm`): training whitens with the batch's masked statistics, the
    gradient flowing through them (unless ``stop_gradient``), and moves the float32
    `BatchStat`s ``mean`` `[d]` and ``wmat`` `[d / g, g, g]` (with ``count``, ``skipped``);
    evaluation computes `(x − mean) wmat`. The optional affine (``affine=True``) is a
    ``scale`` and ``bias`` `nnx.Param`; off by default.

    Args:
        num_features: `d`.
        use_running_average: default mode (None: set by `.train()`/`.eval()`/`nnx.view`).
        momentum, iterations, epsilon, group_size, stop_gradient, affine: as in
            `isojax.linen.norms.IterNorm`.
        axis_name: mapped axis of the batch statistics (shard_map/pmap only).
        dtype: output dtype; None keeps the input's.
        param_dtype: dtype of the affine parameters.
        rngs: keys the affine's initialisers (ones and zeros ignore it); may be None.

    Example:
        >>> norm = IterNorm(8, group_size=4)
        >>> y = norm(jnp.arange(32.0).reshape(4, 8) % 5, use_running_average=False)
        >>> int(norm.count[...]), norm.wmat[...].shape
        (1, (2, 4, 4))
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        momentum: float = _ITERNORM["momentum"],
        iterations: int = _ITERNORM["iterations"],
        epsilon: float = _ITERNORM["epsilon"],
        group_size: int | None = _ITERNORM["group_size"],
        stop_gradient: bool = _ITERNORM["stop_gradient"],
        affine: bool = _ITERNORM["affine"],
        axis_name: str | None = None,
        dtype: jax.typing.DTypeLike | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        _configure(self, "iternorm", locals())
        inits = {"scale_init": nnx.initializers.ones, "bias_init": nnx.initializers.zeros}
        _affine(self, num_features, rngs, param_dtype, use_scale=affine, use_bias=affine, **inits)
        self.init_state(iternorm.iternorm_init(num_features, group_size=group_size))

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> whitened `[batch, d]`, dtype `self.dtype` or `x.dtype`; mask
        `[batch]`."""
        hparams = {name: getattr(self, name) for name in _ITERNORM if name != "affine"}
        init = functools.partial(iternorm.iternorm_init, group_size=self.group_size)
        return self.run(
            init, iternorm.iternorm, x, mask, use_running_average,
            params=_affine_values(self), dtype=self.dtype, **hparams,
        )  # fmt: skip


class Recenter(RunningModule):
    """`x − mean` in NNX: the batch mean in training, the running mean in evaluation, as
    `isojax.linen.norms.Recenter` (the pure step `normalizers.recenter`); running ``mean`` `[d]`.

    Args: `num_features`, `use_running_average`, `momentum`, `axis_name`, `dtype`, `rngs`
    (unused), as for `IsoBN`.
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        momentum: float = normalizers.HPARAMS["recenter"]["momentum"],
        axis_name: str | None = None,
        dtype: jax.typing.DTypeLike | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        _configure(self, "recenter", locals())
        self.init_state(normalizers.mean_var_init(num_features, with_var=False))

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> `x − mean`, dtype `self.dtype` or `x.dtype`; mask `[batch]`."""
        init = functools.partial(normalizers.mean_var_init, with_var=False)
        hparams = {"momentum": self.momentum, "dtype": self.dtype}
        return self.run(init, normalizers.recenter, x, mask, use_running_average, **hparams)


class BatchNorm(RunningModule):
    """Batch normalisation with the bad-batch guard in NNX, as `isojax.linen.norms.BatchNorm` (the
    pure step `normalizers.batch_norm`): ``scale``/``bias`` `nnx.Param`s, running ``mean``/``var``
    `BatchStat`s, two-pass masked statistics.

    Args: `num_features`, `use_running_average`, `momentum`, `epsilon`, `use_bias`,
    `use_scale`, `bias_init`, `scale_init`, `axis_name`, `dtype`, `param_dtype`, and `rngs`
    (keys the initialisers; the default ones and zeros ignore it, so it may be None).
    """

    def __init__(
        self,
        num_features: int,
        *,
        use_running_average: bool | None = None,
        momentum: float = _BN["momentum"],
        epsilon: float = _BN["epsilon"],
        use_bias: bool = _BN["use_bias"],
        use_scale: bool = _BN["use_scale"],
        bias_init=_BN["bias_init"],
        scale_init=_BN["scale_init"],
        axis_name: str | None = None,
        dtype: jax.typing.DTypeLike | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        _configure(self, "batchnorm", locals())
        used = {"use_scale": use_scale, "use_bias": use_bias}
        inits = {"scale_init": scale_init, "bias_init": bias_init}
        _affine(self, num_features, rngs, param_dtype, **used, **inits)
        self.init_state(normalizers.mean_var_init(num_features, with_var=True))

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> normalised `[batch, d]`; mask `[batch]` leaves rows out of stats."""
        init = functools.partial(normalizers.mean_var_init, with_var=True)
        hparams = {"momentum": self.momentum, "epsilon": self.epsilon, "dtype": self.dtype}
        return self.run(
            init, normalizers.batch_norm, x, mask, use_running_average,
            params=_affine_values(self), **hparams,
        )  # fmt: skip


class Stateless(nnx.Module):
    """A transform without running state: its `set_view` accepts the mode and ignores it, so
    `nnx.view(model, use_running_average=...)` reaches a model holding only these."""

    def set_view(
        self, use_running_average: bool | None = None, deterministic: bool | None = None
    ) -> None:
        """The hook of `nnx.view`; nothing to set."""
        del use_running_average, deterministic


class LayerNorm(Stateless):
    """Layer normalisation over the feature axis in float32 (the pure `normalizers.layer_norm`), as
    `isojax.linen.norms.LayerNorm`: ``scale``/``bias`` `nnx.Param`s, no running state;
    `use_running_average` and `mask` are accepted and ignored.

    Args: `num_features`, `epsilon`, `use_bias`, `use_scale`, `dtype`, `param_dtype`, `rngs`
    (as for `BatchNorm`).
    """

    def __init__(
        self,
        num_features: int,
        *,
        epsilon: float = _LN["epsilon"],
        use_bias: bool = _LN["use_bias"],
        use_scale: bool = _LN["use_scale"],
        dtype: jax.typing.DTypeLike | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None = None,
    ):
        _configure(self, "layernorm", locals())
        used = {"use_scale": use_scale, "use_bias": use_bias}
        inits = {"scale_init": nnx.initializers.ones, "bias_init": nnx.initializers.zeros}
        _affine(self, num_features, rngs, param_dtype, **used, **inits)

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        """`[batch, d]` -> layer-normalised `[batch, d]`, dtype `self.dtype` or `x.dtype`."""
        del use_running_average, mask  # per-example statistics: nothing runs or is masked
        return normalizers.layer_norm(
            _affine_values(self), x, epsilon=self.epsilon, dtype=self.dtype
        )


class Identity(Stateless):
    """The `none` normaliser in NNX: `x`, cast to `dtype` when one is given."""

    def __init__(
        self,
        num_features: int,
        *,
        dtype: jax.typing.DTypeLike | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        _configure(self, "none", locals())

    def __call__(self, x, use_running_average: bool | None = None, *, mask=None) -> jax.Array:
        del use_running_average, mask
        return normalizers.identity(x, self.dtype)


# The NNX registry, over the names of `isojax.core.normalizers.NORMALIZERS`.
CLASSES = {
    "none": Identity,
    "recenter": Recenter,
    "batchnorm": BatchNorm,
    "layernorm": LayerNorm,
    "isobn": IsoBN,
    "whiten": Whiten,
    "iternorm": IterNorm,
}
assert tuple(CLASSES) == normalizers.NORMALIZERS  # one registry, as linen's


def make_normalizer(
    name: str,
    num_features: int,
    /,
    *,
    rngs: nnx.Rngs | None = None,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
    axis_name: str | None = None,
    **hparams,
) -> nnx.Module:
    """The NNX normaliser called `name` over `num_features`: the twin of
    `isojax.linen.norms.make_normalizer`, over the same names (`normalizers.NORMALIZERS`) and
    table (`normalizers.HPARAMS`). It only dispatches: the names it is given are checked
    (`normalizers.check_names`), their values by the class's constructor (`check_hparams`).

    Args:
        name: `none`, `recenter`, `batchnorm`, `layernorm`, `isobn`, `whiten` or `iternorm`.
        num_features: `d`.
        rngs: keys the parameter initialisers (batchnorm, layernorm); may be None.
        dtype, param_dtype, axis_name: as in linen; ignored where they do not apply.
        **hparams: the normaliser's `HPARAMS` or `STRUCTURAL` entries (e.g. `momentum`,
            `use_running_average`).

    Raises:
        ValueError: unknown `name`, a hyper-parameter it does not take, a value out of range.

    Example:
        >>> norm = make_normalizer("isobn", 8, momentum=0.9)
        >>> norm.eval()
        >>> norm(jnp.ones((4, 8))).shape
        (4, 8)
    """
    normalizers.check_names(name, hparams, front="nnx")
    common = {"dtype": dtype, "param_dtype": param_dtype, "axis_name": axis_name}
    kwargs = {k: v for k, v in common.items() if k in normalizers.STRUCTURAL[name]} | hparams
    return CLASSES[name](num_features, rngs=rngs, **kwargs)
