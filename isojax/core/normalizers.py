"""The maths of the sentence-embedding transforms, once: pure functions of arrays and state dicts.

`isojax.linen.norms` (linen) and `isojax.nnx.norms` (Flax NNX) are thin front ends over this file:
each reads its running statistics into a dict, calls a step here and writes the new state back.
A step is `(state, x, mask, *, train, update, axis_name, ...) -> (y, new state or None, ok or
None)`: `train` picks batch or running statistics, `update` whether the running state moves
(linen's `init` computes a training output but leaves the state as it is). Running state is
float32 (`running.STATS_DTYPE`) with the `count`/`skipped` counters and the bad-batch guard of
:mod:`isojax.core.running`. `HPARAMS` and `STRUCTURAL` are the one table of every normaliser's
hyper-parameters and defaults, read by both front ends' classes and by `check_hparams`;
`MIN_ROWS` its fewest training rows.
"""

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from isojax.core import running, stats
from isojax.core.running import STATS_DTYPE


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


# ----------------------------------------------------------------------------------------------
# The hyper-parameter table both front ends read: a normaliser's name -> its maths'
# hyper-parameters and their defaults. The linen classes of `isojax.linen.norms` and the NNX classes
# of `isojax.nnx.norms` take their defaults from it, and `check_hparams` refuses anything else.
# ----------------------------------------------------------------------------------------------

HPARAMS: dict[str, dict[str, Any]] = {
    "none": {},
    "recenter": {"momentum": 0.99},
    "batchnorm": {
        "momentum": 0.99,
        "epsilon": 1e-5,
        "use_bias": True,
        "use_scale": True,
        "bias_init": jax.nn.initializers.zeros,
        "scale_init": jax.nn.initializers.ones,
    },
    "layernorm": {"epsilon": 1e-6, "use_bias": True, "use_scale": True},
    "isobn": {"momentum": 0.95, "beta": 0.5, "epsilon": 1e-3, "debias": False},
    # SPEC.md §10.1; the step is `isojax.core.whitening.whiten`.
    "whiten": {
        "momentum": 0.99,
        "alpha": 0.1,
        "epsilon": 1e-5,
        "keep_scale": True,
        "group_size": None,
    },
    # SPEC.md §10.3; the step is `isojax.core.iternorm.iternorm`. The reference's defaults:
    # momentum 0.1 in PyTorch's convention (the weight of the batch), T = 5 steps, one group.
    "iternorm": {
        "momentum": 0.1,
        "iterations": 5,
        "epsilon": 1e-5,
        "group_size": None,
        "stop_gradient": False,
        "affine": False,
    },
}
# The arguments each normaliser takes besides its maths, in either front end; linen adds the
# module's `name`.
STRUCTURAL: dict[str, tuple[str, ...]] = {
    "none": ("dtype",),
    "recenter": ("use_running_average", "axis_name", "dtype"),
    "batchnorm": ("use_running_average", "axis_name", "dtype", "param_dtype"),
    "layernorm": ("dtype", "param_dtype"),
    "isobn": ("use_running_average", "axis_name", "dtype"),
    "whiten": ("use_running_average", "axis_name", "dtype"),
    "iternorm": ("use_running_average", "axis_name", "dtype", "param_dtype"),
}
# The fewest rows of a training batch (a micro-batch under accumulation) whose statistics a
# normaliser can use: batch norm's and IsoBN's variance and re-centring's mean of one row make the
# output a constant (`x - x`) and leave the running statistics still. The config refuses a
# micro-batch below it (`training.config.validate_config`); the bad-batch guards of `isobn_update`
# and `batch_norm` read it.
MIN_ROWS: dict[str, int] = {
    "none": 1, "recenter": 2, "batchnorm": 2, "layernorm": 1, "isobn": 2, "whiten": 2,
    "iternorm": 2,
}  # fmt: skip
NORMALIZERS = tuple(HPARAMS)
# The smallest shrinkage `alpha` of ``whiten`` that its rule accepts.
MIN_ALPHA = 0.0
# The most Newton-Schulz steps of ``iternorm`` (SPEC.md §10.3: 5): `core/iternorm.py` says why.
MAX_ITERATIONS = 6
_FRONT_END_ONLY = {"linen": ("name",), "nnx": ()}  # "config": the maths' own, no STRUCTURAL


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one hyper-parameter takes: `kind` (`float`: a finite real number, an int too;
    `int`: an integer; `bool`; `callable`; a bool is never a number), whether None is allowed,
    the range `checks` (pairs of a test and its message, formatted with `name`, `value` and
    `MIN_ALPHA`), whether the value must divide the width `d` of the normaliser's input
    (`check_width`), and `typed_by_range`: a value of the wrong type gets the first check's
    message (an integer's: "must be an integer >= 0")."""

    kind: Any
    checks: tuple[tuple[Callable[[Any], bool], str], ...] = ()
    nullable: bool = False
    divides_width: bool = False
    typed_by_range: bool = False


def _f32_away_from_1(v) -> bool:
    return np.float32(v) != 1.0 and np.float32(1.0 - v) != 1.0


_F32_MAX = float(np.finfo(np.float32).max)
_FLAG = Rule(bool)
_EPSILON = Rule(
    float, ((lambda v: np.float32(v) > 0, "{name} must be > 0 in float32, got {value}"),)
)
_ITERATIONS = Rule(int, (
    (lambda v: v >= 0, "{name} must be an integer in [0, {MAX_ITERATIONS}], got {value!r}"),
    (lambda v: v <= MAX_ITERATIONS, "{name} {value} > {MAX_ITERATIONS}: more float32 "
     "Newton-Schulz steps amplify rounding in the batch covariance's near-null directions"),
), typed_by_range=True)  # fmt: skip
# The hyper-parameters by name: every normaliser taking a `momentum` reads it the same way. A
# name not here is typed by its `HPARAMS` default (a bool, an int, a float, a callable), so a new
# normaliser's row is type-checked as it is written (`schema`); a None default needs a rule here.
RULES: dict[str, Rule] = {
    # The running averages are float32: neither m nor 1 - m may round to 1 there.
    "momentum": Rule(float, (
        (lambda v: 0.0 < v < 1.0, "{name} {value} not in (0, 1)"),
        (_f32_away_from_1, "{name} {value} rounds to 1 or 0 in float32"),
    )),
    "beta": Rule(float, ((lambda v: v >= 0.0, "{name} must be >= 0, got {value}"),)),
    "epsilon": _EPSILON,
    "eps": _EPSILON,
    "alpha": Rule(float, ((
        lambda v: MIN_ALPHA <= v <= 1.0,
        "{name} {value} not in [{MIN_ALPHA:g}, 1] (below {MIN_ALPHA:g} the float32 whitening "
        "matrix misses SPEC.md's 1e-4 bound)",
    ),)),
    "group_size": Rule(
        int,
        ((lambda v: v >= 1, "{name} must be a positive integer or None, got {value!r}"),),
        nullable=True,
        divides_width=True,
        typed_by_range=True,
    ),
    "iterations": _ITERATIONS,
    "T": _ITERATIONS,
    **{flag: _FLAG for flag in
       ("debias", "keep_scale", "stop_gradient", "affine", "use_bias", "use_scale")},
}  # fmt: skip
_KIND_NAMES = {float: "a number finite in float32", int: "an integer", bool: "True or False"}


def _rule(field: str, default: Any) -> Rule:
    if field in RULES:
        return RULES[field]
    for kind in (bool, int, float):  # bool first: a bool is an int
        if isinstance(default, kind):
            return Rule(kind)
    if callable(default):
        return Rule(callable)
    raise TypeError(f"hyper-parameter {field!r} (default {default!r}) needs a Rule in RULES")


def schema(name: str) -> dict[str, Rule]:
    """The typed schema of normaliser `name`, read from its `HPARAMS` row: field -> `Rule`
    (`RULES` by the field's name, else the type of its default). TypeError for a None default
    with no rule (a row that cannot be checked)."""
    return {field: _rule(field, default) for field, default in HPARAMS[name].items()}


def _typed(rule: Rule, value: Any) -> bool:
    if rule.kind is bool:
        return isinstance(value, bool | np.bool_)
    if isinstance(value, bool | np.bool_):
        return False
    if rule.kind is int:
        return isinstance(value, numbers.Integral)
    if rule.kind is float:  # the maths is float32: 1e300 would be inf there
        return isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= _F32_MAX
    return callable(value)


def _check_value(field: str, rule: Rule, value: Any) -> None:
    if value is None and rule.nullable:
        return
    if value is None or not _typed(rule, value):
        if rule.typed_by_range:
            raise ValueError(
                rule.checks[0][1].format(name=field, value=value, MAX_ITERATIONS=MAX_ITERATIONS)
            )
        kind = _KIND_NAMES.get(rule.kind, "a callable") + (" or None" if rule.nullable else "")
        raise ValueError(f"{field} must be {kind}, got {value!r}")
    for ok, says in rule.checks:
        if not ok(value):
            raise ValueError(
                says.format(
                    name=field, value=value, MIN_ALPHA=MIN_ALPHA, MAX_ITERATIONS=MAX_ITERATIONS
                )
            )


def check_names(name: str, fields, /, *, front: str = "linen") -> None:
    """Raises ValueError (one line) for an unknown normaliser or a name in `fields` it does not
    take: its `HPARAMS` and `STRUCTURAL` entries, plus linen's module `name` for
    `front="linen"`, the same for the linen and the NNX classes; `front="config"` takes the
    `HPARAMS` entries only (what a run's config sets; the head sets the rest). What
    `make_normalizer` checks before it dispatches."""
    if name not in HPARAMS:
        raise ValueError(f"unknown normalizer {name!r}; known: {', '.join(NORMALIZERS)}")
    takes = set(HPARAMS[name])
    if front != "config":
        takes |= set(STRUCTURAL[name]) | set(_FRONT_END_ONLY[front])
    unknown = sorted(set(fields) - takes)
    if unknown:
        raise ValueError(
            f"normalizer {name!r} has no hyper-parameter(s) {unknown}; it takes {sorted(takes)}"
        )


def check_hparams(name: str, /, *, front: str = "linen", **hparams) -> None:
    """Raises ValueError (one line) for an unknown normaliser or hyper-parameter of it
    (`check_names`), or a value of the wrong type or out of range, by its rule in
    `schema(name)`: every number finite in float32 (the maths' dtype), momentum in (0, 1) with
    neither it nor `1 − momentum` rounding to 1 in float32, beta >= 0, epsilon > 0 in float32,
    alpha in [`MIN_ALPHA`, 1], iterations an integer in [0, `MAX_ITERATIONS`], group_size a
    positive integer or None (that it divides `d`: `check_width`), the flags True or False, an
    initialiser callable. Every normaliser's constructor, linen's (`__post_init__`) and NNX's
    (`__init__`), runs it on its own hyper-parameters; the config runs it with
    `front="config"`."""
    check_names(name, hparams, front=front)
    for field, rule in schema(name).items():
        if field in hparams:
            _check_value(field, rule, hparams[field])


def check_width(name: str, d: int, /, **hparams) -> None:
    """Raises ValueError (one line naming both numbers) when a hyper-parameter that must divide
    the width `d` of the normaliser's input (`group_size`) does not; the others are
    `check_hparams`'s."""
    for field, rule in schema(name).items():
        value = hparams.get(field)
        if rule.divides_width and value is not None and d % value:
            raise ValueError(f"{field} {value} does not divide the width {d} of {name}'s input")


# ----------------------------------------------------------------------------------------------
# The maths, once: pure steps `(state, x, mask, *, train, update, axis_name, ...)
# -> (y, new state or None, ok or None)` that both front ends run. `train` picks batch or
# running statistics, `update` whether the running state moves (linen's `init` computes a
# training output but leaves the state as it is); the new state is None when it does not move.
# ----------------------------------------------------------------------------------------------


def isobn_init(d: int) -> dict[str, jax.Array]:
    """IsoBN's running state at zero (as the reference): ``cov`` `[d, d]`, ``std`` `[d]`, and
    the ``count``/``skipped`` counters."""
    return {
        "cov": jnp.zeros((d, d), STATS_DTYPE),
        "std": jnp.zeros((d,), STATS_DTYPE),
        **running.counters_init(),
    }


def isobn_update(
    state: dict, x: jax.Array, mask: jax.Array | None, *, momentum: float, axis_name=None
) -> tuple[dict, jax.Array]:
    """`S ← m S + (1 − m) C_B`, `s ← m s + (1 − m) σ_B` from a stop-gradient copy of the batch
    (biased moments of the unmasked rows), under the bad-batch guard (2 rows, finite).

    Returns:
        `(new state, ok)`.
    """
    batch = stats.batch_moments(lax.stop_gradient(x), mask, axis_name=axis_name)
    ok = running.batch_ok(batch.count, batch.cov, batch.std, min_count=MIN_ROWS["isobn"])
    new = {
        "cov": running.ema(momentum, state["cov"], batch.cov),
        "std": running.ema(momentum, state["std"], batch.std),
    }
    return running.guarded(state, new, ok), ok


def isobn_running_gain(
    state: dict, *, momentum: float, beta: float, epsilon: float, debias: bool
) -> jax.Array:
    """The `[d]` stop-gradient gain of IsoBN's running state: `isobn_gain` of `S` and `s`,
    divided first by `1 − m^count` with `debias`, and 1 before the first update."""
    count = state["count"]
    running_cov, running_std = state["cov"], state["std"]
    if debias:
        correction = 1.0 - momentum ** count.astype(STATS_DTYPE)
        correction = jnp.where(count > 0, correction, 1.0)
        running_cov, running_std = running_cov / correction, running_std / correction
    gain = isobn_gain(running_cov, running_std, beta=beta, epsilon=epsilon)
    return lax.stop_gradient(jnp.where(count > 0, gain, jnp.ones_like(gain)))


def isobn(
    state: dict, x: jax.Array, mask: jax.Array | None, *, update: bool, dtype=None, **hparams
) -> tuple[jax.Array, dict | None, jax.Array | None]:
    """IsoBN's step (`norms.IsoBN`): update the state (if `update`), then `x * gain` of the
    (new) running state. `hparams`: ``momentum``, ``beta``, ``epsilon``, ``debias``, and
    ``axis_name``; ``train`` is not read, since IsoBN always scales by its running state."""
    momentum, axis_name = hparams["momentum"], hparams.get("axis_name")
    gain_hparams = {k: hparams[k] for k in ("beta", "epsilon", "debias")}
    new, ok = (None, None)
    if update:
        new, ok = isobn_update(state, x, mask, momentum=momentum, axis_name=axis_name)
        state = new
    gain = isobn_running_gain(state, momentum=momentum, **gain_hparams)
    y = x.astype(stats.stats_dtype(x.dtype)) * gain
    return y.astype(dtype or x.dtype), new, ok


def mean_var_init(d: int, *, with_var: bool) -> dict[str, jax.Array]:
    """The running ``mean`` (zeros), ``var`` (ones, `with_var`) and counters of re-centring and
    batch norm."""
    var = {"var": jnp.ones((d,), STATS_DTYPE)} if with_var else {}
    return {"mean": jnp.zeros((d,), STATS_DTYPE), **var, **running.counters_init()}


def running_mean_var(
    state: dict,
    x: jax.Array,
    mask: jax.Array | None,
    *,
    train: bool,
    update: bool,
    momentum: float,
    min_count: int,
    axis_name: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None, dict | None, jax.Array | None]:
    """`(x in float32, mean [d], var [d] or None, new state or None, ok or None)` of
    re-centring and batch norm (``var`` when the state holds one).

    Training: the batch's masked mean and biased variance (`_mean_var`), and (`update`) the
    running ones moved towards them by `running.ema` under the bad-batch guard (`min_count`
    unmasked rows). Evaluation: the running ones.
    """
    with_var = "var" in state
    x32 = x.astype(stats.stats_dtype(x.dtype))
    if not train:
        return x32, state["mean"], state["var"] if with_var else None, None, None
    count, mean, var = _mean_var(x32, mask, axis_name)
    new, ok = None, None
    if update:
        batch = {"mean": mean, **({"var": var} if with_var else {})}
        ok = running.batch_ok(count, *batch.values(), min_count=min_count)
        moved = {
            name: running.ema(momentum, state[name], lax.stop_gradient(value))
            for name, value in batch.items()
        }
        new = running.guarded(state, moved, ok)
    return x32, mean, var if with_var else None, new, ok


def recenter(state: dict, x, mask, *, momentum: float, dtype=None, **step) -> tuple:
    """Re-centring's step (`norms.Recenter`): `x − mean`, the batch mean in training. Its running
    mean takes a single row (guard 1), whose output is 0 (hence `MIN_ROWS` 2)."""
    x32, mean, _, new, ok = running_mean_var(state, x, mask, momentum=momentum, min_count=1, **step)
    return (x32 - mean).astype(dtype or x.dtype), new, ok


def batch_norm(
    state: dict, x, mask, *, params: dict, momentum: float, epsilon: float, dtype=None, **step
) -> tuple:
    """Batch norm's step (`norms.BatchNorm`): `(x − mean) / sqrt(var + ε) · scale + bias`,
    `params` holding ``scale`` and ``bias`` where they are used."""
    x32, mean, var, new, ok = running_mean_var(
        state, x, mask, momentum=momentum, min_count=MIN_ROWS["batchnorm"], **step
    )
    y = (x32 - mean) * lax.rsqrt(var + epsilon)
    return _scale_bias(y, params).astype(dtype or x.dtype), new, ok


def layer_norm(params: dict, x: jax.Array, *, epsilon: float, dtype=None) -> jax.Array:
    """Layer norm over the feature axis in float32, `params` as in `batch_norm`."""
    x32 = x.astype(stats.stats_dtype(x.dtype))
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean((x32 - mean) ** 2, axis=-1, keepdims=True)
    y = (x32 - mean) * lax.rsqrt(var + epsilon)
    return _scale_bias(y, params).astype(dtype or x.dtype)


def identity(x: jax.Array, dtype: jax.typing.DTypeLike | None = None) -> jax.Array:
    """The `none` normaliser: `x` (cast to `dtype` when one is given)."""
    return x if dtype is None else x.astype(dtype)


def _scale_bias(y: jax.Array, params: dict) -> jax.Array:
    if "scale" in params:
        y = y * params["scale"]
    if "bias" in params:
        y = y + params["bias"]
    return y


def affine_params(
    d: int, *, use_scale: bool, use_bias: bool, scale_init, bias_init, param_dtype, key=None
) -> dict[str, jax.Array]:
    """The ``scale`` and ``bias`` `[d]` of batch and layer norm, where they are used (`key`
    for the initialisers; the defaults ignore it)."""
    key = jax.random.key(0) if key is None else key
    scale_key, bias_key = jax.random.split(key)
    return {
        **({"scale": scale_init(scale_key, (d,), param_dtype)} if use_scale else {}),
        **({"bias": bias_init(bias_key, (d,), param_dtype)} if use_bias else {}),
    }
