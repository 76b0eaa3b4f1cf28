"""Running statistics: the guarded update that `norms` and `stabilizer` share, as pure functions.

A module's running state is a flat dict of float32 arrays plus the int32 counters ``count``
(updates applied) and ``skipped`` (bad batches refused), `counters_init`. A training batch whose
statistics are not finite (NaN or Inf in the input, a float16 overflow upstream) or that holds too
few points leaves every running statistic exactly as it was: `guarded` is a `where` on one boolean
(`batch_ok`), so it never raises inside `jit`. The pure functions take the state in and give the
new state out; each front end only reads and writes its variables: linen's ``'batch_stats'``
collection here (`linen_state`, `linen_write`, which also sows
``intermediates['skipped_batch'] = True``, read with ``mutable=['batch_stats', 'intermediates']``)
and `nnx.BatchStat` attributes in :mod:`isojax.nnx`. Running statistics are float32 whatever the
input dtype (`STATS_DTYPE`, `isojax.stats.stats_dtype`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

STATS_DTYPE = jnp.float32


def batch_ok(count: jax.Array, *arrays: jax.Array, min_count: int) -> jax.Array:
    """Scalar bool: at least `min_count` points and every statistic in `arrays` finite."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))
    return finite & (count >= min_count)


def counters_init() -> dict[str, jax.Array]:
    """The `count` (updates applied) and `skipped` (batches refused) counters, int32 scalars."""
    return {"count": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32)}


def guarded(state: dict, new: dict, ok: jax.Array) -> dict:
    """`state` with each entry of `new` written only where `ok`, and the counters advanced.

    Args:
        state: the running state, holding ``count`` and ``skipped`` (`counters_init`).
        new: proposed values of some entries of `state` (cast to their dtypes).
        ok: scalar bool, from `batch_ok`.

    Returns:
        A new dict; `state` is not modified.
    """
    out = dict(state)
    for name, value in new.items():
        out[name] = jnp.where(ok, value.astype(state[name].dtype), state[name])
    out["count"] = state["count"] + ok.astype(jnp.int32)
    out["skipped"] = state["skipped"] + (~ok).astype(jnp.int32)
    return out


def ema(momentum: float, running: jax.Array, batch: jax.Array) -> jax.Array:
    """Flax-form moving average: `momentum * running + (1 - momentum) * batch`."""
    return momentum * running + (1.0 - momentum) * batch


def check_shapes(owner: str, state: dict, want: dict, x_shape: tuple) -> None:
    """Raises at trace time when existing running state does not fit the input's features.

    Args:
        owner: the module's class name, for the message.
        state: the existing state (arrays or anything with `.shape`).
        want: the state the input needs (e.g. `jax.eval_shape` of the state's init).
        x_shape: the input's shape.
    """
    for name, value in state.items():
        have, need = tuple(value.shape), tuple(want[name].shape)
        if have != need:
            raise ValueError(
                f"{owner}: input of shape {tuple(x_shape)} (feature size "
                f"{x_shape[-1]}) needs batch_stats[{name!r}] of shape {need}, but the "
                f"existing state has shape {have}"
            )


def linen_state(module: nn.Module, init: dict, x_shape: tuple) -> dict[str, nn.Variable]:
    """Declares `init`'s entries as ``'batch_stats'`` variables of `module` and checks their
    shapes against `init` (`check_shapes`); returns the variables by name."""
    variables = {
        name: module.variable("batch_stats", name, lambda v=value: v)
        for name, value in init.items()
    }
    check_shapes(type(module).__name__, linen_values(variables), init, x_shape)
    return variables


def linen_values(variables: dict[str, nn.Variable]) -> dict[str, jax.Array]:
    """The current values of `linen_state`'s variables."""
    return {name: v.value for name, v in variables.items()}


def linen_write(
    module: nn.Module, variables: dict[str, nn.Variable], new: dict, ok: jax.Array
) -> None:
    """Writes a pure update's new state into `variables` and sows ``skipped_batch = ~ok``."""
    for name, value in new.items():
        variables[name].value = value
    module.sow("intermediates", "skipped_batch", ~ok)


def linen_step(module: nn.Module, init, step, x, mask, use_running_average, **kwargs):
    """Runs a pure step `step(state, x, mask, *, train, update, axis_name, **kwargs) -> (y, new
    state or None, ok)` on `module`'s ``batch_stats`` (declared from `init(d)`, `d` the input's
    feature size) and writes the new state back; linen's `init` computes a training output but
    leaves the state as it is. The module has `use_running_average` and `axis_name` fields."""
    use_running_average = nn.merge_param(
        "use_running_average", module.use_running_average, use_running_average
    )
    variables = linen_state(module, init(x.shape[-1]), x.shape)
    initializing = module.is_initializing()
    y, new, ok = step(
        linen_values(variables),
        x,
        mask,
        train=not use_running_average,
        update=not use_running_average and not initializing,
        axis_name=None if initializing else module.axis_name,
        **kwargs,
    )
    if new is not None:
        linen_write(module, variables, new, ok)
    return y
