"""Save on preemption: SIGTERM or SIGINT ends a run at a step boundary with a checkpoint there.

    with preemption.Watch() as watch:
        for batch in ...:
            state = train_fn(state, batch); step += 1
            if watch.requested(step):   # every process answers the same at the same step
                save(step, state)
                raise preemption.Preempted(step, checkpoint_path, watch.signal_name)

Spot and preemptible TPU VMs, Kubernetes and SLURM send SIGTERM some seconds before they kill a
job. `loop.train_and_evaluate` runs its loop inside a `Watch`: the step running when the signal
arrives finishes, the checkpoint of that step is written at exactly that position (epoch, batch
within the epoch, the partial sums of the log window: `resume.Position`), the writers are
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

import logging
import signal
import threading

logger = logging.getLogger(__name__)

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
    """Whether this process runs JAX's distributed runtime with its preemption service."""
    from jax._src import distributed

    state = distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


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
