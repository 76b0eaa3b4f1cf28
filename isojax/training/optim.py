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


def check_hparams(
    *,
    learning_rate: float,
    schedule: str = "linear",
    warmup_fraction: float = 0.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_norm: float | None = None,
) -> None:
    """Raises ValueError (one line naming the value) for a setting `make_optimizer` refuses.

    Every number must be finite: an infinite learning rate or weight decay (`1e999` parses as
    inf) turns the first update's parameters into inf/NaN, and the run would train on NaN."""
    values = dict(
        learning_rate=learning_rate,
        warmup_fraction=warmup_fraction,
        weight_decay=weight_decay,
        b1=b1,
        b2=b2,
        adam_eps=adam_eps,
        clip_norm=clip_norm,
    )
    for name, value in values.items():
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; known: {SCHEDULES}")
    if not 0.0 <= warmup_fraction < 1.0:
        raise ValueError(f"warmup_fraction {warmup_fraction} not in [0, 1)")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"b1 and b2 must be in [0, 1), got {b1}, {b2}")
    if not adam_eps > 0:
        raise ValueError(f"adam_eps must be > 0, got {adam_eps}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 (None disables clipping), got {clip_norm}")


def make_optimizer(
    *,
    learning_rate: float,
    total_steps: int,
    warmup_fraction: float = 0.0,
    schedule: str = "linear",
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    adam_eps: float = 1e-8,
    clip_norm: float | None = None,
) -> optax.GradientTransformation:
    """AdamW with the schedule above; clip by global norm first unless `clip_norm` is None.

    Args:
      learning_rate, total_steps, warmup_fraction, schedule: see `learning_rate_schedule`.
      weight_decay: decoupled decay coefficient (multiplied by the scheduled rate, as torch
        AdamW), applied to `decay_mask` leaves only.
      b1, b2, adam_eps: Adam's moment decays and epsilon (outside the square root).
      clip_norm: global-norm clipping threshold (> 0); None disables.

    Returns:
      An `optax.GradientTransformation`; its state is a pytree of float32 moments.
    """
    check_hparams(
        learning_rate=learning_rate,
        schedule=schedule,
        warmup_fraction=warmup_fraction,
        weight_decay=weight_decay,
        b1=b1,
        b2=b2,
        adam_eps=adam_eps,
        clip_norm=clip_norm,
    )
    rate = learning_rate_schedule(
        learning_rate, total_steps, warmup_fraction=warmup_fraction, kind=schedule
    )
    adamw = optax.adamw(
        rate, b1=b1, b2=b2, eps=adam_eps, weight_decay=weight_decay, mask=decay_mask
    )
    if clip_norm is not None:
        return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    return adamw
