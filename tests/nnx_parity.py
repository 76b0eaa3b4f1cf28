"""Parity of an NNX module with its linen twin (issue 23): the harness of nnx/test_norms.py and
nnx/test_istar.py.

Both front ends run 3 jitted training steps on the same batches and weights (the loss
`sum(sin(3 y))` of the module's output `y`, differentiated with respect to the parameters and
the input), then one evaluation call. `differences` reports the largest absolute difference of
the outputs (every step and the evaluation), of the running statistics after the steps and of
the gradients, each array's difference divided by `max(1, max |linen's|)` (absolute for values
up to 1, relative above: batch norm's gradient of a one-row batch is ~3e3, where float32 rounds
to ~2e-4); `failures` lists those above the issue's tolerances. The NNX side runs in one of
`VARIANTS`: graph-mode `nnx.jit` with `.train()`/`.eval()`, the same in tree mode
(`nnx.set_graph_mode(False)`), the forward under `nnx.remat`, and `nnx.view` train/eval views.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

TOLERANCES = {"out": 1e-6, "stats": 1e-6, "grad": 1e-5}
VARIANTS = ("jit", "tree", "remat", "view")


def _loss(y):
    return jnp.sum(jnp.sin(3.0 * y.astype(jnp.float32)))


def linen_run(apply, variables, batches):
    """`apply(variables, x, mask, train) -> (y, new batch_stats)`; `batches` `[(x, mask)]`, the
    last for evaluation. Returns `{"out": [...], "grad": [...], "stats": {...}}`."""
    params, batch_stats = variables.get("params", {}), variables.get("batch_stats", {})

    @jax.jit
    def step(params, batch_stats, x, mask):
        def loss(params, x):
            y, new = apply({"params": params, "batch_stats": batch_stats}, x, mask, True)
            return _loss(y), (y, new)

        (_, (y, new)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)
        return y, new, grads

    result = {"out": [], "grad": []}
    for x, mask in batches[:-1]:
        y, batch_stats, grads = step(params, batch_stats, x, mask)
        result["out"].append(y)
        result["grad"].append(grads)
    x, mask = batches[-1]
    y, _ = jax.jit(apply, static_argnums=3)(
        {"params": params, "batch_stats": batch_stats}, x, mask, False
    )
    result["out"].append(y)
    result["stats"] = dict(batch_stats)
    return result


def nnx_run(model, call, batches, variant):
    """The same run of the NNX `model`, `call(model, x, mask) -> y` reading the model's mode."""
    assert variant in VARIANTS, variant
    tree = variant == "tree"
    forward = nnx.remat(call) if variant == "remat" else call
    with nnx.set_graph_mode(False) if tree else contextlib.nullcontext():

        @nnx.jit
        def step(model, x, mask):
            def loss(model, x):
                y = forward(model, x, mask)
                return _loss(y), y

            grad_fn = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True, allow_int=tree)
            (_, y), (model_grads, x_grads) = grad_fn(model, x)
            return y, (nnx.to_pure_dict(nnx.state(model_grads, nnx.Param)), x_grads)

        if variant == "view":
            train_model = nnx.view(model, use_running_average=False)
            eval_model = nnx.view(model, use_running_average=True)
        else:
            train_model = eval_model = model
            model.train()
        result = {"out": [], "grad": []}
        for x, mask in batches[:-1]:
            y, grads = step(train_model, x, mask)
            result["out"].append(y)
            result["grad"].append(grads)
        if variant != "view":
            model.eval()
        x, mask = batches[-1]
        result["out"].append(nnx.jit(call)(eval_model, x, mask))
        result["stats"] = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    return result


def _max_abs(a, b) -> float:
    if isinstance(a, dict) or isinstance(b, dict):
        if set(a) != set(b):
            return float("inf")
        return max([_max_abs(a[k], b[k]) for k in a], default=0.0)
    if isinstance(a, list | tuple):
        return max([_max_abs(u, v) for u, v in zip(a, b, strict=True)], default=0.0)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = max(1.0, float(np.max(np.abs(a), initial=0.0)))
    return float(np.max(np.abs(a - b), initial=0.0)) / scale


def differences(linen, nnx_result) -> dict[str, float]:
    """The largest absolute difference of each kind (`TOLERANCES`' keys)."""
    return {kind: _max_abs(linen[kind], nnx_result[kind]) for kind in TOLERANCES}


def failures(linen, nnx_result) -> dict[str, float]:
    """The kinds whose difference exceeds its tolerance, with the difference."""
    found = differences(linen, nnx_result)
    return {kind: diff for kind, diff in found.items() if not diff <= TOLERANCES[kind]}


class Twins:
    """Each twin's run once per test session, by name (and variant for NNX): the parity tests
    and the broken-twin tests share them.

    Args:
      linen_result: `name -> linen_run(...)` result.
      nnx_model: `name -> a fresh NNX model`.
      call: `(model, x, mask) -> y`.
      batches: `() -> [(x, mask)]`.
    """

    def __init__(self, linen_result, nnx_model, call, batches):
        self._linen_result, self._nnx_model = linen_result, nnx_model
        self._call, self._batches = call, batches
        self._runs = {}

    def linen(self, name):
        if ("linen", name) not in self._runs:
            self._runs["linen", name] = self._linen_result(name)
        return self._runs["linen", name]

    def nnx(self, name, variant="jit"):
        if (name, variant) not in self._runs:
            model = self._nnx_model(name)
            self._runs[name, variant] = nnx_run(model, self._call, self._batches(), variant)
        return self._runs[name, variant]
