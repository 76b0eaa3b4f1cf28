"""Running statistics: the guarded update that `norms` and `stabilizer` share, as pure functions.

A module's running state is a flat dict of float32 arrays plus the int32 counters ``count``
(updates applied) and ``skipped`` (bad batches refused), `counters_init`. A training batch whose
statistics are not finite (NaN or Inf in the input, a float16 overflow upstream) or that holds too
few points leaves every running statistic exactly as it was: `guarded` is a `where` on one boolean
(`batch_ok`), so it never raises inside `jit`. The pure functions take the state in and give the
new state out; each front end only reads and writes its variables: linen's ``'batch_stats'``
collection (:mod:`isojax.linen.running`: `linen_state`, `linen_write`, which also sows
``intermediates['skipped_batch'] = True``, read with ``mutable=['batch_stats', 'intermediates']``)
and `nnx.BatchStat` attributes in :mod:`isojax.nnx`. Running statistics are float32 whatever the
input dtype (`STATS_DTYPE`, `isojax.core.stats.stats_dtype`).
"""

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
