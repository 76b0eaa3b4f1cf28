"""Mixed precision: a dtype policy parsed from a string, and loss scaling for float16.

A `Policy` names three dtypes, as in DeepMind's jmp: the parameters' storage dtype (`param`),
the dtype the model computes in (`compute`) and the dtype of the model's outputs (`output`).
It is parsed from strings such as ``"p=f32,c=bf16,o=f32"`` (or the long form
``"params=float32,compute=bfloat16,output=float32"``, or one dtype for all three:
``"bf16"``). Statistics and losses stay float32 whatever the policy (STYLE.md §11-12); the
policy sets the modules' ``dtype``/``param_dtype``, and the train state's `apply_fn` casts the
logits and sentence vectors the classifier returns to the output dtype (`OutputCast`, jmp's
``cast_to_output``), which the loss and the statistics then read in float32. float64 needs
JAX's x64 mode (``JAX_ENABLE_X64=1``); without it the policy is refused.

float16 has a 5-bit exponent: gradients of a float16 forward pass underflow unless the loss is
multiplied by a large scale before differentiation and the gradients divided by it after.
`DynamicLossScale` grows the scale by `factor` after `period` finite steps and shrinks it on a
step with non-finite gradients, which the train step then skips (`select_tree`). All loss
scales are pytrees, so they live in the train state and in checkpoints.

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_,
  ICLR 2018, §3.2 (loss scaling). DeepMind jmp (`jmp/_src/policy.py`, `loss_scale.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_DTYPE_NAMES = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "single": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "half": jnp.float16,
    "f64": jnp.float64,
    "float64": jnp.float64,
}
_KEYS = {"p": "param", "params": "param", "param": "param", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}


def parse_dtype(name: str) -> jnp.dtype:
    """`"bf16"` / `"bfloat16"` / `"half"` ... -> the numpy dtype; ValueError names the bad one."""
    key = name.strip().lower()
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"unknown dtype {name!r} in precision policy; known: {', '.join(sorted(_DTYPE_NAMES))}"
        )
    return jnp.dtype(_DTYPE_NAMES[key])


def _short(dtype: Any) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64"}[
        jnp.dtype(dtype).name
    ]


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, computation and outputs (jmp's `Policy`).

    Attributes:
      param_dtype: storage dtype of the parameters and of the optimizer's moments.
      compute_dtype: dtype of activations and matmuls (the modules' ``dtype``).
      output_dtype: dtype of the logits and sentence vectors the classifier returns
        (`OutputCast`); the loss and statistics read them in float32.
    """

    param_dtype: jnp.dtype
    compute_dtype: jnp.dtype
    output_dtype: jnp.dtype

    def cast_to_param(self, tree: Any) -> Any:
        """Casts every floating leaf of `tree` to `param_dtype`."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts every floating leaf of `tree` to `compute_dtype`."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts every floating leaf of `tree` to `output_dtype`."""
        return _cast_floating(tree, self.output_dtype)

    @property
    def needs_loss_scaling(self) -> bool:
        """True when float16 appears in the policy: its gradients underflow unscaled."""
        return jnp.dtype(jnp.float16) in (self.compute_dtype, self.param_dtype)

    def __str__(self) -> str:
        return (
            f"p={_short(self.param_dtype)},c={_short(self.compute_dtype)},"
            f"o={_short(self.output_dtype)}"
        )


def get_policy(spec: str) -> Policy:
    """Parses ``"p=f32,c=bf16,o=f32"``-style strings into a `Policy`.

    Keys ``p``/``params``, ``c``/``compute``, ``o``/``output``; a key left out defaults to
    float32. A string without ``=`` (``"bf16"``) sets all three dtypes.

    Examples:
      >>> str(get_policy("params=float32,compute=bfloat16,output=float32"))
      'p=f32,c=bf16,o=f32'
      >>> str(get_policy("half"))
      'p=f16,c=f16,o=f16'

    Raises:
      ValueError: an unknown key or dtype, a key given twice, or float64 without JAX's
        x64 mode.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"precision policy must be a non-empty string, got {spec!r}")
    if "=" not in spec:
        dtype = parse_dtype(spec)
        return _checked(spec, Policy(dtype, dtype, dtype))
    fields: dict[str, jnp.dtype] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad precision policy item {part!r} in {spec!r}; expected p=..,c=..,o=.."
            )
        if _KEYS[key] in fields:
            raise ValueError(f"precision policy {spec!r} sets {_KEYS[key]} twice")
        fields[_KEYS[key]] = parse_dtype(value)
    f32 = jnp.dtype(jnp.float32)
    policy = Policy(
        param_dtype=fields.get("param", f32),
        compute_dtype=fields.get("compute", f32),
        output_dtype=fields.get("output", f32),
    )
    return _checked(spec, policy)


def _checked(spec: str, policy: Policy) -> Policy:
    """`policy`, or ValueError for float64 while JAX's x64 mode is off (it would run in
    float32, with only JAX's per-op warnings to say so)."""
    f64 = jnp.dtype(np.float64)
    wants = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
    if f64 in wants and not jax.config.jax_enable_x64:
        raise ValueError(
            f"precision policy {spec!r} asks for float64, but JAX's x64 mode is off: set "
            "JAX_ENABLE_X64=1 before starting, or use f32"
        )
    return policy


# What a classifier returns beside its logits that the policy's output dtype applies to: the
# sentence vectors (`isojax.models.heads.classify`'s extras).
OUTPUT_VECTORS = ("sentence", "pre_logits")


@dataclasses.dataclass(frozen=True)
class OutputCast:
    """`fn` (a classifier's `apply`) with `policy.cast_to_output` applied to what it returns,
    as jmp's policy is applied: the logits and the sentence vectors (`OUTPUT_VECTORS`) of its
    `(logits, extras)`, also under `mutable=` (`((logits, extras), updates)`). The hidden
    states stay in the compute dtype. Compares by value, so a jitted step keyed on a state
    holding it compiles once."""

    fn: Callable
    policy: Policy

    def __call__(self, *args, **kwargs):
        out = self.fn(*args, **kwargs)
        if kwargs.get("mutable"):
            return self._cast(out[0]), out[1]
        return self._cast(out)

    def _cast(self, out: tuple) -> tuple:
        logits, extras = out
        vectors = {k: v for k, v in extras.items() if k in OUTPUT_VECTORS}
        return self.policy.cast_to_output(logits), {
            **extras,
            **self.policy.cast_to_output(vectors),
        }


def _cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    def cast(x):
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def all_finite(tree: Any) -> jax.Array:
    """Scalar bool: every element of every leaf of `tree` is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `jnp.where(pred, a, b)` of two pytrees with the same structure (scalar pred)."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


@flax.struct.dataclass
class NoOpLossScale:
    """No loss scaling (float32 and bfloat16 policies): `scale`/`unscale` are identities."""

    loss_scale: jax.Array = flax.struct.field(default_factory=lambda: jnp.ones([], jnp.float32))

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self


@flax.struct.dataclass
class DynamicLossScale:
    r"""A loss scale that grows while gradients stay finite and halves when they do not.

    .. math::
      s \leftarrow \begin{cases} s / f & \text{non-finite gradients (floor: min\_loss\_scale)}\\
      s \cdot f & \text{after `period` finite steps in a row (if finite)}\\
      s & \text{otherwise}\end{cases}

    Attributes:
      loss_scale: `[]` float32 current scale.
      counter: `[]` int32 finite steps since the last change.
      period: finite steps before the scale grows (static).
      factor: growth / shrink factor (static).
      min_loss_scale: the scale never drops below this (static).
    """

    loss_scale: jax.Array
    counter: jax.Array = flax.struct.field(default_factory=lambda: jnp.zeros([], jnp.int32))
    period: int = flax.struct.field(pytree_node=False, default=2000)
    factor: float = flax.struct.field(pytree_node=False, default=2.0)
    min_loss_scale: float = flax.struct.field(pytree_node=False, default=1.0)

    def scale(self, tree: Any) -> Any:
        """Multiplies every leaf by the scale (in the leaf's dtype)."""
        return jax.tree.map(lambda x: x * self.loss_scale.astype(x.dtype), tree)

    def unscale(self, tree: Any) -> Any:
        """Divides every leaf by the scale; computed in float32, cast back to the leaf dtype."""
        inv = 1.0 / self.loss_scale
        return jax.tree.map(lambda x: (x.astype(jnp.float32) * inv).astype(x.dtype), tree)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """The next loss scale given whether this step's gradients were all finite."""
        grown = self.loss_scale * self.factor
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        on_finite = jnp.where(self.counter == self.period - 1, grown, self.loss_scale)
        on_overflow = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        loss_scale = jnp.where(grads_finite, on_finite, on_overflow).astype(jnp.float32)
        counter = jnp.where(grads_finite, (self.counter + 1) % self.period, 0)
        return self.replace(loss_scale=loss_scale, counter=counter.astype(jnp.int32))


LossScale = NoOpLossScale | DynamicLossScale


def make_loss_scale(policy: Policy, kind: str = "auto", *, initial: float = 2.0**15) -> LossScale:
    """The loss scale for a policy: ``"auto"`` is dynamic exactly when float16 is used.

    Args:
      policy: the precision policy.
      kind: ``"auto"``, ``"dynamic"`` or ``"none"``.
      initial: the dynamic scale's starting value (jmp and PyTorch AMP start at 2**15-2**16).
    """
    if kind not in ("auto", "dynamic", "none"):
        raise ValueError(f"loss_scale must be 'auto', 'dynamic' or 'none', got {kind!r}")
    if kind == "dynamic" or (kind == "auto" and policy.needs_loss_scaling):
        return DynamicLossScale(loss_scale=jnp.asarray(initial, jnp.float32))
    return NoOpLossScale()
