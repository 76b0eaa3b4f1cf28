"""A run folder's model, restored: encoder, normaliser with its running statistics, and head.

    restored = runs.restore("runs/rte-isobn")               # the newest checkpoint
    restored = runs.restore("runs/rte-isobn", best=True)    # the best dev epoch's
    logits, _ = restored.apply(restored.variables, ids, mask, types)

A run folder (`loop.train_and_evaluate`) holds `config.json`, the newest checkpoints in
`checkpoints/` and the best dev epoch's in `best_checkpoint/` (`run_folder.LATEST_DIR`,
`run_folder.BEST_DIR`). The classifier is rebuilt from the config exactly as the run built it
(`build.build_model` and `build.train_state`, the build the loop runs, only its shapes, by
the run's front end; an NNX run folder written by isojax 0.4.0, whose checkpoints hold linen's
tree, is converted to NNX's as it is read: `steps.TrainState.older_layouts`),
placed on the same kind of mesh, and the whole train state is read back by the
`checkpointing.Checkpointer` that wrote it, so a config or code change that alters an array
is named, not papered over. `isojax export`, `isojax predict` and `isojax analyze --run` start
here.

`config.json` is not trusted alone: a key that no config has is refused, and the config is
compared with the one saved inside the checkpoint (`run_folder.check_stamp`), so an edit that
changes the run (`sentence` pooled -> cls, `max_length`, ...) is refused with the field named
instead of moving the scores silently. A checkpoint written before isojax saved its config
there is restored with a logged warning that nothing could be compared. A restore only reads:
a damaged newest checkpoint is skipped for the one before it, and no file of the run folder is
renamed or written (`checkpointing.Checkpointer(read_only=True)`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pathlib
from collections.abc import Callable

import jax
import ml_collections
from flax import traverse_util

from isojax.data import tasks
from isojax.training import build, checkpointing, distributed, front_ends, run_folder, specs, steps
from isojax.training import config as config_lib

logger = logging.getLogger(__name__)


class RunNotRestorable(ValueError):
    """A run folder without its config or the asked-for checkpoint (one-line message)."""


@dataclasses.dataclass(frozen=True)
class Restored(build.Classifier):
    """A run's classifier at one checkpoint: the record the loop builds (`build.Classifier`:
    task, spec, model, tokenizer, state on `mesh` (default every device, as the run),
    `eval_fn`, hidden size), restored, with where it comes from.

    Attributes:
      run_dir: the run folder.
      config: the run's configuration (`config.json` over `config.default_config()`,
        validated), what `spec` was built from and what a model card describes.
      checkpoint: "latest", "best" or "step N": which checkpoint this is.
      position: the `position.Position` saved with it (JSON: epoch, batch, last_eval, best).
    """

    run_dir: pathlib.Path
    config: ml_collections.ConfigDict
    checkpoint: str
    position: dict

    @property
    def step(self) -> int:
        return int(self.state.step)

    @property
    def variables(self) -> dict:
        """`{'params': ..., 'batch_stats': ...}` for `apply`, in the run's front end's tree
        (linen's collections, `{}` for a normaliser without running statistics; or NNX's
        `nnx.State`s)."""
        return {"params": self.state.params, "batch_stats": self.state.batch_stats}

    @functools.cached_property
    def apply(self) -> Callable:
        """`model` (this record's: a `dataclasses.replace` may swap it) called as linen's
        `model.apply` is, run by the run's front end (`front_ends.LinenApply`: `model.apply`;
        `front_ends.NnxApply`: the NNX modules merged from `variables`), its outputs as the
        modules return them."""
        state = self.spec.state
        return front_ends.get(state.front_end).apply(self.model, None, state.rng_impl)

    def linen_twin(self) -> tuple:
        """`(linen SequenceClassifier, its variables)` with this checkpoint's weights, on the
        host: the run's own for linen, the NNX classifier's linen twin
        (`isojax.nnx.export.to_linen`) for NNX; what `isojax export` writes."""
        module, variables = self.apply.to_linen(self.variables)
        return module, jax.device_get(variables)

    @property
    def evaluation(self) -> dict | None:
        """The run's own dev evaluation of this checkpoint (`{"step", "epoch", split: {...}}`),
        when it was taken at this step (epoch ends, the best checkpoint); None otherwise."""
        last = self.position.get("last_eval")
        return last if last is not None and last.get("step") == self.step else None


def is_run_folder(path: str | pathlib.Path) -> bool:
    """Whether `path` holds a run (`loop.train_and_evaluate`'s files): checkpoints, a
    metrics log, results, or an isojax `config.json` (one with a task and a normaliser, or
    a method: an older run)."""
    path = pathlib.Path(path)
    if any((path / name).exists() for name in (run_folder.LATEST_DIR, run_folder.BEST_DIR)):
        return True
    if any((path / name).is_file() for name in ("metrics.jsonl", "results.json")):
        return True
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return run_folder.is_run_config(saved)


# What a run folder holds of its own: `predict` and `export` never write there.
RUN_FILES = (
    "config.json",
    "metrics.jsonl",
    "results.json",
    run_folder.LATEST_DIR,
    run_folder.BEST_DIR,
)


def run_owning(path: str | pathlib.Path) -> pathlib.Path | None:
    """The run folder (`is_run_folder`) of which `path` is one of its own files (`RUN_FILES`)
    or lies under its checkpoint folders; None when `path` is no run's file (a predictions
    file beside a run's own files is not one)."""
    path = pathlib.Path(path).resolve()
    for folder in path.parents:
        if path.relative_to(folder).parts[0] in RUN_FILES and is_run_folder(folder):
            return folder
    return None


def _unknown_fields(saved: dict) -> list[str]:
    """Flat keys of `saved` that `config.default_config()` has not (a free-form sub-config,
    `normalizer_kwargs`, takes any key)."""
    known = config_lib.flatten(json.loads(config_lib.default_config().to_json()))
    unknown = []
    for key in config_lib.flatten(saved):
        parts = key.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts)))
        if key not in known and not any(known.get(p) == {} for p in prefixes):
            unknown.append(key)
    return sorted(unknown)


def load_config(run_dir: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The run's `config.json` over `config.default_config()` (fields a newer isojax added keep
    their defaults; a renamed one is read under its new path, `config.translate`), validated.

    Raises:
      RunNotRestorable: no `config.json`, or one that is not valid JSON or not a valid config;
        one naming a field an older isojax had and this one has not (`config.RENAMED`: split
        or removed) names it; a key that no config has (a typo) is named.
    """
    path = pathlib.Path(run_dir) / "config.json"
    if not path.is_file():
        raise RunNotRestorable(f"{path.parent}: not a run folder (no config.json)")
    try:
        saved = json.loads(path.read_text())
        flat = config_lib.flatten(saved)
        translated = config_lib.translate(flat)
        if translated != flat:  # renamed paths, read under their new names
            saved = traverse_util.unflatten_dict(translated, sep=".")
        removed = sorted(set(translated) & set(config_lib.RENAMED))
        if removed:
            raise ValueError(
                f"written by an older isojax: field {removed[0]!r} is now "
                f"{config_lib.RENAMED[removed[0]]}"
            )
        unknown = _unknown_fields(saved)
        if unknown:
            raise ValueError(f"unknown config field(s) {', '.join(map(repr, unknown))}")
        config = config_lib.default_config()
        config.update(saved)
        config_lib.validate_config(config)
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise RunNotRestorable(f"{path}: {str(err).splitlines()[0]}") from None
    return config


def _checkpoints(run_dir: pathlib.Path, step: int | None, best: bool) -> tuple[pathlib.Path, str]:
    """The checkpoint folder to read and the name of the choice; refuses an empty one."""
    if best and step is not None:
        raise RunNotRestorable("choose a step or the best checkpoint, not both")
    folder = run_dir / (run_folder.BEST_DIR if best else run_folder.LATEST_DIR)
    if not any(p.name.isdigit() for p in (folder.iterdir() if folder.is_dir() else ())):
        what = "best dev checkpoint" if best else "checkpoint"
        raise RunNotRestorable(f"{run_dir}: no {what} in {folder}")
    return folder, "best" if best else ("latest" if step is None else f"step {step}")


def restore(
    run_dir: str | pathlib.Path,
    *,
    step: int | None = None,
    best: bool = False,
    mesh: jax.sharding.Mesh | None = None,
) -> Restored:
    """The run's classifier at its newest checkpoint, at `step`, or at the best dev epoch.

    Args:
      run_dir: a folder written by `loop.train_and_evaluate` (`isojax finetune --workdir`).
      step: a saved step of `checkpoints/` (the newest `keep_checkpoints` are kept).
      best: the checkpoint with the best dev score (`best_checkpoint/`).
      mesh: the devices (`distributed.make_mesh`); default every device, as the run used, so
        that evaluation reproduces the run's numbers exactly.

    A run trained with `attention_backend` "cudnn" is restored with "auto" (the kernel is a
    property of where it runs, not of what was learnt): on a CPU it runs on XLA.

    Raises:
      RunNotRestorable: no config.json; no checkpoint at all (or no best one, or none at
        `step`: the message lists the saved steps); unreadable checkpoint files. One line.
      checkpointing.CheckpointMismatch: the checkpoint holds other arrays than this config
        builds (a changed config or code).
        Also: `config.json` differs from the config saved with the checkpoint in a field
        that changes the run (the message names each, `run_folder.ConfigChanged`'s words).
    """
    run_dir = pathlib.Path(run_dir)
    config = load_config(run_dir)  # validated: the boundary of a restore
    spec = specs.RunSpec.of(config)
    if spec.model.attention_backend == "cudnn":  # a runtime choice: "auto" wherever restored
        spec = dataclasses.replace(
            spec, model=dataclasses.replace(spec.model, attention_backend="auto")
        )
    folder, checkpoint = _checkpoints(run_dir, step, best)
    task = tasks.get_task(spec.data.task)
    module, _, tokenizer, hidden_size = build.build_model(
        spec.model, task.num_labels, front_end=spec.state.front_end
    )
    mesh = distributed.make_mesh() if mesh is None else mesh
    # The schedule's length and a running stabiliser's window hold no array: one step.
    abstract = build.train_state(
        spec.state,
        task,
        module,
        None,
        hidden_size,
        mesh,
        steps_per_epoch=1,
        total_steps=1,
        abstract=True,
    )
    with checkpointing.Checkpointer(folder, read_only=True) as ckpt:
        try:
            state, position = ckpt.restore(abstract, step=step)
        except (checkpointing.CheckpointNotFound, RuntimeError) as err:
            raise RunNotRestorable(f"{run_dir}: {err}") from None
    where = f"checkpoint step {int(state.step)} in {folder}"
    try:
        stamped = run_folder.check_stamp(position.pop("config", None), spec.fields, where)
    except run_folder.ConfigChanged as err:
        raise RunNotRestorable(str(err)) from None
    if not stamped:
        logger.warning(
            "%s was saved without its config (isojax before config stamps): %s is trusted as it is",
            where,
            run_dir / "config.json",
        )
    _, eval_fn, _ = steps.jit_steps(state, mesh, fsdp=spec.state.fsdp)
    return Restored(
        task=task,
        spec=spec,
        model=module,
        tokenizer=tokenizer,
        state=state,
        mesh=mesh,
        eval_fn=eval_fn,
        hidden_size=hidden_size,
        run_dir=run_dir,
        config=config,
        checkpoint=checkpoint,
        position=position,
    )
