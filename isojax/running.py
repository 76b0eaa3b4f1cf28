"""Running statistics in ``'batch_stats'``: the guarded update that `norms` and `stabilizer` share.

A training batch whose statistics are not finite (NaN or Inf in the input, a float16 overflow
upstream) or that holds too few points leaves every running statistic exactly as it was: the
update is a `where` on one boolean (`batch_ok`), so it never raises inside `jit`. The module then
adds 1 to ``batch_stats['skipped']`` (``batch_stats['count']`` counts the updates applied) and
sows ``intermediates['skipped_batch'] = True`` (read it with
``mutable=['batch_stats', 'intermediates']``). Running statistics are float32 whatever the input
dtype (`STATS_DTYPE`, `isojax.stats.stats_dtype`).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

STATS_DTYPE = jnp.float32


def batch_ok(count: jax.Array, *arrays: jax.Array, min_count: int) -> jax.Array:
    """Scalar bool: at least `min_count` points and every statistic in `arrays` finite."""
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in arrays]))
    return finite & (count >= min_count)


def skip_counters(module: nn.Module) -> tuple[nn.Variable, nn.Variable]:
    """The `count` (updates applied) and `skipped` (batches refused) counters, int32 scalars."""
    count = module.variable("batch_stats", "count", jnp.zeros, (), jnp.int32)
    skipped = module.variable("batch_stats", "skipped", jnp.zeros, (), jnp.int32)
    return count, skipped


def guarded_update(
    module: nn.Module,
    pairs: list[tuple[nn.Variable, jax.Array]],
    counters: tuple[nn.Variable, nn.Variable],
    ok: jax.Array,
) -> None:
    """Writes new values of running statistics only where `ok`; counts and sows a skipped batch."""
    for variable, new in pairs:
        variable.value = jnp.where(ok, new.astype(variable.value.dtype), variable.value)
    count, skipped = counters
    count.value = count.value + ok.astype(jnp.int32)
    skipped.value = skipped.value + (~ok).astype(jnp.int32)
    module.sow("intermediates", "skipped_batch", ~ok)


def ema(momentum: float, running: jax.Array, batch: jax.Array) -> jax.Array:
    """Flax-form moving average: `momentum * running + (1 - momentum) * batch`."""
    return momentum * running + (1.0 - momentum) * batch


def check_state_shape(module: nn.Module, name: str, have: tuple, want: tuple, x_shape: tuple):
    """Raises at trace time when existing running state does not fit the input's features."""
    if tuple(have) != tuple(want):
        raise ValueError(
            f"{type(module).__name__}: input of shape {tuple(x_shape)} (feature size "
            f"{x_shape[-1]}) needs batch_stats[{name!r}] of shape {tuple(want)}, but the "
            f"existing state has shape {tuple(have)}"
        )
