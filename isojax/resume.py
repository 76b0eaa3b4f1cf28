"""Resuming a run: where the loop stands (`Position`), the same-config check, the restore.

A checkpoint holds the train state and a `Position` (JSON): the next (epoch, batch), the step
metrics summed since the last log line, the last dev results and the best ones. A resumed run
ends with the same parameters, metrics and `metrics.jsonl` as an uninterrupted one.

A run folder keeps the newest checkpoints in `checkpoints/` and, beside them, the one with the
best dev score so far in `best_checkpoint/` (the IsoBN protocol's early stopping).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

import jax.numpy as jnp
import ml_collections
import numpy as np

from isojax import checkpointing, steps
from isojax import config as config_lib

LATEST_DIR = "checkpoints"  # the newest `keep_checkpoints` checkpoints of a run folder
BEST_DIR = "best_checkpoint"  # the checkpoint with the best dev score


def host_floats(tree: dict) -> dict[str, float]:
    """`{name: scalar array}` -> `{name: Python float}` (a host sync)."""
    return {k: float(np.asarray(v)) for k, v in tree.items()}


@dataclasses.dataclass
class Position:
    """Where the loop stands, checkpointed beside the state: the next (epoch, batch), the step
    metrics summed since the last log line, the last dev results, and the best dev results
    (`note_eval`)."""

    epoch: int = 0
    batch: int = 0
    train_sums: dict = dataclasses.field(default_factory=dict)
    train_count: int = 0
    last_eval: dict | None = None
    best: dict | None = None

    def note_eval(self, results: dict, split: str) -> bool:
        """Keeps `results` (`{"step", "epoch", split: {..., "score"}}`) as `last_eval`, and as
        `best` when its `split` score (the task's GLUE score) beats the best so far; a tie
        keeps the earlier. Returns whether it is the new best."""
        self.last_eval = results
        if self.best is not None and results[split]["score"] <= self.best[split]["score"]:
            return False
        self.best = results
        return True

    def add(self, step_metrics: dict) -> None:
        """Adds one step's metrics to the sums (on device: no host sync per step)."""
        self.train_sums = {k: self.train_sums.get(k, 0.0) + v for k, v in step_metrics.items()}
        self.train_count += 1

    def pop_means(self) -> dict[str, float]:
        """The means since the last call, and empty sums."""
        means = {k: v / self.train_count for k, v in host_floats(self.train_sums).items()}
        self.train_sums, self.train_count = {}, 0
        return means

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
    "keep_checkpoints", "log_every", "progress", "tensorboard", "remat",
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


def check_same_run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    """Refuses to resume checkpoints in `workdir` with a config that changes the run."""
    saved = workdir / "config.json"
    if not (saved.exists() and (workdir / LATEST_DIR).exists()):
        return
    before = config_lib.flatten(json.loads(saved.read_text()))
    now = config_lib.flatten(json.loads(config.to_json()))
    changed = sorted(
        key
        for key in before.keys() | now.keys()
        if key.split(".")[0] not in _RESUMABLE_CHANGES and before.get(key) != now.get(key)
    )
    if changed:
        raise ValueError(
            f"{workdir} holds checkpoints of a run with another config ({', '.join(changed)} "
            "differ): resume with its config.json, or use a new workdir"
        )


def restore(ckpt, state: steps.TrainState, workdir: pathlib.Path, lead: bool):
    """`(state, Position)` from the newest usable checkpoint, or the fresh ones. A resumed run
    drops the `metrics.jsonl` lines a killed run wrote after that checkpoint."""
    restored = ckpt.restore(state)
    if restored is None:
        return state, Position()
    state, saved = restored
    position = Position(**saved)
    position.train_sums = {k: jnp.asarray(v, jnp.float32) for k, v in saved["train_sums"].items()}
    step = int(state.step)
    path = workdir / "metrics.jsonl"
    if lead and path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        if len(kept) != len(lines):
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(path)
    if lead:
        print(
            f"isojax: resumed {workdir} at step {step} (epoch {position.epoch}, "
            f"batch {position.batch})",
            file=sys.stderr,
        )
    return state, position
