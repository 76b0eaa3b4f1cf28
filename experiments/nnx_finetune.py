"""Fine-tune an isojax NNX classifier on a GLUE task: the linen loop's recipe, in Flax NNX.

    PYTHONPATH=. python experiments/nnx_finetune.py --method isobn --out /tmp/nnx-stsb-isobn

The recipe is the linen loop's, read from the same config file (default the README's main job,
`experiments/configs/main_job.py`: MiniLM-L6 on STS-B, one epoch, packed, seed 1, batch 32,
max length 128, AdamW lr 1e-4 with warm-up, decay and clipping, IsoBN's momentum/beta/epsilon,
I-STAR's weight, zeta and C0 pass), built from the same parts: the tokenizer, examples,
batches (padded or packed, `isojax.training.feeds.train_batches`), optimizer
(`build.make_optimizer`)
and loss (`steps.task_loss`).
What is NNX here: the model (`isojax.nnx.from_pretrained` + `SequenceClassifier`), the state
(`nnx.Optimizer(model, tx, wrt=nnx.Param)`, IsoBN's and I-STAR's `nnx.BatchStat`s), the step
(`nnx.split` once, then a pure `jax.jit` function that merges, differentiates and updates:
`experiments/bench/nnx_step.py`: 1.008x the linen step's time at MiniLM 32 x 128, where
graph-mode `nnx.jit` is 1.006x, and less per-call overhead than `nnx.jit` at tiny sizes:
11.8 ms against 17.6 ms, linen 7.8 ms) and the orbax
checkpoints of the NNX state (model, optimizer and dropout streams, I-STAR's C0), which
resume: each holds the dev results so far and the config stamp (`resume.config_stamp`), so
a resume with another config (seed, normaliser, ...) is refused in one line, and a finished
run reruns to its saved results. The dev set is evaluated at each epoch's end before its
checkpoint. `max_steps`, `keep_checkpoints` and `log_every` are honoured; a field this loop
does not implement (accumulation, `checkpoint_every`, float16 loss scaling, CosReg, another
I-STAR stabiliser, `include_padding`) is refused in one line (`check_supported`, exit 2).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from isojax.cli.common import install_log_handler
from isojax.core import penalties
from isojax.data import batching, glue, metrics, packing
from isojax.models import transformer
from isojax.nnx import pretrained
from isojax.training import build, feeds, precision, resume, steps


def build_run(config, num_labels: int):
    """`(model, istar or None, tokenizer)`: the NNX twin (`pretrained.from_linen`) of the
    classifier the linen loop builds for `config` (`build.build_model`: the same normaliser,
    its settings, dropout and sentence vector), with the pre-trained encoder weights (random
    for tiny-bert), in training mode."""
    policy = precision.get_policy(config.policy)
    linen_model, encoder_params, tokenizer, hidden = build.build_model(config, policy, num_labels)
    model = pretrained.from_linen(
        linen_model, rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1)
    )
    if encoder_params is not None:
        pretrained.load_linen_variables(model.encoder, {"params": encoder_params})
    istar = None
    if config.penalty == "istar":
        from isojax.nnx import IsoScoreStar

        istar = IsoScoreStar(hidden, stabilizer="pass", zeta=config.istar.zeta)
    model.train()
    return model, istar, tokenizer


def make_loss(regression: bool, weight: float):
    """`loss(model, istar or None, batch)`: the task loss (`steps.task_loss`), plus
    `weight * (1 - IsoScore*)` of every layer's tokens with I-STAR (which then updates its
    state); without I-STAR the last layer runs at the [CLS] tokens only (`cls_only`)."""

    def loss_fn(model, istar, batch):
        logits, out = model(
            **transformer.model_inputs(batch),
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
        logits, out = nnx.merge(eval_def, model_state)(**transformer.model_inputs(batch))
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


class Unsupported(ValueError):
    """A config field the NNX loop does not implement (one-line message)."""


def check_supported(config) -> None:
    """Refuses (`Unsupported`, one line) the config fields this loop does not implement, so
    that none is silently ignored: it honours `max_steps`, `keep_checkpoints`, `log_every`
    and checkpoints at each epoch's end only."""
    refused = {
        "grad_accum_steps": (config.grad_accum_steps != 1, "1 (no accumulation here)"),
        "checkpoint_every": (bool(config.checkpoint_every), "None (a checkpoint an epoch)"),
        "penalty": (config.penalty not in ("none", "istar"), "none or istar"),
        "istar.stabilizer.kind": (
            config.penalty == "istar" and config.istar.stabilizer.kind != "pass",
            "pass (the C0 pass before each epoch)",
        ),
        "istar.include_padding": (config.istar.include_padding, "False"),
        "policy": (
            precision.get_policy(config.policy).needs_loss_scaling,
            "no float16 (no loss scaling here)",
        ),
    }
    for name, (bad, want) in refused.items():
        if bad:
            raise Unsupported(
                f"{name}: the NNX loop does not implement this setting; use {want}, or the "
                "linen loop (isojax finetune)"
            )


def _save(manager, step: int, states, results: list, config) -> None:
    """The checkpoint of `step`: the NNX states, the dev results so far and the config stamp
    (`resume.config_stamp`, compared on resume)."""
    meta = {"results": results, **resume.config_stamp(config)}
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(_keys_as_data(states)), meta=ocp.args.JsonSave(meta)
        ),
    )


def _restore(manager, states, config) -> tuple[int, tuple, list]:
    """`(step, states, results)` of the newest checkpoint, or `(0, states, [])`;
    `resume.ConfigChanged` (one line) for a checkpoint of another config, before its states
    are read."""
    step = manager.latest_step()
    if step is None:
        return 0, states, []
    where = f"checkpoint step {step} in {manager.directory}"
    try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except (KeyError, ValueError, FileNotFoundError):
        raise resume.ConfigChanged(
            f"{where} holds no config stamp (an older nnx_finetune's): use a new --out"
        ) from None
    resume.check_stamp(meta["config"], config, where)
    like = _keys_as_data(states)
    is_key = jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jax.dtypes.prng_key), states)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(like))
    restored = manager.restore(step, args=args)["state"]
    return step, _keys_as_data((restored, is_key), back=True), meta["results"]


def finetune(config, out: pathlib.Path | None = None, *, stop_after: int | None = None):
    """Trains `config.num_epochs` epochs, or `config.max_steps` steps (resuming from `out`'s
    newest checkpoint, whose config stamp must match), evaluates the dev set at each epoch's
    end, then checkpoints; returns `(model, [dev metrics of each epoch])`, a finished run's
    read back from its checkpoint. `stop_after` returns after that many steps of this call,
    checkpointing first (for the resume test). `Unsupported` for a field it does not
    implement (`check_supported`)."""
    check_supported(config)
    task = glue.get_task(config.task)
    model, istar, tokenizer = build_run(config, task.num_labels)
    train_enc, dev_enc = (
        batching.encode(build.load_examples(config, split), tokenizer, config.max_length)
        for split in ("train", task.dev_splits[0])
    )
    per_epoch = batching.num_batches(len(train_enc.labels), config.batch_size, drop_remainder=True)
    total = per_epoch * config.num_epochs
    total = total if config.max_steps is None else min(total, config.max_steps)
    tx = build.make_optimizer(config, total)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    eval_view = nnx.view(model, deterministic=True, use_running_average=True)
    parts = [nnx.split(x) if x is not None else (None, None) for x in (model, opt, istar)]
    graphdefs = (*(p[0] for p in parts), nnx.graphdef(eval_view))
    states = tuple(p[1] for p in parts)
    steps_fns = make_steps(graphdefs, task.is_regression, config.istar.weight)
    manager = None
    if out is not None:
        options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints)
        manager = ocp.CheckpointManager(out.resolve() / "checkpoints", options=options)
        step, states, results = _restore(manager, states, config)
    else:
        step, results = 0, []
    run = (config, task, graphdefs, steps_fns, train_enc, dev_enc, per_epoch, total)
    states, results = _epochs(run, manager, states, step, results, stop_after)
    if manager is not None:
        manager.wait_until_finished()
    return nnx.merge(graphdefs[0], states[0]), results


def _epochs(run, manager, states, step: int, results: list, stop_after: int | None):
    """The epoch loop from `step`: the C0 pass at an epoch's start (I-STAR), the steps (a loss
    line every `log_every`), the dev evaluation at the epoch's (or run's) end, then its
    checkpoint. Returns `(states, results)`."""
    config, task, graphdefs, (train_step, eval_step), train_enc, dev_enc, per_epoch, total = run
    done = 0
    while True:
        epoch, offset = divmod(step, per_epoch)
        if step and len(results) < -(-step // per_epoch) and (offset == 0 or step == total):
            epoch_done = epoch - 1 if offset == 0 else epoch  # its evaluation not yet saved
            results.append(evaluate(eval_step, states[0], dev_enc, config, task))
            print(f"epoch {epoch_done}: step {step} dev {results[-1]}", file=sys.stderr)
            if manager is not None:
                _save(manager, step, states, results, config)
        if step >= total:
            return states, results
        if graphdefs[2] is not None and offset == 0:  # the C0 pass before every epoch
            # (a run resumed mid-epoch keeps the checkpoint's C0)
            states = _install_c0(states, graphdefs[2], eval_step, train_enc, config, epoch)
        for batch in feeds.train_batches(train_enc, config, epoch, offset):
            states, loss = train_step(states, batch)
            step, done = step + 1, done + 1
            if step % config.log_every == 0:
                print(f"step {step}: loss {float(loss):.4f}", file=sys.stderr)
            if stop_after is not None and done == stop_after:
                _save(manager, step, states, results, config)
                manager.wait_until_finished()
                return states, results
            if step == total:
                break


def _install_c0(states, istar_def, eval_step, train_enc, config, epoch: int):
    """`states` with I-STAR's C0 rebuilt by the C0 pass over the epoch's batches."""
    from isojax.nnx import install_c0

    istar = nnx.merge(istar_def, states[2])
    batches = feeds.train_batches(train_enc, config, epoch)
    install_c0(istar, c0_pass(eval_step, states[0], batches, istar.num_features, config))
    return states[0], states[1], nnx.state(istar)


def c0_pass(eval_step, model_state, batches, d: int, config) -> jax.Array:
    """I-STAR's C0 from `config.istar.stabilizer.tokens` eval-mode token vectors."""

    def update(acc, batch):
        _, hidden = eval_step(model_state, batch)
        return penalties.c0_pass_update(acc, hidden, packing.token_mask(batch))

    acc = penalties.estimate_c0(
        update, batches, penalties.c0_pass_init(d), num_points=config.istar.stabilizer.tokens
    )
    return penalties.c0_pass_finalize(acc)


def evaluate(eval_step, model_state, encoded, config, task) -> dict:
    """The task's dev metrics (`metrics.compute_metrics`) of the eval-mode model."""
    preds, labels = [], []
    for batch in feeds.batches(encoded, config, batch_size=config.eval_batch_size):
        logits, _ = eval_step(model_state, batch)
        real = np.asarray(batch["example_mask"]) > 0
        logits = np.asarray(logits)[real]
        preds.append(logits[:, 0] if task.is_regression else logits.argmax(-1))
        labels.append(np.asarray(batch["labels"])[real])
    return metrics.compute_metrics(task, np.concatenate(preds), np.concatenate(labels))


def load_config(path: pathlib.Path, method: str):
    """`get_config(method)` of a config file (default: the README's main job, the linen
    loop's recipe: `experiments/configs/main_job.py`)."""
    sys.path.insert(0, str(path.resolve().parent))  # the recipe files import each other
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(method)


def main(argv=None) -> None:
    install_log_handler()
    here = pathlib.Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=pathlib.Path, default=here / "configs/main_job.py")
    parser.add_argument("--method", default="isobn", choices=("none", "isobn", "istar"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    config = load_config(args.config, args.method)
    config.seed = args.seed
    try:
        _, results = finetune(config, args.out)
    except (Unsupported, resume.ConfigChanged) as err:
        print(f"nnx_finetune: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(results[-1])


if __name__ == "__main__":
    main()
