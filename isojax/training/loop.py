"""Fine-tuning on GLUE: build a run from its config, then the loop with evaluation and checkpoints.

    config = isojax.training.configs.isobn.get_config()      # or
    isojax.training.config.default_config()
    config.task, config.data_dir = "rte", "glue_data"
    results = loop.train_and_evaluate(config, "runs/rte-isobn")   # resumes if interrupted

The file reads in call order (flax `examples/imagenet/train.py` shape): `train_and_evaluate`
holds the run folder and the signals, validates the config once and takes its `specs.RunSpec`
(below it every builder reads the spec it needs, not the config), calls `build_run`, which builds
the classifier (linen, or NNX with `config.front_end` "nnx": `front_ends`) and the train
state on the
device mesh (`build`, `distributed`) and encodes the task (`data.batching`; `feeds` pads each
batch to a length bucket, or packs it with `config.packing`); then a `Loop` restores the newest
usable checkpoint (`checkpointing`) and runs `Loop.epochs`: per epoch the I-STAR C0 pass
(`c0_pass`: penalty "istar" with C0 mode "pass"; "epoch" and "ema" update C0 inside the steps),
the epoch's training steps from where the checkpoint left off (`Loop.train_epoch`), a dev
evaluation (task metrics + isotropy of the sentence and token embeddings), a checkpoint (and
the best dev epoch's, kept apart).
Metrics go to `metrics.jsonl` and TensorBoard (`reporting`), progress to stderr. With the data
order fixed by (seed, epoch) and the dropout key by the step, a killed and resumed run ends
bit-identical to an uninterrupted one on CPU.

References:
  Zhou, Lin, Ren, `IsoBN <https://arxiv.org/abs/2005.02178>`_, AAAI 2021 (SPEC.md §1).
  Rudman, Eickhoff, `Stable Anisotropic Regularization <https://arxiv.org/abs/2305.19358>`_,
  ICLR 2024 (SPEC.md §4).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import ml_collections
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.core import istar, penalties
from isojax.data import batching, tasks
from isojax.training import (
    build,
    checkpointing,
    distributed,
    evaluation,
    feeds,
    reporting,
    resume,
    run_folder,
    specs,
    steps,
    stops,
    throughput,
)
from isojax.training import config as config_lib
from isojax.training.position import Position

logger = logging.getLogger(__name__)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Fine-tunes `config.model` on `config.task`, evaluating on dev after every epoch.

    `config`: `isojax.training.config.default_config()` or an `isojax.training.configs` preset,
    with overrides (validated here, once); `config.front_end` "nnx" trains the `isojax.nnx` twin
    of the classifier through this same loop; `mesh`: the devices (default: all of every
    process). Resumes from the newest usable checkpoint in `workdir/checkpoints` (state and
    `Position`), ending as an uninterrupted run would; writes `config.json`,
    `metrics.jsonl`, `tensorboard/` and `results.json`, and keeps the best dev epoch's
    checkpoint in `workdir/best_checkpoint`.
    With `config.progress`, the run's first line on stderr names where its data come from
    (`data_source`).
    A loss that stays non-finite (float32, bfloat16) stops the run with
    `stops.NonFiniteLoss`, its `results.json` a stop record with no score.
    Returns the last dev results: `{split: {metric: value}}` per dev split ("dev", or MNLI's
    two) with the task's metrics, `score` and the isotropy keys of `evaluation.isotropy_metrics`;
    plus "step" and "epoch"; and "best": the results (same keys) of the epoch with the best
    score on the first dev split (`isojax export/predict --best`).

    SIGTERM or SIGINT (`stops.Watch`): the running step finishes, its checkpoint is written at
    that position, and `stops.Preempted` (SystemExit, status 75) is raised; rerun to resume.
    A signal before the first step raises it at once (nothing to save); a failure once a stop
    was requested raises `stops.StopFailed` (status 1). A normaliser that skipped every
    batch of an epoch stops the run with `stops.NormalizerStalled`.

    The run folder is held (`run_folder.hold_run_folder`: a second process is refused with
    `run_folder.RunFolderBusy`) and must hold nothing of a run with another config
    (`run_folder.check_same_run`); `config.json` is written once the restore has accepted the
    config. The profiler window and the writers are closed on every way out.
    """
    config_lib.validate_config(config)  # the boundary: below it, builders take `spec`'s parts
    spec = specs.RunSpec.of(config)
    distributed.initialize_distributed()  # before any JAX call: the checks ask for the platform
    build.check_model(spec.model)  # the model's sizes: refused before the folder is touched
    workdir = pathlib.Path(workdir)
    run_folder.check_same_run(spec.fields, workdir)  # a refusal leaves the folder as it was
    workdir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    # The folder held and the signals watched before anything is built (`stops.Watch`).
    with run_folder.hold_run_folder(workdir, lead), stops.Watch() as watch:
        run = build_run(spec, mesh=mesh)
        if lead and spec.loop.progress:  # the progress display's first line, once the data
            # have loaded (a refusal stays the one line on stderr; progress off: errors only)
            logger.info("isojax: %s: %s", workdir, data_source(spec.data))
        loop, state = Loop.open(run, workdir, lead, watch)
        try:
            if lead:  # once the restore has accepted the config
                (workdir / "config.json").write_text(config.to_json(indent=2) + "\n")
            watch.start()
            state, step = loop.epochs(state)
            results = loop.results(state, step)
        except Exception as err:
            if watch.signal_name is None:
                raise
            stop = stops.StopFailed(watch.signal_name, err)
            logger.error(stop.line())
            raise stop from err
        finally:
            loop.close()
    if lead:
        (workdir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def data_source(spec: specs.DataSpec) -> str:
    """Where the run reads its task (`build.load_examples`), for the run's first line: the
    TSVs of `spec.data_dir`, or, without one, tensorflow-datasets."""
    if spec.data_dir:
        return f"{spec.task} from the TSVs in {spec.data_dir}"
    where = spec.tfds_data_dir or "its default data dir (~/tensorflow_datasets)"
    return (
        f"{spec.task} from tensorflow-datasets glue/{spec.task} in {where}: no data_dir "
        "was given (--data-dir DIR reads a glue_data folder)"
    )


@dataclasses.dataclass(frozen=True)
class Run(build.Classifier):
    """Everything `train_and_evaluate` builds before its loop (also for tests and benchmarks):
    the classifier (`build.Classifier`: task, spec, model, tokenizer, state, mesh, `eval_fn`,
    hidden size) with its training steps and data.

    `train_fn(state, batch) -> (state, metrics)`, `eval_fn(state, batch, acc) -> (acc, out)`
    and `c0_pass_fn(state, batch, acc) -> acc` are the jitted `steps` functions for `mesh`;
    batches go through `distributed.global_batch(batch, mesh)` first.
    """

    train_fn: Callable
    c0_pass_fn: Callable
    train_encoded: batching.Encoded
    dev_encoded: dict[str, batching.Encoded]
    steps_per_epoch: int
    total_steps: int


def setup(config: ml_collections.ConfigDict, *, mesh: jax.sharding.Mesh | None = None) -> Run:
    """Validates `config` (the boundary), then `build_run` of its `specs.RunSpec`."""
    config_lib.validate_config(config)
    return build_run(specs.RunSpec.of(config), mesh=mesh)


def build_run(spec: specs.RunSpec, *, mesh: jax.sharding.Mesh | None = None) -> Run:
    """Loads model and data of `spec` (a validated config's), creates the train state on
    `mesh` (default: every device) and compiles nothing yet (the steps compile on first
    call)."""
    task = tasks.get_task(spec.data.task)
    model, encoder_params, tokenizer, hidden_size = build.build_model(
        spec.model, task.num_labels, front_end=spec.state.front_end
    )
    train_examples = build.load_examples(spec.data, "train")
    model = model.clone(output_bias=build.output_bias(spec.model, task, train_examples))
    encode = lambda split: batching.encode(  # noqa: E731
        build.load_examples(spec.data, split), tokenizer, spec.data.max_length
    )
    train_encoded = batching.encode(train_examples, tokenizer, spec.data.max_length)
    dev_encoded = {split: encode(split) for split in task.dev_splits}
    feed = spec.feed
    steps_per_epoch = batching.num_batches(len(train_encoded), feed.batch_size, drop_remainder=True)
    if steps_per_epoch == 0:
        raise config_lib.ConfigError(
            f"config: batch_size {feed.batch_size} is larger than the {len(train_encoded)} "
            "training examples (the last incomplete batch is dropped: no step would run)"
        )
    total_steps = spec.loop.max_steps or steps_per_epoch * spec.loop.num_epochs
    mesh = distributed.make_mesh() if mesh is None else mesh
    sizes = (
        ("batch_size / grad_accum_steps", feed.micro_batch_size),
        ("eval_batch_size", feed.eval_batch_size),
    )
    for name, size in sizes:
        if size % mesh.size:
            raise config_lib.ConfigError(
                f"config: {name} {size} must be a multiple of the {mesh.size} devices"
            )
    state = build.train_state(
        spec.state,
        task,
        model,
        encoder_params,
        hidden_size,
        mesh,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
    )
    train_fn, eval_fn, c0_pass_fn = steps.jit_steps(
        state, mesh, fsdp=spec.state.fsdp, grad_accum_steps=feed.grad_accum_steps
    )
    return Run(
        task=task,
        spec=spec,
        state=state,
        train_fn=train_fn,
        eval_fn=eval_fn,
        c0_pass_fn=c0_pass_fn,
        mesh=mesh,
        model=model,
        tokenizer=tokenizer,
        hidden_size=hidden_size,
        train_encoded=train_encoded,
        dev_encoded=dev_encoded,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
    )


def c0_pass(run: Run, state: steps.TrainState, epoch: int):
    """`state` with I-STAR's C0 rebuilt by the explicit pass (SPEC.md §4): eval
    mode, no gradient, `epoch`'s training batches in order until `istar.stabilizer.tokens`
    token vectors (all layers; `penalties.estimate_c0`) of the run's `specs.ObjectiveSpec`."""
    replicated = NamedSharding(run.mesh, P())
    feed = run.spec.feed
    acc = penalties.estimate_c0(
        lambda acc, batch: run.c0_pass_fn(state, distributed.global_batch(batch, run.mesh), acc),
        feeds.train_batches(  # micro-batches under accumulation: a device holds those
            run.train_encoded, feed, epoch, mesh=run.mesh, batch_size=feed.micro_batch_size
        ),
        jax.device_put(penalties.c0_pass_init(run.hidden_size), replicated),
        num_points=run.spec.state.objective.istar.stabilizer.tokens,
    )
    c0 = jax.jit(penalties.c0_pass_finalize, out_shardings=replicated)(acc)
    c0 = jax.device_put(c0, state.stabilizer["c0"].sharding)  # FSDP may split it
    return state.replace(stabilizer=istar.replace_c0(state.stabilizer, c0))


class EpochEnd(NamedTuple):
    """Where `Loop.train_epoch` stopped: the state and step after its last update, whether the
    epoch's last batch was trained (`epoch_done`), and whether a signal ended it early
    (`stopped`)."""

    state: Any
    step: int
    epoch_done: bool
    stopped: bool


@dataclasses.dataclass
class Loop:
    """What `train_and_evaluate` holds while it trains, in one place: the run (with its
    `spec`) and its folder, the log, the throughput meter, the two checkpointers, the position
    (epoch, batch, summed step metrics, dev results), the two stops (`loss_watch`, `watch`),
    the profiler window and the compiled steps. `epochs` is the loop; the methods below it are its
    steps, in the order it calls them. Only the loop drives the meter; the log receives the
    figures; the position moves only through its own methods (`add_step`, `note_eval`)."""

    run: Run
    workdir: pathlib.Path
    lead: bool
    log: reporting.RunLog
    meter: throughput.Meter | None
    ckpt: checkpointing.Checkpointer
    best_ckpt: checkpointing.Checkpointer
    position: Position
    loss_watch: stops.LossWatch
    watch: stops.Watch
    profile: throughput.Window | None
    stamp: dict  # the config saved with each checkpoint, checked on restore
    executables: dict = dataclasses.field(default_factory=dict)  # batch shapes -> the step

    @classmethod
    def open(cls, run: Run, workdir: pathlib.Path, lead: bool, watch) -> tuple[Loop, Any]:
        """The run's `Loop` and the state it starts from (the newest usable checkpoint's, or
        step 0's): checkpointers, restore, log, throughput meter, non-finite watch, profiler."""
        spec = run.spec.loop
        ckpt, best_ckpt = resume.checkpointers(workdir, spec.keep_checkpoints)
        state, position = resume.restore(ckpt, run.state, workdir, lead, run.spec.fields)
        profile = None
        if spec.profile_steps is not None:
            profile = throughput.Window(workdir, *spec.profile_steps, enabled=lead)
        loss_watch = stops.LossWatch(spec.max_nonfinite_steps, state.loss_scale, workdir, lead)
        loop = cls(
            run=run,
            workdir=workdir,
            lead=lead,
            log=reporting.run_log(run, workdir, lead),
            meter=throughput.run_meter(run, lead),
            ckpt=ckpt,
            best_ckpt=best_ckpt,
            position=position,
            loss_watch=loss_watch,
            watch=watch,
            profile=profile,
            stamp=run_folder.config_stamp(run.spec.fields),
        )
        return loop, state

    def epochs(self, state) -> tuple[Any, int]:
        """The epoch loop, from the position to the run's end: per epoch the C0 pass, the
        training steps, the dev evaluation and the checkpoints; every stop through the watch
        (`stops.Watch.requested`). Returns the last state and step."""
        run, position = self.run, self.position
        objective = run.spec.state.objective
        c0_each_epoch = objective.penalty == "istar" and objective.istar.stabilizer.kind == "pass"
        num_epochs = -(-run.total_steps // run.steps_per_epoch)
        step = int(state.step)
        while step < run.total_steps and position.epoch < num_epochs:
            if c0_each_epoch and position.batch == 0:
                state = self.c0_pass(state, position.epoch)
            counters = stops.running_counters(state.batch_stats) if position.batch == 0 else None
            state, step, epoch_done, stopped = self.train_epoch(state, step)
            if stopped:
                self.loss_watch.check(step, position.epoch, before="checkpointing")
                self.save_and_exit(step, state)
            if epoch_done and counters is not None:
                stops.check_running(counters, state.batch_stats, position.epoch, step)
            self.evaluate_and_save(state, step, epoch_done)
            # Noticed during the evaluation or the save: the same answer on every process.
            if self.watch.requested(step) and step < run.total_steps:
                self.save_and_exit(step, state)
        return state, step

    def c0_pass(self, state, epoch: int):
        """`state` with C0 rebuilt by the explicit pass (`c0_pass`), its time not the steps'."""
        state = c0_pass(self.run, state, epoch)
        if self.meter is not None:
            jax.block_until_ready(state)
            self.meter.mark()
        return state

    def train_epoch(self, state, step: int) -> EpochEnd:
        """Trains from the position to the end of its epoch or of the run. After each step:
        the position (`Position.add_step`), the log, the non-finite watch; a checkpoint
        every `checkpoint_every` steps (`specs.LoopSpec`; not at the epoch's end); a requested
        stop ends the epoch early."""
        run, position = self.run, self.position
        feed, spec = run.spec.feed, run.spec.loop
        epoch_done = position.batch == run.steps_per_epoch
        batches = feeds.update_batches(
            run.train_encoded, feed, position.epoch, position.batch, mesh=run.mesh
        )
        for batch in batches:
            batch = distributed.global_batch(batch, run.mesh, stacked=feed.grad_accum_steps > 1)
            executable = self.compiled(state, batch)
            state, step_metrics = executable(state, batch)
            step += 1
            self.after_step(step, state)
            counts = {} if self.meter is None else self.meter.counts()
            epoch_done = position.add_step(step_metrics | counts, run.steps_per_epoch)
            self.log_step(step)
            self.loss_watch.update(step, step_metrics["loss"])
            if step % spec.log_every == 0 or step == run.total_steps or epoch_done:
                self.loss_watch.check(step, position.epoch)
            if self.watch.requested(step) and step < run.total_steps:
                return EpochEnd(state, step, epoch_done, stopped=True)
            if step == run.total_steps or epoch_done:
                break
            if spec.checkpoint_every and step % spec.checkpoint_every == 0:
                self.loss_watch.check(step, position.epoch, before="checkpointing")
                self.save(step, state)
        return EpochEnd(state, step, epoch_done, stopped=False)

    def compiled(self, state, batch: dict) -> Callable:
        """The train step for `batch`'s shapes: with the meter, compiled here ahead of its
        first call (once per shape), so that the meter reads its cost (FLOPs, memory); else
        the jitted step."""
        if self.meter is None:
            return self.run.train_fn
        key = tuple((k, v.shape) for k, v in batch.items())
        if key not in self.executables:
            self.executables[key] = self.run.train_fn.lower(state, batch).compile()
        self.meter.read(key, self.executables[key], batch["input_ids"].shape)
        return self.executables[key]

    def after_step(self, step: int, state) -> None:
        """The meter's timing and the profiler window, after each training step."""
        if self.meter is not None:
            self.meter.step(state)
        if self.profile is not None:
            self.profile.step(step, state)

    def log_step(self, step: int) -> None:
        """The progress line; on a log step (`RunLog.due`) the window's step-metric means
        (`Position.pop_means`), with the meter's rates in place of its counts."""
        means = None
        if self.log.due(step):
            means = self.position.pop_means()
            if self.meter is not None:
                means = self.meter.window(means)
        self.log.train(step, self.position.epoch, means)

    def evaluate_and_save(self, state, step: int, epoch_done: bool) -> None:
        """The dev evaluation of `step`, the best checkpoint (replaced: never a silent no-op)
        when it is the best so far, then the latest one."""
        position = self.position
        self.loss_watch.check(step, position.epoch, before="evaluating")
        run = self.run
        results = evaluation.evaluate_all(
            run, run.dev_encoded, state, step, position.epoch + 1, self.log
        )
        split = run.task.dev_splits[0]
        if position.note_eval(results, split, epoch_done=epoch_done):
            # before the latest, so a resumed run never claims a best it lacks
            self.best_ckpt.save(step, state, position.to_json() | self.stamp)
        self.save(step, state)

    def save(self, step: int, state) -> None:
        """The checkpoint of `step` with the position (the save's time is not the steps').
        A checkpoint of `step` saved with another position (a preemption at an epoch's last
        step, before its evaluation) is replaced, so the newest one never says "not
        evaluated" of an epoch that was."""
        self.ckpt.save(step, state, self.position.to_json() | self.stamp)
        if self.meter is not None:
            self.meter.mark()

    def save_and_exit(self, step: int, state) -> None:
        """Preemption: the checkpoint of `step` (a second signal is ignored meanwhile), one
        line naming it, then `stops.Preempted` (exit status 75; the caller's `finally`
        closes the writers and the profiler window)."""
        self.watch.saving = True
        self.save(step, state)
        where = str(self.ckpt.directory / str(step))
        stopped = stops.Preempted(step, where, self.watch.signal_name)
        if self.lead:
            logger.warning(stopped.line())
        raise stopped

    def results(self, state, step: int) -> dict:
        """The run's results: the last dev evaluation's, and the best one's (None, with a
        warning, when `best_checkpoint/` lacks its step: it was deleted)."""
        position = self.position
        last_eval = position.last_eval
        if last_eval is None:  # nothing to train (a finished run without results)
            last_eval = evaluation.evaluate_all(
                self.run, self.run.dev_encoded, state, step, position.epoch, None
            )
        best = position.best
        if best is not None and best["step"] not in self.best_ckpt.all_steps():
            logger.warning(
                "isojax: %s lacks the best dev epoch's step %d (deleted?): results.json names "
                "no best",
                self.best_ckpt.directory,
                best["step"],
            )
            best = None
        return last_eval | {"best": best}

    def close(self) -> None:
        """Closes the profiler window, the log and the checkpointers."""
        if self.profile is not None:
            self.profile.close()
        self.log.close()
        self.ckpt.close()
        self.best_ckpt.close()
