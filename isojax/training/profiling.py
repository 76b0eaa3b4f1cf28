"""A profiler window: a `jax.profiler` trace of training steps `start` to `stop`.

    config.profile_steps = (10, 15)    # steps 11..15 (after update 10, up to update 15)
    # -> <workdir>/profile/plugins/profile/<time>/<host>.xplane.pb (TensorBoard's profile
    #    plugin: tensorboard --logdir <workdir>/profile; Perfetto: the same trace)

The trace starts after step `start` (its state synchronised, so the window holds no earlier
work) and stops after step `stop` once that step's work is done (`jax.block_until_ready`), so
it holds exactly the `stop - start` steps, their host work, transfers and device kernels. Off
(`config.profile_steps = None`, the default) the loop builds no `Window`: nothing is called per
step. A run whose window is not reached (resumed past it, or shorter) writes no trace; a trace
still open when the loop ends is stopped there.
"""

from __future__ import annotations

import pathlib

import jax

PROFILE_DIR = "profile"


def check_steps(steps) -> None:
    """Raises ValueError unless `steps` is None or `(start, stop)` with `0 <= start < stop`."""
    if steps is None:
        return
    if len(steps) != 2 or not 0 <= int(steps[0]) < int(steps[1]):
        raise ValueError(f"profile_steps must be (start, stop) with 0 <= start < stop, got {steps}")


class Window:
    """Starts `jax.profiler` after step `start` and stops it after step `stop`.

    Args:
      workdir: the run folder; the trace goes to `workdir / PROFILE_DIR`.
      start, stop: training steps (updates done), `0 <= start < stop`.
      enabled: False on processes that trace nothing.
    """

    def __init__(self, workdir: pathlib.Path, start: int, stop: int, enabled: bool = True):
        check_steps((start, stop))
        self.directory = pathlib.Path(workdir) / PROFILE_DIR
        self.start, self.stop, self.enabled = int(start), int(stop), enabled
        self.tracing = False

    def step(self, step: int, state) -> None:
        """After training step `step` returned `state`."""
        if not self.enabled:
            return
        if step == self.start and not self.tracing:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True
        elif step == self.stop and self.tracing:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
