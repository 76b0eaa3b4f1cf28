"""The linen glue of the running statistics: a pure step of :mod:`isojax.core.running`'s form run
on a module's ``'batch_stats'`` collection.

`linen_step` declares the state as ``'batch_stats'`` variables (`linen_state`, shapes checked),
runs the pure step, writes the new state back and sows ``intermediates['skipped_batch'] = ~ok``
(`linen_write`), read with ``mutable=['batch_stats', 'intermediates']``. The NNX twin is
:class:`isojax.nnx.norms.RunningModule`.
"""

import flax.linen as nn
import jax

from isojax.core import running


def linen_state(module: nn.Module, init: dict, x_shape: tuple) -> dict[str, nn.Variable]:
    """Declares `init`'s entries as ``'batch_stats'`` variables of `module` and checks their
    shapes against `init` (`check_shapes`); returns the variables by name."""
    variables = {
        name: module.variable("batch_stats", name, lambda v=value: v)
        for name, value in init.items()
    }
    running.check_shapes(type(module).__name__, linen_values(variables), init, x_shape)
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
