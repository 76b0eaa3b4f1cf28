"""Throughput of the training loop, per `log_every` window: step time, tokens/s, examples/s,
model FLOPs per step, MFU; the compiled step's memory at start.

    meter = throughput.Meter(run.mesh, compute_dtype, peak_override=None)
    for batch in ...:
        compiled = compiled_by_shape[key]   # the loop's `train_fn.lower(...).compile()`
        meter.read(key, compiled, batch["input_ids"].size)
        state, metrics = compiled(state, batch)
        position.add_step(metrics | meter.counts(), steps_per_epoch)
        meter.step(state)                   # host-side only
    figures = meter.window(means)           # at a log step, after the means' host sync
    meter.mark()                            # after an evaluation or a checkpoint (not counted)

Each new batch shape (a length bucket, a packed row bucket) is compiled once ahead of its
first call, `train_fn.lower(state, batch).compile()` (the program `jax.jit` would compile for
the call; the loop then runs that executable for every batch of the shape), which gives its
FLOPs (`hardware.step_flops`, one device's program) and its memory: the first shape's memory
line is printed, and a shape that cannot fit the device stops the run before it runs
(`hardware.memory_line`). A shape's first run is left out of the window's rates. Real
tokens and examples are the step's own metrics
(`steps.train_step`: `real_tokens`, `examples`, global counts from the sharded batch), so
every process agrees without a host collective; padded tokens are the batch's token slots and
FLOPs the compiled shape's, added to the same sums (`counts`).

A window's figures (its steps ran between two host synchronisations: the log step's means,
or `mark` after an evaluation or a save, which synchronise too):
  step_time_s            wall time of the window / its steps;
  examples_per_s, real_tokens_per_s, padded_tokens_per_s   the window's counts / its time;
  flops_per_step         model FLOPs of one step over all devices (per device x devices),
                         the mean over the log window's steps (shapes differ by bucket);
                         not a time: a resumed run logs the uninterrupted run's;
  mfu                    per-device FLOPs / step time / the device's peak (absent when the
                         peak is unknown: `hardware.peak_flops` says why, once, at start).
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from isojax.training import hardware

logger = logging.getLogger(__name__)

COUNT_KEYS = ("examples", "real_tokens", "padded_tokens")  # per-step counts -> rates
# The figures that depend on the wall clock (a resumed run's differ; flops_per_step does not).
TIMED_KEYS = ("step_time_s", "examples_per_s", "real_tokens_per_s", "padded_tokens_per_s", "mfu")


class Meter:
    """Per-window throughput of the train step the loop runs (see the module doc). The loop
    compiles the step; the meter reads the compiled step's cost (`read`) and times the steps.

    Args:
      mesh: the step's devices (FLOPs are per device; the step's over the mesh is that x
        mesh.size).
      compute_dtype: the step's compute dtype (picks the peak).
      peak_override: `config.peak_flops`, FLOP/s of one device; None: `hardware.PEAK_FLOPS`.
      loop_trips: micro-batches per step (`config.grad_accum_steps`; see `hardware`).
      verbose: log the memory and peak lines (process 0).
    """

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        compute_dtype,
        *,
        peak_override: float | None = None,
        loop_trips: int = 1,
        verbose: bool = True,
    ):
        self.mesh, self.loop_trips, self.verbose = mesh, loop_trips, verbose
        self.device = mesh.devices.flat[0]
        self.peak, why = hardware.peak_flops(self.device.device_kind, compute_dtype, peak_override)
        self._costs: dict[tuple, tuple] = {}  # batch shapes -> (FLOPs/device, token slots)
        self._new, self._key = False, None
        self._steps = 0
        self._start = time.perf_counter()
        if verbose:
            line = f"peak {self.peak:.4g} FLOP/s per device ({why})" if self.peak else why
            logger.info("isojax: MFU: %s", line)

    def read(self, key: tuple, compiled, slots: int) -> None:
        """Reads the cost of `compiled`, the step the loop runs next, for batch shapes `key`
        with `slots` token slots: its FLOPs; for the first shape the memory line and check
        (`hardware.memory_line` raises if it cannot fit). A shape's first run is left out of
        the rates."""
        if key not in self._costs:
            line = hardware.memory_line(compiled, self.device)
            if not self._costs and self.verbose:
                logger.info("isojax: %s", line)
            self._costs[key] = (hardware.step_flops(compiled, self.loop_trips), slots)
            self._new = True
        self._key = key

    def counts(self) -> dict[str, np.float32]:
        """The counts of the step last `read`, for the step metrics' sums
        (`resume.Position.add`, checkpointed with them, so a resumed window's means are the
        uninterrupted one's): `flops_per_step` (all devices; absent when XLA gives none) and
        `padded_tokens` (the batch's token slots), float32 as the device metrics."""
        flops, padded = self._costs[self._key]
        out = {"padded_tokens": np.float32(padded)}
        if flops is not None:
            out["flops_per_step"] = np.float32(flops * self.mesh.size)
        return out

    def step(self, state) -> None:
        """Times the step last `read`, which returned `state`."""
        if self._new:  # a shape's first run: left out of the rates
            self._new = False
            jax.block_until_ready(state)
            self.mark()
            return
        self._steps += 1

    def mark(self) -> None:
        """Starts timing anew now (the time since the last log step is not counted)."""
        self._steps, self._start = 0, time.perf_counter()

    def window(self, means: dict[str, float]) -> dict[str, float]:
        """`means` (the log window's step-metric means, after their host sync) with the counts
        (`COUNT_KEYS`) replaced by rates over the window's timed steps; starts the next."""
        seconds, steps = time.perf_counter() - self._start, self._steps
        out = {k: v for k, v in means.items() if k not in COUNT_KEYS}
        if steps and seconds > 0:
            step_time = seconds / steps
            out["step_time_s"] = step_time
            for name in COUNT_KEYS:
                if name in means:
                    out[f"{name}_per_s"] = means[name] / step_time
            if "flops_per_step" in means:
                value = hardware.mfu(means["flops_per_step"] / self.mesh.size, step_time, self.peak)
                if value is not None:
                    out["mfu"] = value
        self.mark()
        return out
