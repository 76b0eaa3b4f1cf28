"""The train state and the compiled steps: train, eval (with isotropy statistics), C0 pass.

`train_step(state, batch) -> (state, metrics)` runs the model in train mode (dropout key
`fold_in(rng, step)`, normaliser statistics updated in `batch_stats`, I-STAR's running
stabiliser updated in `stabilizer`) and minimises

    task loss (cross-entropy, or squared error for STS-B)
      + lambda * (1 - IsoScore*(all layers' tokens; C0, zeta))    penalty "istar", SPEC.md §4
      + lambda * mean off-diagonal cosine of last-layer tokens    penalty "cosreg", SPEC.md §5

in float32 whatever the compute dtype. Under float16 the loss is scaled after the penalty is
added, the gradients are unscaled before the optimizer (so clipping sees true norms), and a
step with non-finite gradients keeps the previous params, optimizer state, `batch_stats` *and*
the stabiliser (STYLE.md §13; the Flax ImageNet example keeps only the first two).

Filler rows (`example_mask` 0, padding the last batch to a fixed shape) never enter a loss,
a penalty or a statistic; `include_padding=True` (reference parity) lets the padding tokens
of real examples in, not the filler rows.

Without a token penalty the loss reads only the sentence vectors, so the train step runs the
encoder's last layer at the [CLS] tokens alone (`ObjectiveSpec.reads_tokens`, the encoder's
`cls_only`): the same loss and gradients, to float rounding, for about 1/7 less work on a
6-layer encoder. Evaluation, the C0 pass and the token penalties run every token.

Dropout key: the run key `rng` is stored as raw key data (`[2]` uint32 for threefry, `[4]` for
"rbg"), wrapped with `TrainState.rng_impl` inside the step. "rbg" draws the dropout masks with
XLA's RngBitGenerator (the usual choice on accelerators); its split / fold_in are still
threefry's, and its bits do not depend on the sharding (tested).

Devices (`isojax.training.distributed`): `jit_steps` compiles the three steps for a one-axis mesh;
under `jax.jit` with global arrays, every statistic (IsoBN's moments, IsoScore*, C0, the
dev-set moments) is over the global batch, with no explicit collective.

References:
  flax `examples/imagenet/train.py` (TrainState with batch_stats and a loss scale);
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.core import isotropy, penalties, stats
from isojax.data import packing
from isojax.linen import istar as linen_istar
from isojax.models import transformer
from isojax.training import distributed, precision, specs


def istar_module(objective: specs.ObjectiveSpec) -> linen_istar.IsoScoreStar:
    """The IsoScore* module (C0 estimated as `objective.istar.stabilizer.kind`) of an I-STAR
    objective."""
    istar = objective.istar
    return linen_istar.make_isoscore_star(
        istar.stabilizer.kind, zeta=istar.zeta, **istar.stabilizer.settings()
    )


def init_istar_state(objective: specs.ObjectiveSpec, hidden_size: int) -> dict | None:
    """The initial `TrainState.stabilizer`: the module's `batch_stats` (`{'c0': [d, d]
    identity, ...}` float32) for the I-STAR penalty, None otherwise."""
    if objective.penalty != "istar":
        return None
    return linen_istar.init_batch_stats(istar_module(objective), hidden_size)


@flax.struct.dataclass
class TrainState:
    """Everything a step changes, as one pytree (checkpointed whole).

    Attributes:
      step: `[]` int32 number of updates done.
      params: the model's 'params' collection (`policy.param_dtype`).
      opt_state: the optax state.
      batch_stats: the normaliser's running statistics (float32), `{}` for none.
      stabilizer: I-STAR's `IsoScoreStar` collection (float32 `{'c0': [d, d], ...}`, plus the
        window or EMA of a running stabiliser); None for other methods.
      loss_scale: `precision.NoOpLossScale` or `precision.DynamicLossScale`.
      rng: raw data of the run key (uint32, `[2]` threefry or `[4]` rbg); step `t` uses
        `fold_in(wrap_key_data(rng, impl=rng_impl), t)` for dropout.
      apply_fn, tx, objective, rng_impl: static (not in the checkpoint).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    batch_stats: Any
    stabilizer: dict | None
    loss_scale: precision.LossScale
    rng: jax.Array
    apply_fn: Callable = flax.struct.field(pytree_node=False)
    tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)
    objective: specs.ObjectiveSpec = flax.struct.field(pytree_node=False)
    rng_impl: str = flax.struct.field(pytree_node=False, default="threefry2x32")


def task_loss(logits: jax.Array, labels: jax.Array, example_mask: jax.Array, regression: bool):
    """Mean over real examples of cross-entropy (or squared error), float32 scalar.

    Args:
      logits: `[b, num_labels]`; labels: `[b]` int class ids or float scores;
      example_mask: `[b]` 1 real, 0 filler.
    """
    logits = logits.astype(jnp.float32)
    weights = example_mask.astype(jnp.float32)
    if regression:
        per_example = (logits[:, 0] - labels.astype(jnp.float32)) ** 2
    else:
        per_example = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(per_example * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def penalty_mask(batch: dict, include_padding: bool) -> jax.Array:
    """`[rows, t]` tokens that enter the penalty and C0: real tokens of real examples
    (`packing.token_mask`, padded or packed rows), or (with `include_padding`, the reference's
    choice; padded rows only) every position of a real example; filler rows (`example_mask` 0)
    never."""
    if not include_padding:
        return packing.token_mask(batch)
    if packing.is_packed(batch):
        raise ValueError("include_padding needs padded batches: packed rows have no padding")
    return jnp.broadcast_to(batch["example_mask"][:, None], batch["attention_mask"].shape)


def _penalty(
    state: TrainState, out: dict, batch: dict, stabilizer: dict | None = None
) -> tuple[jax.Array, dict | None]:
    """`(penalty [] float32, new stabiliser state)` from `stabilizer` (None: the state's;
    under accumulation the previous micro-batch's); it changes only for a running I-STAR
    stabiliser. With weight 0 the penalty is a metric only (no backward pass)."""
    objective = state.objective
    stabilizer = state.stabilizer if stabilizer is None else stabilizer
    hidden = out["encoder"].hidden_states
    if objective.weight == 0.0 and objective.reads_tokens:
        hidden = jax.tree.map(jax.lax.stop_gradient, hidden)
    # The mask carries the padding choice, so the functions below never drop it themselves.
    mask = penalty_mask(batch, objective.include_padding)
    if objective.penalty == "istar":
        return linen_istar.penalty_and_update(istar_module(objective), stabilizer, hidden, mask)
    if objective.penalty == "cosreg":
        return penalties.cosreg_penalty(hidden[-1], mask), stabilizer
    return jnp.zeros([], jnp.float32), stabilizer


def dropout_key(state: TrainState) -> jax.Array:
    """This step's dropout key: `fold_in(run key, step)` with the run's key implementation."""
    key = jax.random.wrap_key_data(state.rng, impl=state.rng_impl)
    return jax.random.fold_in(key, state.step)


def _grads(state: TrainState, batch_stats, stabilizer, batch: dict, rng: jax.Array):
    """Gradients of the scaled objective on one (micro-)batch with the given running
    statistics, and `(new batch_stats, new stabiliser, task loss, penalty, objective)`."""
    objective = state.objective

    def loss_fn(params):
        (logits, out), updates = state.apply_fn(
            {"params": params, "batch_stats": batch_stats},
            **transformer.model_inputs(batch),
            deterministic=False,
            use_running_average=False,
            example_mask=batch["example_mask"],
            cls_only=objective.cls_only and not objective.reads_tokens,
            rngs={"dropout": rng},
            mutable=["batch_stats"],
        )
        loss = task_loss(logits, batch["labels"], batch["example_mask"], objective.regression)
        penalty, new_stabilizer = _penalty(state, out, batch, stabilizer)
        total = loss + objective.weight * penalty  # penalty added before scaling
        aux = (updates.get("batch_stats", {}), new_stabilizer, loss, penalty, total)
        return state.loss_scale.scale(total), aux

    return jax.grad(loss_fn, has_aux=True)(state.params)


def _accumulated_grads(state: TrainState, batch: dict, rng: jax.Array):
    r"""`_grads` over `k` stacked micro-batches (`[k, rows, ...]` arrays) in one `lax.scan`.

    Micro-batch `i` holds `n_i` real examples (`example_mask`; packed micro-batches differ)
    and gets the dropout key `fold_in(rng, i)`. The gradient is the real-example average
    :math:`g = \sum_i n_i g_i / \sum_i n_i` of the micro-batches' mean-loss gradients, i.e.
    the gradient of the mean loss over all `sum n_i` examples; the losses are averaged alike.
    Running statistics (normaliser `batch_stats`, a running I-STAR stabiliser) go through the
    micro-batches in order, each seeing the one before (PyTorch accumulation). Gradients sum
    in float32.
    """
    counts = jnp.sum(batch["example_mask"].astype(jnp.float32), axis=1)  # [k]
    weights = counts / jnp.maximum(jnp.sum(counts), 1.0)  # [k]
    k = counts.shape[0]

    def body(carry, xs):
        grads_sum, batch_stats, stabilizer, sums = carry
        micro, weight, i = xs
        grads, (batch_stats, stabilizer, *losses) = _grads(
            state, batch_stats, stabilizer, micro, jax.random.fold_in(rng, i)
        )
        grads_sum = jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32), grads_sum, grads)
        return (grads_sum, batch_stats, stabilizer, sums + weight * jnp.stack(losses)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    init = (zeros, state.batch_stats, state.stabilizer, jnp.zeros([3], jnp.float32))
    (grads, batch_stats, stabilizer, sums), _ = jax.lax.scan(
        body, init, (batch, weights, jnp.arange(k))
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return grads, (batch_stats, stabilizer, sums[0], sums[1], sums[2])


def _counts(batch: dict) -> dict[str, jax.Array]:
    """`examples` (real examples) and `real_tokens` (their tokens) of a batch, stacked or not:
    the throughput figures' counts (`isojax.training.throughput`), global under `jax.jit`."""
    if packing.is_packed(batch):
        tokens = jnp.sum(batch["token_mask"])
    else:
        tokens = jnp.sum(batch["attention_mask"] * batch["example_mask"][..., None])
    return {"examples": jnp.sum(batch["example_mask"]), "real_tokens": tokens}


def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    """One update on `batch` (global arrays); returns the new state and float32 metrics.

    `batch`: one batch (`example_mask` `[b]`), or `k` micro-batches stacked (`[k, b]`,
    `config.grad_accum_steps`): one update from their real-example-averaged gradient
    (`_accumulated_grads`).

    Metrics: `loss` (task + weight * penalty), `task_loss`, `penalty`, `grad_norm` (after
    unscaling, before clipping), `grads_finite` (1/0), `loss_scale`; `examples` and
    `real_tokens` (counts, `_counts`).
    """
    rng = dropout_key(state)
    if batch["example_mask"].ndim == 2:
        grads, aux = _accumulated_grads(state, batch, rng)
    else:
        grads, aux = _grads(state, state.batch_stats, state.stabilizer, batch, rng)
    batch_stats, stabilizer, loss, penalty, total = aux
    grads = state.loss_scale.unscale(grads)
    grads_finite = precision.all_finite(grads)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if isinstance(state.loss_scale, precision.DynamicLossScale):
        # An overflowed step keeps everything, running statistics included (STYLE.md §13).
        params, opt_state, batch_stats, stabilizer = precision.select_tree(
            grads_finite,
            (params, opt_state, batch_stats, stabilizer),
            (state.params, state.opt_state, state.batch_stats, state.stabilizer),
        )
    new_state = state.replace(
        step=state.step + 1,
        params=params,
        opt_state=opt_state,
        batch_stats=batch_stats,
        stabilizer=stabilizer,
        loss_scale=state.loss_scale.adjust(grads_finite),
    )
    step_metrics = {
        "loss": total,
        "task_loss": loss,
        "penalty": penalty,
        "grad_norm": optax.tree.norm(grads),
        "grads_finite": grads_finite.astype(jnp.float32),
        "loss_scale": state.loss_scale.loss_scale.astype(jnp.float32),
        **_counts(batch),
    }
    return new_state, jax.tree.map(lambda x: x.astype(jnp.float32), step_metrics)


def eval_step(state: TrainState, batch: dict, acc: Any) -> tuple[Any, dict]:
    """Eval-mode forward pass on `batch`; returns `acc` (an `evaluation.EvalAccumulator`, a
    module that imports this one) with `batch` added, and `{'logits' [b, k] f32, 'labels'
    [b], 'example_mask' [b]}` for the task metrics."""
    logits, out = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        **transformer.model_inputs(batch),
        deterministic=True,
        use_running_average=True,
        example_mask=batch["example_mask"],
    )
    real = batch["example_mask"]  # [b]
    hidden = jnp.stack(out["encoder"].hidden_states)  # [L, b, t, h]
    token_mask = packing.token_mask(batch)  # [rows, t]
    acc = acc.replace(
        sentence=isotropy.sentence_stats_update(acc.sentence, out["sentence"], real),
        pre_logits=isotropy.sentence_stats_update(acc.pre_logits, out["pre_logits"], real),
        tokens=stats.moments_update(
            acc.tokens, hidden, jnp.broadcast_to(token_mask, hidden.shape[:-1])
        ),
        last_tokens=isotropy.sentence_stats_update(acc.last_tokens, hidden[-1], token_mask),
    )
    outputs = {
        "logits": logits.astype(jnp.float32),
        "labels": batch["labels"],
        "example_mask": real,
    }
    return acc, outputs


def c0_pass_step(state: TrainState, batch: dict, acc: stats.MomentState) -> stats.MomentState:
    """Adds one batch's tokens (all layers, eval mode, no gradient) to the C0 accumulator
    (`penalties.c0_pass_update`; `acc.count` counts the token vectors of all layers)."""
    _, out = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats},
        **transformer.model_inputs(batch),
        deterministic=True,
        use_running_average=True,
        example_mask=batch["example_mask"],
    )
    hidden = out["encoder"].hidden_states
    mask = penalty_mask(batch, state.objective.include_padding)  # [b, t]
    return penalties.c0_pass_update(acc, hidden, mask)


def jit_steps(
    state: TrainState, mesh: jax.sharding.Mesh, *, fsdp: bool = False, grad_accum_steps: int = 1
):
    """`(train_step, eval_step, c0_pass_step)` compiled for `mesh`; the state is donated
    to `train_step`, and its sharding is kept from step to step. `grad_accum_steps` > 1:
    `train_step` takes stacked micro-batches (`distributed.global_batch(..., stacked=True)`)."""
    shardings = distributed.state_sharding(state, mesh, fsdp=fsdp)
    data = NamedSharding(mesh, P(distributed.DATA_AXIS))
    stacked = NamedSharding(mesh, P(None, distributed.DATA_AXIS))  # [k, rows, ...]
    train_data = data if grad_accum_steps == 1 else stacked
    replicated = NamedSharding(mesh, P())
    train = jax.jit(
        train_step,
        in_shardings=(shardings, train_data),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        eval_step,
        in_shardings=(shardings, data, replicated),
        out_shardings=(replicated, replicated),
        donate_argnums=2,
    )
    stabilize = jax.jit(
        c0_pass_step,
        in_shardings=(shardings, data, replicated),
        out_shardings=replicated,
        donate_argnums=2,
    )
    return train, evaluate, stabilize
