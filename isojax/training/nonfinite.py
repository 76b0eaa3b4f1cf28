"""Stopping a run whose training loss stays non-finite, before it reports a score.

In float32 and bfloat16 no loss scale skips a step with non-finite gradients: one NaN update
turns the parameters into NaN, every later loss is NaN, and the run would end with exit status
0 and the dev score of a constant prediction. `LossWatch` counts consecutive non-finite losses
on the device (one tiny jitted update per step, no host sync) and looks at the count only where
the loop synchronises anyway:

- at each log line (every `config.log_every` steps, and at an epoch's or the run's end) it
  stops the run once the loss has been non-finite for `config.max_nonfinite_steps`
  consecutive steps;
- before an evaluation or a checkpoint it stops the run while the loss is non-finite at all,
  so a NaN model is never scored, and never checkpointed over the last good state.

The stop writes `results.json` as `{"stopped": "non-finite loss", "error", "step", "epoch",
"nonfinite_from_step", "nonfinite_steps"}` (no dev metrics) and raises `NonFiniteLoss`;
`isojax finetune` prints its one line and exits with `EXIT_STATUS` (3). Under float16's dynamic
loss scale a skipped step is the scale working (`precision.DynamicLossScale`), and the watch is
off; `max_nonfinite_steps = None` turns it off everywhere.

A run whose normaliser refused every training batch of an epoch (its bad-batch guard: too few
rows, or non-finite statistics; the `count`/`skipped` counters of its `batch_stats`) is
stopped too, at that epoch's end, with `NormalizerStalled` (same exit status, no score): its
running statistics never moved, and its output was a constant.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from isojax.training import precision

EXIT_STATUS = 3  # `isojax finetune`'s status for a run stopped on a non-finite loss
STOPPED = "non-finite loss"  # results.json's "stopped" value


class NonFiniteLoss(RuntimeError):
    """The training loss stayed non-finite (one-line message: the steps, the limit, what to
    check)."""


@jax.jit
def _count(counts: jax.Array, loss: jax.Array, step: jax.Array) -> jax.Array:
    """`[streak, longest, longest's first step]` int32 after the loss of update `step`."""
    streak = jnp.where(jnp.isfinite(loss), 0, counts[0] + 1)
    longer = streak > counts[1]
    longest = jnp.where(longer, streak, counts[1])
    start = jnp.where(longer, step - streak + 1, counts[2])
    return jnp.stack([streak, longest, start]).astype(jnp.int32)


class LossWatch:
    """Consecutive non-finite training losses of one run (see the module docstring).

    Args:
      limit: `config.max_nonfinite_steps` (>= 1), or None: never stop.
      loss_scale: the train state's loss scale; a `DynamicLossScale` turns the watch off.
      workdir: where the stop writes `results.json`; `lead`: whether this process writes.
    """

    def __init__(self, limit: int | None, loss_scale, workdir: pathlib.Path, lead: bool):
        dynamic = isinstance(loss_scale, precision.DynamicLossScale)
        self.limit = None if dynamic else limit
        self.workdir, self.lead = pathlib.Path(workdir), lead
        self._counts = jnp.zeros([3], jnp.int32)

    def update(self, step: int, loss: jax.Array) -> None:
        """Counts the loss of update `step` (1-based), on the device."""
        if self.limit is not None:
            self._counts = _count(self._counts, loss, jnp.int32(step))

    def check(self, step: int, epoch: int, *, before: str | None = None) -> None:
        """Raises `NonFiniteLoss` (after writing `results.json`) when the longest streak has
        reached the limit, or, `before` an evaluation or a checkpoint, when the last loss was
        non-finite at all."""
        if self.limit is None:
            return
        streak, longest, start = (int(v) for v in jax.device_get(self._counts))
        if longest < self.limit and not (before and streak):
            return
        steps, first = (longest, start) if longest >= self.limit else (streak, step - streak + 1)
        message = (
            f"training loss non-finite for {steps} consecutive step(s) from step {first} "
            f"(max_nonfinite_steps {self.limit}"
            + (f"; not {before} a NaN model" if before and longest < self.limit else "")
            + f"); run stopped at step {step}, no score reported "
            f"({self.workdir / 'results.json'}); check the learning rate, the tokenizer and "
            "the data"
        )
        if self.lead:
            record = {
                "stopped": STOPPED,
                "error": message,
                "step": step,
                "epoch": epoch,
                "nonfinite_from_step": first,
                "nonfinite_steps": steps,
            }
            (self.workdir / "results.json").write_text(json.dumps(record, indent=2) + "\n")
        raise NonFiniteLoss(message)


def stopped(workdir: str | pathlib.Path) -> dict | None:
    """The stop record of a run folder's `results.json`, None if it records no stop (or
    there is none)."""
    path = pathlib.Path(workdir) / "results.json"
    if not path.is_file():
        return None
    results = json.loads(path.read_text())
    return results if results.get("stopped") == STOPPED else None


class NormalizerStalled(RuntimeError):
    """The normaliser skipped every training batch of an epoch (one-line message)."""


def running_counters(batch_stats) -> dict[str, tuple[int, int]]:
    """`{module path: (count, skipped)}` of each running-statistics module in `batch_stats`
    (one host sync of those scalars alone)."""
    found = {}

    def walk(tree, path: str) -> None:
        if "count" in tree and "skipped" in tree:
            found[path or "."] = (tree["count"], tree["skipped"])
        for name, child in tree.items():
            if isinstance(child, Mapping):
                walk(child, f"{path}/{name}" if path else name)

    if isinstance(batch_stats, Mapping):
        walk(batch_stats, "")
    return {path: (int(c), int(s)) for path, (c, s) in jax.device_get(found).items()}


def check_running(before: dict, batch_stats, epoch: int, step: int) -> None:
    """Raises `NormalizerStalled` when a module of `batch_stats` applied no update since
    `before` (`running_counters` at the epoch's start) and skipped batches."""
    for path, (count, skipped) in running_counters(batch_stats).items():
        count0, skipped0 = before.get(path, (0, 0))
        if count == count0 and skipped > skipped0:
            raise NormalizerStalled(
                f"the normaliser's running statistics ({path}) skipped all "
                f"{skipped - skipped0} training batches of epoch {epoch + 1} (step {step}): "
                "too few rows per micro-batch, or non-finite statistics; no score reported"
            )
