r"""The fine-tuning optimizer: AdamW, linear warm-up then linear decay, optional clipping.

As in the reference trainers (transformers' `get_linear_schedule_with_warmup` + `AdamW`):

.. math::
  \eta_t = \eta \cdot \begin{cases} t / W & t < W \\
  \max\bigl(0, (T - t) / (T - W)\bigr) & t \ge W \end{cases}

for update `t = 0, 1, ...`, `W = floor(warmup_fraction * T)` warm-up steps of `T` in all.
Weight decay applies to matrices only (kernels, embeddings): biases and LayerNorm / BatchNorm
scales are 1-D and are not decayed (the reference's ``no_decay = ["LayerNorm.weight",
"bias"]``). Gradient clipping, when on, is by global norm and comes first in the chain, so
under float16 it sees the unscaled gradients (the train step unscales before `update`).

References:
  Loshchilov & Hutter, `Decoupled Weight Decay Regularization
  <https://arxiv.org/abs/1711.05101>`_, ICLR 2019, algorithm 2.
  Devlin et al., `BERT <https://arxiv.org/abs/1810.04805>`_, NAACL 2019, appendix A.2
  (linear warm-up then linear decay).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

SCHEDULES = ("linear", "constant")


def learning_rate_schedule(
    learning_rate: float, total_steps: int, *, warmup_fraction: float = 0.0, kind: str = "linear"
) -> optax.Schedule:
    """Linear warm-up to `learning_rate` then linear decay to 0 at `total_steps`, or constant.

    Args:
      learning_rate: the peak rate.
      total_steps: number of updates `T` in the run (>= 1).
      warmup_fraction: `W / T` in [0, 1); the warm-up rises from 0 at update 0.
      kind: ``"linear"`` (warm-up + decay) or ``"constant"`` (the I-STAR reference: no
        schedule; `warmup_fraction` still adds a linear warm-up).

    Returns:
      An optax schedule `count -> rate` (float32 scalar).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; known: {SCHEDULES}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction must be in [0, 1), got {warmup_fraction}")
    warmup = int(warmup_fraction * total_steps)
    after = (
        optax.linear_schedule(learning_rate, 0.0, total_steps - warmup)
        if kind == "linear"
        else optax.constant_schedule(learning_rate)
    )
    if warmup == 0:
        return after
    return optax.join_schedules(
        [optax.linear_schedule(0.0, learning_rate, warmup), after], boundaries=[warmup]
    )


def decay_mask(params: Any) -> Any:
    """Pytree of bools like `params`: True for leaves of rank >= 2 (kernels, embeddings).

    Biases and norm scales/offsets (rank 1) and scalars are excluded from weight decay.
    """
    return jax.tree.map(lambda p: p.ndim >= 2, params)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """The optimizer's settings: config section `optimizer` (`config.optimizer.learning_rate`),
    each checked where the spec is built (`ValueError`, one line naming the value).

    Attributes:
      learning_rate: the peak rate (> 0).
      schedule: "linear" (warm-up + decay) or "constant" (`learning_rate_schedule`).
      warmup_fraction: `W / T` in [0, 1).
      weight_decay: decoupled decay coefficient (>= 0; multiplied by the scheduled rate, as
        torch AdamW), applied to `decay_mask` leaves only.
      b1, b2, adam_eps: Adam's moment decays (in [0, 1)) and epsilon (> 0, outside the
        square root).
      clip_norm: global-norm clipping threshold (> 0); None: no clipping.
    """

    learning_rate: float = 2e-5
    schedule: str = "linear"
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    clip_norm: float | None = 1.0

    def __post_init__(self) -> None:
        check_hparams(self)


def check_hparams(spec: OptimSpec) -> None:
    """Raises ValueError (one line naming the value) for a setting `make_optimizer` refuses.

    Every number must be finite: an infinite learning rate or weight decay (`1e999` parses as
    inf) turns the first update's parameters into inf/NaN, and the run would train on NaN."""
    for field in dataclasses.fields(spec):
        value = getattr(spec, field.name)
        if field.name == "schedule" or value is None:
            continue
        if not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(f"{field.name} must be a finite number, got {value!r}")
    if not spec.learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {spec.learning_rate}")
    if spec.schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {spec.schedule!r}; known: {SCHEDULES}")
    if not 0.0 <= spec.warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction {spec.warmup_fraction} not in [0, 1)")
    if spec.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {spec.weight_decay}")
    if not (0.0 <= spec.b1 < 1.0 and 0.0 <= spec.b2 < 1.0):
        raise ValueError(f"b1 and b2 must be in [0, 1), got {spec.b1}, {spec.b2}")
    if not spec.adam_eps > 0:
        raise ValueError(f"adam_eps must be > 0, got {spec.adam_eps}")
    if spec.clip_norm is not None and not spec.clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 (None disables clipping), got {spec.clip_norm}")


def make_optimizer(spec: OptimSpec, total_steps: int) -> optax.GradientTransformation:
    """AdamW with the schedule above over `total_steps` updates; clip by global norm first
    unless `spec.clip_norm` is None.

    Returns:
      An `optax.GradientTransformation`; its state is a pytree of float32 moments.
    """
    rate = learning_rate_schedule(
        spec.learning_rate, total_steps, warmup_fraction=spec.warmup_fraction, kind=spec.schedule
    )
    adamw = optax.adamw(
        rate,
        b1=spec.b1,
        b2=spec.b2,
        eps=spec.adam_eps,
        weight_decay=spec.weight_decay,
        mask=decay_mask,
    )
    if spec.clip_norm is not None:
        return optax.chain(optax.clip_by_global_norm(spec.clip_norm), adamw)
    return adamw
