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

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.core import isotropy, istar, penalties, stats
from isojax.data import packing
from isojax.models import transformer
from isojax.training import distributed, precision, specs


def istar_settings(objective: specs.ObjectiveSpec) -> dict:
    """The stabiliser settings of an I-STAR objective (`core.istar.DEFAULTS` under its
    `istar.stabilizer.settings()`: ``stabilizer``, ``window``, ``window_unit``, ``momentum``,
    ``debias``),
    checked by the one rule of `core.istar` (ValueError, one line)."""
    settings = objective.istar.stabilizer.settings()
    istar.check_fields(settings)
    settings = {k: v for k, v in istar.DEFAULTS.items() if k != "zeta"} | settings
    istar.check_zeta(objective.istar.zeta)
    istar.check_hparams(
        objective.istar.stabilizer.kind,
        window=settings["window"],
        window_unit=settings["window_unit"],
        momentum=settings["momentum"],
    )
    return {"stabilizer": objective.istar.stabilizer.kind, **settings}


def init_istar_state(objective: specs.ObjectiveSpec, hidden_size: int) -> dict | None:
    """The initial `TrainState.stabilizer` for the I-STAR penalty (`core.istar.state_init`:
    `{'c0': [d, d] identity, ...}` float32, plus a running stabiliser's window or EMA and
    counters), None otherwise."""
    if objective.penalty != "istar":
        return None
    d = hidden_size
    return istar.state_init(istar.identity_init(None, (d, d)), **istar_settings(objective))


def istar_penalty(
    objective: specs.ObjectiveSpec, stabilizer: dict, hidden, mask: jax.Array
) -> tuple[jax.Array, dict]:
    """`(1 - IsoScore*, new stabiliser state)` of the batch's tokens (SPEC.md §4): the pure
    `core.istar.prepare` and `core.istar.step` on `TrainState.stabilizer` (the C0 of the
    previous steps scores the batch, then a running stabiliser moves, under the bad-batch
    guard); the state is unchanged for the `pass` stabiliser."""
    x, mask = istar.prepare(hidden, mask)
    score, new, _ = istar.step(
        stabilizer, x, mask, update=True, zeta=objective.istar.zeta, **istar_settings(objective)
    )
    return 1.0 - score, stabilizer if new is None else new


@flax.struct.dataclass
class TrainState:
    """Everything a step changes, as one pytree (checkpointed whole).

    Attributes:
      step: `[]` int32 number of updates done.
      params: the model's weights (`policy.param_dtype`): linen's 'params' collection, or
        the NNX model's `nnx.Param` state (`nnx.State`, NNX's paths).
      opt_state: the optax state.
      batch_stats: the normaliser's running statistics (float32): linen's collection (`{}`
        for none), or the `nnx.BatchStat` state.
      stabilizer: I-STAR's state (`core.istar.state_init`: float32 `{'c0': [d, d], ...}`,
        plus the window or EMA of a running stabiliser); None for other methods.
      loss_scale: `precision.NoOpLossScale` or `precision.DynamicLossScale`.
      rng: linen: raw data of the run key (uint32, `[2]` threefry or `[4]` rbg), step `t`
        uses `fold_in(wrap_key_data(rng, impl=rng_impl), t)` for dropout; NNX: its dropout
        streams (`nnx.RngState`: keys as raw key data, and their counters).
      apply_fn: the front end's apply (`front_ends.LinenApply` or `NnxApply`);
      tx, objective, rng_impl: static (not in the checkpoint), as `apply_fn`.
    """

    def older_layouts(self) -> tuple:
        """`((abstract state, convert), ...)`: the layouts an older isojax saved this state in
        (a 0.4.0 NNX run's linen-shaped tree), for `checkpointing.Checkpointer.restore`."""
        return self.apply_fn.older_layouts(self)

    step: jax.Array
    params: Any
    opt_state: Any
    batch_stats: Any
    stabilizer: dict | None
    loss_scale: precision.LossScale
    rng: Any
    apply_fn: Any = flax.struct.field(pytree_node=False)
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
        return istar_penalty(objective, stabilizer, hidden, mask)
    if objective.penalty == "cosreg":
        return penalties.cosreg_penalty(hidden[-1], mask), stabilizer
    return jnp.zeros([], jnp.float32), stabilizer


def dropout_key(state: TrainState) -> jax.Array:
    """This step's dropout key of a linen run: `fold_in(run key, step)` with the run's key
    implementation."""
    key = jax.random.wrap_key_data(state.rng, impl=state.rng_impl)
    return jax.random.fold_in(key, state.step)


def _grads(state: TrainState, batch_stats, stabilizer, batch: dict, rngs):
    """Gradients of the scaled objective on one (micro-)batch with the given running
    statistics and dropout randomness (`apply_fn.step_rngs`' or `micro_rngs`' `rngs`), and
    `(new batch_stats, new stabiliser, what `apply_fn.train` gives of the dropout randomness
    after the call, task loss, penalty, objective)`."""
    objective = state.objective

    def loss_fn(params):
        (logits, out), new_stats, new_rngs = state.apply_fn.train(
            {"params": params, "batch_stats": batch_stats},
            rngs,
            **transformer.model_inputs(batch),
            example_mask=batch["example_mask"],
            cls_only=objective.cls_only and not objective.reads_tokens,
        )
        loss = task_loss(logits, batch["labels"], batch["example_mask"], objective.regression)
        penalty, new_stabilizer = _penalty(state, out, batch, stabilizer)
        total = loss + objective.weight * penalty  # penalty added before scaling
        aux = (new_stats, new_stabilizer, new_rngs, loss, penalty, total)
        return state.loss_scale.scale(total), aux

    return jax.grad(loss_fn, has_aux=True)(state.params)


def _accumulated_grads(state: TrainState, batch: dict, rngs):
    r"""`_grads` over `k` stacked micro-batches (`[k, rows, ...]` arrays) in one `lax.scan`.

    Micro-batch `i` holds `n_i` real examples (`example_mask`; packed micro-batches differ)
    and gets the dropout randomness `apply_fn.micro_rngs(rngs, i)` (linen: the key
    `fold_in(rng, i)`; NNX: its streams, as the micro-batch before left them). The gradient is
    the real-example average :math:`g = \sum_i n_i g_i / \sum_i n_i` of the micro-batches'
    mean-loss gradients, i.e. the gradient of the mean loss over all `sum n_i` examples; the
    losses are averaged alike. Running statistics (normaliser `batch_stats`, a running I-STAR
    stabiliser) go through the micro-batches in order, each seeing the one before (PyTorch
    accumulation). Gradients sum in float32.
    """
    counts = jnp.sum(batch["example_mask"].astype(jnp.float32), axis=1)  # [k]
    weights = counts / jnp.maximum(jnp.sum(counts), 1.0)  # [k]
    k = counts.shape[0]

    def body(carry, xs):
        grads_sum, batch_stats, stabilizer, rngs, sums = carry
        micro, weight, i = xs
        grads, (batch_stats, stabilizer, after, *losses) = _grads(
            state, batch_stats, stabilizer, micro, state.apply_fn.micro_rngs(rngs, i)
        )
        rngs = state.apply_fn.carry_rngs(rngs, after)
        grads_sum = jax.tree.map(lambda a, g: a + weight * g.astype(jnp.float32), grads_sum, grads)
        return (grads_sum, batch_stats, stabilizer, rngs, sums + weight * jnp.stack(losses)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    init = (zeros, state.batch_stats, state.stabilizer, rngs, jnp.zeros([3], jnp.float32))
    (grads, batch_stats, stabilizer, rngs, sums), _ = jax.lax.scan(
        body, init, (batch, weights, jnp.arange(k))
    )
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    return grads, (batch_stats, stabilizer, rngs, sums[0], sums[1], sums[2])


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
    rngs = state.apply_fn.step_rngs(state.rng, state.step, state.rng_impl)
    if batch["example_mask"].ndim == 2:
        grads, aux = _accumulated_grads(state, batch, rngs)
    else:
        grads, aux = _grads(state, state.batch_stats, state.stabilizer, batch, rngs)
    batch_stats, stabilizer, after, loss, penalty, total = aux
    # Linen's run key stays as it is; NNX's dropout streams move on.
    rng = state.apply_fn.next_rng(state.rng, state.apply_fn.carry_rngs(rngs, after))
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
        rng=rng,
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
