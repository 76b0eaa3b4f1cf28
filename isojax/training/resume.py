"""Resuming a run: where the loop stands (`Position`), the same-config check, the restore.

A checkpoint holds the train state and a `Position` (JSON): the next (epoch, batch), the step
metrics summed since the last log line, the last dev results and the best ones. A resumed run
ends with the same parameters, metrics and `metrics.jsonl` as an uninterrupted one.

A run folder keeps the newest checkpoints in `checkpoints/` and, beside them, the one with the
best dev score so far in `best_checkpoint/` (the IsoBN protocol's early stopping).

Each checkpoint's position JSON also holds the run's config (`config_stamp`: its fields and
their SHA-256), so that a restore compares the config it is asked to use with the one the state
was trained with (`check_stamp`), not with an editable `config.json`.

`metrics.jsonl` follows the checkpoint: a resumed run drops the lines written after it, a fresh
start (no checkpoint) begins an empty log, and a torn last line (a kill mid-write) is dropped
with a warning.

A run folder is one run's: `check_same_run` refuses a config other than the one of what the
folder holds (checkpoints, the best one, `metrics.jsonl`, `results.json`), and
`hold_run_folder` a second process training in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import socket
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np

from isojax import errors
from isojax.training import checkpointing, steps
from isojax.training import config as config_lib

logger = logging.getLogger(__name__)

LATEST_DIR = "checkpoints"  # the newest `keep_checkpoints` checkpoints of a run folder
BEST_DIR = "best_checkpoint"  # the checkpoint with the best dev score


def host_floats(tree: dict) -> dict[str, float]:
    """`{name: scalar array}` -> `{name: Python float}` (a host sync)."""
    return {k: float(np.asarray(v)) for k, v in tree.items()}


@dataclasses.dataclass
class Position:
    """Where the loop stands, checkpointed beside the state: the next (epoch, batch), the step
    metrics summed since the last log line, the last dev results, and the best dev results.
    It moves only through its methods: `add_step` after each training step, `note_eval`
    after each dev evaluation, `pop_means` at each log line."""

    epoch: int = 0
    batch: int = 0
    train_sums: dict = dataclasses.field(default_factory=dict)
    train_count: int = 0
    last_eval: dict | None = None
    best: dict | None = None

    def add_step(self, step_metrics: dict, steps_per_epoch: int) -> bool:
        """One training step done: the next batch, its metrics added to the sums (on device:
        no host sync per step). Returns whether that was the epoch's last batch."""
        self.batch += 1
        self.train_sums = {k: self.train_sums.get(k, 0.0) + v for k, v in step_metrics.items()}
        self.train_count += 1
        return self.batch == steps_per_epoch

    def note_eval(self, results: dict, split: str, *, epoch_done: bool = False) -> bool:
        """A dev evaluation done: keeps `results` (`{"step", "epoch", split: {..., "score"}}`)
        as `last_eval`, and as `best` when its `split` score (the task's GLUE score) beats the
        best so far (a tie keeps the earlier); with `epoch_done`, the position moves to the
        next epoch's first batch. Returns whether it is the new best."""
        self.last_eval = results
        if epoch_done:
            self.epoch, self.batch = self.epoch + 1, 0
        if self.best is not None and results[split]["score"] <= self.best[split]["score"]:
            return False
        self.best = results
        return True

    def pop_means(self) -> dict[str, float]:
        """The means since the last call, and empty sums."""
        means = {k: v / self.train_count for k, v in host_floats(self.train_sums).items()}
        self.train_sums, self.train_count = {}, 0
        return means

    @classmethod
    def from_json(cls, saved: dict, where: str) -> Position:
        """The position `to_json` saved (`where`: the checkpoint, for the message), its step
        sums on device; `checkpointing.CheckpointMismatch` (one line) for a key it has not."""
        unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise checkpointing.CheckpointMismatch(
                f"{where}: its position holds unknown keys {unknown} (another isojax's or an "
                "edited checkpoint): resume from another checkpoint, or use a new workdir"
            )
        position = cls(**saved)
        sums = saved.get("train_sums") or {}
        position.train_sums = {k: jnp.asarray(v, jnp.float32) for k, v in sums.items()}
        return position

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "train_sums": host_floats(self.train_sums),
            "train_count": self.train_count,
            "last_eval": self.last_eval,
            "best": self.best,
        }


# Fields a resumed run may change: they touch neither the train state nor the data order.
_RESUMABLE_CHANGES = {
    "data_dir", "tfds_data_dir", "eval_batch_size", "max_eval_examples", "checkpoint_every",
    "keep_checkpoints", "log_every", "progress", "tensorboard", "remat", "max_nonfinite_steps",
    "throughput", "peak_flops", "profile_steps",
}  # fmt: skip


def checkpointers(
    workdir: pathlib.Path, keep: int
) -> tuple[checkpointing.Checkpointer, checkpointing.Checkpointer]:
    """The run folder's checkpointers: the newest `keep` steps (`LATEST_DIR`) and the best dev
    epoch's (`BEST_DIR`, one step)."""
    return (
        checkpointing.Checkpointer(workdir / LATEST_DIR, max_to_keep=keep),
        checkpointing.Checkpointer(workdir / BEST_DIR, max_to_keep=1),
    )


class ConfigChanged(ValueError):
    """A checkpoint restored with a config that changes the run (one line naming the fields)."""


def _changed_fields(before: dict, now: dict) -> list[str]:
    """Flat keys whose values differ between two flattened configs, except `_RESUMABLE_CHANGES`
    and fields `before` lacks that `now` holds at their default (added by a newer isojax)."""
    defaults = config_lib.flatten(json.loads(config_lib.default_config().to_json()))
    missing = object()
    return sorted(
        key
        for key in before.keys() | now.keys()
        if key.split(".")[0] not in _RESUMABLE_CHANGES
        and before.get(key, missing) != now.get(key, missing)
        and not (key not in before and key in defaults and now.get(key) == defaults[key])
    )


def config_stamp(fields: dict) -> dict:
    """`{"config": {"sha256", "fields"}}`: the flattened config `fields` (JSON values,
    `specs.RunSpec.fields`) and the SHA-256 of those that change the run (all but
    `_RESUMABLE_CHANGES`), saved with each checkpoint."""
    run = {k: v for k, v in fields.items() if k.split(".")[0] not in _RESUMABLE_CHANGES}
    digest = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()
    return {"config": {"sha256": digest, "fields": fields}}


def check_stamp(stamp: dict | None, fields: dict, where: str) -> bool:
    """Refuses (`ConfigChanged`) to restore the checkpoint `where` whose `config_stamp` differs
    from the flattened config `fields` (`specs.RunSpec.fields`) in a field that changes the
    run, naming each with both values. Returns False for a checkpoint saved without a stamp
    (isojax before stamps: nothing to compare), True when the config is the run's."""
    if stamp is None:
        return False
    if stamp["sha256"] == config_stamp(fields)["config"]["sha256"]:
        return True
    before, now = config_lib.translate(stamp["fields"]), fields  # renamed paths: new names
    changed = _changed_fields(before, now)
    if changed:
        missing = "(absent)"
        shown = "; ".join(
            f"{k}: {before.get(k, missing)!r} -> {now.get(k, missing)!r}" for k in changed[:8]
        )
        raise ConfigChanged(
            f"{where} was trained with another config ({shown}"
            + ("; ..." if len(changed) > 8 else "")
            + "): restore it with the config it was trained with (was config.json edited?)"
        )
    return True


def run_artefacts(workdir: pathlib.Path) -> list[str]:
    """What of a run `workdir` holds: `checkpoints/`, `best_checkpoint/`, a non-empty
    `metrics.jsonl`, `results.json`."""
    found = [f"{name}/" for name in (LATEST_DIR, BEST_DIR) if (workdir / name).is_dir()]
    metrics = workdir / "metrics.jsonl"
    found += ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []
    return found + (["results.json"] if (workdir / "results.json").exists() else [])


def check_same_run(fields: dict, workdir: pathlib.Path) -> None:
    """Refuses (`ConfigChanged`) a `workdir` holding any run artefact (`run_artefacts`) of a
    run with another config than the flattened `fields` (`specs.RunSpec.fields`; its
    `config.json`), or holding some without a `config.json` (unless checkpoints, whose stamps
    `restore` compares); and (`ModelFolderRefused`) one that holds a model, whose
    `config.json` the run's would replace (`check_not_model_folder`)."""
    check_not_model_folder(workdir, "the run's config.json")
    found, saved = run_artefacts(workdir), workdir / "config.json"
    if not found:
        return
    if not saved.exists():
        if f"{LATEST_DIR}/" in found:
            return  # the checkpoints' own config stamps are compared on restore
        raise ConfigChanged(
            f"{workdir} holds a run ({', '.join(found)}) but no config.json to compare this "
            "config with: use a new workdir, or put the run's config.json back"
        )
    before = config_lib.translate(config_lib.flatten(json.loads(saved.read_text())))
    changed = _changed_fields(before, fields)
    if changed:
        raise ConfigChanged(
            f"{workdir} holds a run ({', '.join(found)}) with another config "
            f"({_differ(changed)}): resume with its config.json, or use a new workdir"
        )


def _differ(changed: list[str]) -> str:
    """ "a differs" / "a and b differ" / "a, b and c differ", a key left out when a changed
    key under it names it better (an empty `normalizer_kwargs` against `.iterations`)."""
    keys = [k for k in changed if not any(o.startswith(k + ".") for o in changed)]
    if len(keys) == 1:
        return f"{keys[0]} differs"
    return f"{', '.join(keys[:-1])} and {keys[-1]} differ"


# A model's weights, as transformers, Flax, TensorFlow and others save them.
WEIGHT_FILES = (
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json",
    "*.msgpack", "*.msgpack.index.json", "*.h5", "*.onnx", "*.gguf", "*.pt", "*.pth", "*.ckpt",
)  # fmt: skip


def is_run_config(saved: object) -> bool:
    """Whether a parsed `config.json` is an isojax run's: one with a task and a normaliser, or
    a method (an older run)."""
    return (
        isinstance(saved, dict) and "task" in saved and bool({"normalizer", "method"} & set(saved))
    )


def model_files(folder: pathlib.Path) -> list[str]:
    """What of a model `folder` holds (top level): a `config.json` that is not an isojax run's
    (`is_run_config`; unreadable counts as foreign), then its weight files (`WEIGHT_FILES`)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return []
    found = sorted({p.name for pattern in WEIGHT_FILES for p in folder.glob(pattern)})
    config = folder / "config.json"
    if config.exists():
        try:
            saved = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if not is_run_config(saved):
            found.insert(0, "config.json")
    return found


class ModelFolderRefused(errors.InputError):
    """A destination that holds a model: a foreign `config.json` or weights (one line)."""


def check_not_model_folder(folder: pathlib.Path, writer: str) -> None:
    """Refuses (`ModelFolderRefused`) a `folder` that holds a model (`model_files`), which
    `writer` (what would write there) could write over: nothing is written."""
    found = model_files(folder)
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ModelFolderRefused(
            f"{folder} holds a model ({shown}), not an isojax run: {writer} would write over "
            "it; choose another folder"
        )


class RunFolderBusy(errors.InputError):
    """Another process trains in the run folder (one line naming it)."""


LOCK_FILE = ".isojax_lock"  # `hold_run_folder`'s lock, naming its holder


@contextlib.contextmanager
def hold_run_folder(workdir: pathlib.Path, lead: bool = True) -> Iterator[None]:
    """Holds an exclusive `fcntl.flock` on `workdir/LOCK_FILE` for the block (process 0 of a
    run; the kernel drops it when the holder exits or dies, so it is never stale), or raises
    `RunFolderBusy` naming the process that holds it."""
    if not lead:
        yield
        return
    path = workdir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: it names the holder
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise RunFolderBusy(
                f"{workdir} is in use by {holder}: wait for that run to end, or use another workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"isojax pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def metrics_lines(path: pathlib.Path) -> list[tuple[str, dict]]:
    """`(line, record)` of each line of a `metrics.jsonl`. A torn last line (no newline, or not
    JSON: a kill mid-write) is left out with a logged warning; a bad line before the last
    raises ValueError naming the file and line."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines(keepends=True)
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line) if line.endswith("\n") else None
        except json.JSONDecodeError:
            record = None
        if record is None and number == len(lines):
            logger.warning(
                "%s:%d: dropped a torn last line (a run killed while writing it): %r",
                path,
                number,
                line[:60],
            )
            continue
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{number}: not a metrics record: {line[:60]!r}")
        out.append((line, record))
    return out


def _rewrite_log(path: pathlib.Path, kept: list[str]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def restore(
    ckpt,
    state: steps.TrainState,
    workdir: pathlib.Path,
    lead: bool,
    fields: dict | None = None,
):
    """`(state, Position)` from the newest usable checkpoint, or the fresh ones. A resumed run
    drops the `metrics.jsonl` lines a killed run wrote after that checkpoint (and a torn last
    line); a fresh start begins an empty `metrics.jsonl`. With the flattened config `fields`, a
    checkpoint trained with another config (`check_stamp`) raises `ConfigChanged`."""
    restored = ckpt.restore(state)
    path = workdir / "metrics.jsonl"
    if restored is None:
        if lead and path.exists() and path.stat().st_size:
            logger.warning(
                "isojax: %s has no checkpoint: starting afresh, with a new %s", workdir, path.name
            )
            _rewrite_log(path, [])
        return state, Position()
    state, saved = restored
    stamp = saved.pop("config", None)
    step = int(state.step)
    if fields is not None:
        check_stamp(stamp, fields, f"checkpoint step {step} in {ckpt.directory}")
    position = Position.from_json(saved, f"checkpoint step {step} in {ckpt.directory}")
    if lead and path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line, record in metrics_lines(path) if record["step"] <= step]
        if kept != lines:
            _rewrite_log(path, kept)
    if lead:
        logger.info(
            "isojax: resumed %s at step %d (epoch %d, batch %d)",
            workdir,
            step,
            position.epoch,
            position.batch,
        )
    return state, position
