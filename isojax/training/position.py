"""Where the loop stands (`Position`), checkpointed beside the train state.

A checkpoint holds the train state and a `Position` (JSON): the next (epoch, batch), the step
metrics summed since the last log line, the last dev results and the best ones. A resumed run
(`isojax.training.resume`) ends with the same parameters, metrics and `metrics.jsonl` as an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from isojax.training import checkpointing, reporting


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
        means = {k: v / self.train_count for k, v in reporting.host_floats(self.train_sums).items()}
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
            "train_sums": reporting.host_floats(self.train_sums),
            "train_count": self.train_count,
            "last_eval": self.last_eval,
            "best": self.best,
        }
