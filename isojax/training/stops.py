"""The loop's two stops: a training loss that stays non-finite, and preemption (SIGTERM, SIGINT).

Both end a run early with its own exit status and one line, never with a score of a broken
model: `LossWatch` and `check_running` stop a run that is diverging or whose normaliser never
moves (`NonFiniteLoss`, `NormalizerStalled`, `EXIT_STATUS` 3, no checkpoint over the last good
state), and `Watch` ends a run asked to stop at a step boundary, with a checkpoint there
(`Preempted`, `EXIT_PREEMPTED` 75; rerunning resumes).

Non-finite loss. In float32 and bfloat16 no loss scale skips a step with non-finite gradients:
one NaN update turns the parameters into NaN, every later loss is NaN, and the run would end
with exit status 0 and the dev score of a constant prediction. `LossWatch` counts consecutive
non-finite losses on the device (one tiny jitted update per step, no host sync) and looks at the
count only where the loop synchronises anyway:

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

Preemption: SIGTERM or SIGINT ends a run at a step boundary with a checkpoint there.

    with stops.Watch() as watch:
        for batch in ...:
            state = train_fn(state, batch); step += 1
            if watch.requested(step):   # every process answers the same at the same step
                save(step, state)
                raise stops.Preempted(step, checkpoint_path, watch.signal_name)

Spot and preemptible TPU VMs, Kubernetes and SLURM send SIGTERM some seconds before they kill a
job. `loop.train_and_evaluate` runs its loop inside a `Watch`: the step running when the signal
arrives finishes, the checkpoint of that step is written at exactly that position (epoch, batch
within the epoch, the partial sums of the log window: `position.Position`), the writers are
closed, one line on stderr names the checkpoint, and `Preempted` (a `SystemExit` with status
`EXIT_PREEMPTED` = 75, sysexits' EX_TEMPFAIL: "try again later") ends the process. Rerunning
the same command resumes there and ends bit-identical to an uninterrupted run.

One process: a Python handler notes the signal; `requested` reads the note. Several processes
(`jax.distributed`): JAX's distributed runtime already owns SIGTERM (its preemption notifier,
started by `jax.distributed.initialize`); the notice reaches every process through the
coordinator, which picks the step after the largest step any process has reached, and
`jax.experimental.multihost_utils.reached_preemption_sync_point(step)` is True on every process
at that same step, so no host saves a step the others did not. It is a host-side check (no
device synchronisation). SIGINT (Ctrl-C) on one process is turned into that same notice (the
handler raises SIGTERM at the runtime's own handler).

A second signal while the checkpoint is being written is noted and ignored (one line on
stderr), so it cannot interrupt the save; SIGKILL can, and then orbax's atomic commit
(`checkpointing`) leaves the previous checkpoint as the newest. Handlers are installed only
from the main thread, and the previous ones are put back on leaving the `with` block, so a
caller's own handling (the study runner's SIGTERM -> SystemExit) holds outside the loop.
`Preempted` is not an `Exception`, so `except Exception` (the study runner's record of a failed
cell) does not take it for a failure.
"""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import threading
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from isojax.training import precision

logger = logging.getLogger(__name__)


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


EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, rerun to resume
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """A run stopped by a signal after saving the checkpoint of `step` at `path`.

    A `SystemExit` with code `EXIT_PREEMPTED`: uncaught, it ends the process with that status
    (and `isojax finetune` returns it).
    """

    def __init__(self, step: int | None, path: str | None, signal_name: str):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.path, self.signal_name = step, path, signal_name

    def line(self) -> str:
        """The one line naming the checkpoint (or saying that none was needed: a stop before
        the first training step, `step` None)."""
        if self.step is None:
            return (
                f"isojax: {self.signal_name} before the first training step: nothing to save; "
                f"exiting with status {EXIT_PREEMPTED} (rerun the same command to resume)"
            )
        return (
            f"isojax: {self.signal_name}: saved the checkpoint of step {self.step} at "
            f"{self.path}; exiting with status {EXIT_PREEMPTED} (rerun the same command to resume)"
        )


class StopFailed(SystemExit):
    """A requested stop whose checkpoint (or anything after the signal) failed: `error`. A
    `SystemExit` with status 1, not an `Exception`, so that a caller recording failures (the
    study runner) ends too instead of going on with the signal consumed."""

    def __init__(self, signal_name: str, error: BaseException):
        super().__init__(1)
        self.signal_name, self.error = signal_name, error

    def line(self) -> str:
        first = str(self.error).splitlines()[0] if str(self.error) else ""
        return (
            f"isojax: {self.signal_name}: the run could not stop cleanly "
            f"({type(self.error).__name__}: {first}); exiting with status 1"
        )


def _sync_manager_running() -> bool:
    """Whether this process runs JAX's distributed runtime with its preemption service (on by
    default: `jax.distributed.initialize` starts it unless `jax_enable_preemption_service` is
    off)."""
    return jax.distributed.is_initialized() and bool(jax.config.jax_enable_preemption_service)


class Watch:
    """Context manager: notes SIGTERM / SIGINT and answers, per step, whether to stop there.

    Entered before the run is built: until `start()` (the first training step is next), one
    process ends at the signal itself with `Preempted` (nothing to save); several processes
    leave it to the sync point, which stops them all after the first step.

    Args:
      enabled: False: installs nothing and `requested` is always False.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.signal_name: str | None = None
        self.saving = False
        self.started = False
        self._previous: dict = {}
        self._multi = False

    def __enter__(self) -> Watch:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            self.enabled = False
            return self
        self._multi = _sync_manager_running()
        # Several processes: SIGTERM is left to the runtime's notifier (see the module doc).
        for signum in (signal.SIGINT,) if self._multi else SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.saving or self.signal_name is not None:
            logger.warning("isojax: %s again: still saving, ignored", name)
            return
        self.signal_name = name
        if not self.started and not self._multi:
            self._stop_now()
        logger.warning("isojax: %s: finishing this step, then saving a checkpoint", name)
        if self._multi:  # the runtime's notifier spreads it to every process
            signal.raise_signal(signal.SIGTERM)

    def start(self) -> None:
        """The loop's first step is next: from now on a signal is noted, and the run stops
        at a step boundary (before: `Preempted` at once). A signal noted already stops it now."""
        self.started = True
        if self.signal_name is not None and not self._multi:
            self._stop_now()

    def _stop_now(self) -> None:
        """`Preempted` before the first step, its line logged: nothing to save."""
        stopped = Preempted(None, None, self.signal_name)
        logger.warning(stopped.line())
        raise stopped

    def requested(self, step: int) -> bool:
        """Whether to stop after `step` (call it after every step, on every process, with the
        same steps: JAX's sync point needs every step). Several processes: True at the same
        step everywhere once any process was signalled."""
        if not self.enabled:
            return False
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.signal_name = self.signal_name or "SIGTERM"
                return True
            return False
        return self.signal_name is not None
