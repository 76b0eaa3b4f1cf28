"""Run logging: `metrics.jsonl` and TensorBoard scalars (`MetricWriter`; read back by
`metrics_lines`), a progress line on stderr (`Progress`). Only process 0 writes (`enabled`).

Each `metrics.jsonl` line is `{"step", "epoch", "split", **values}`: "train" lines every
`config.log_every` steps (means over those steps, with the learning rate and the window's
throughput figures, `isojax.training.throughput`), one line per dev split after each epoch.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import time
from collections.abc import Callable

import numpy as np

from isojax.models import attention
from isojax.training import build, optim

logger = logging.getLogger(__name__)


def host_floats(tree: dict) -> dict[str, float]:
    """`{name: scalar array}` -> `{name: Python float}` (a host sync)."""
    return {k: float(np.asarray(v)) for k, v in tree.items()}


class MetricWriter:
    """Appends `{"step", "epoch", "split", **values}` lines to `metrics.jsonl` and scalars
    `split/name` to TensorBoard event files in the run folder (process 0 only); "train" lines
    also carry `fields` (text: the attention backend of each program and layer kind,
    `isojax.models.attention.fields`), which TensorBoard does not get."""

    def __init__(
        self,
        workdir: pathlib.Path,
        enabled: bool = True,
        tensorboard: bool = True,
        fields: dict[str, str] | None = None,
    ):
        self.enabled, self.fields = enabled, dict(fields or {})
        self._path = workdir / "metrics.jsonl"
        self._tb = None
        if enabled and tensorboard:
            import tensorboardX  # imported here: only process 0 writes

            self._tb = tensorboardX.SummaryWriter(str(workdir / "tensorboard"))

    def write(self, split: str, step: int, epoch: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "epoch": epoch, "split": split, **values}
        if split == "train":
            record |= self.fields
        with open(self._path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(f"{split}/{name}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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


# The progress line's records (logger "isojax.progress") carry `INPLACE`: True when stderr is a
# terminal, where the `isojax` command's handler rewrites the line in place; `INPLACE_END` ends
# that line.
INPLACE, INPLACE_END = "isojax_inplace", "isojax_inplace_end"
progress_log = logging.getLogger("isojax.progress")


class Progress:
    """A one-line progress display, logged to "isojax.progress": step, epoch, loss, steps/s,
    time left.

    On a terminal the line is rewritten in place (at most 10 times a second; `INPLACE`);
    otherwise a line is logged every `every` steps.
    """

    def __init__(self, total: int, *, every: int, enabled: bool = True):
        self.total, self.every, self.enabled = total, every, enabled
        self.tty = enabled and sys.stderr.isatty()
        self._start_time = self._last_time = time.perf_counter()
        self._start_step: int | None = None

    def update(self, step: int, epoch: int, loss: float | None, rates: dict | None = None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start_step is None:
            self._start_step, self._start_time = step, now
            return
        if self.tty and now - self._last_time < 0.1 and step < self.total:
            return
        if not self.tty and step % self.every and step < self.total:
            return
        self._last_time = now
        rate = (step - self._start_step) / max(now - self._start_time, 1e-9)
        left = (self.total - step) / rate if rate > 0 else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if math.isfinite(left) else "?"
        text = f"step {step}/{self.total} epoch {epoch}"
        if loss is not None:
            text += f" loss {loss:.4f}"
        text += f" {rate:.2f} steps/s eta {eta}" + _rates_text(rates or {})
        progress_log.info(text, extra={INPLACE: self.tty})

    def close(self) -> None:
        if self.tty and self._start_step is not None:
            progress_log.info("", extra={INPLACE_END: True})


def _rates_text(rates: dict) -> str:
    """` 1.2e+04 tok/s 31 ex/s MFU 12.3%` of a window's throughput figures (those present)."""
    text = ""
    if "real_tokens_per_s" in rates:
        text += f" {rates['real_tokens_per_s']:.3g} tok/s"
    if "examples_per_s" in rates:
        text += f" {rates['examples_per_s']:.3g} ex/s"
    if "mfu" in rates:
        text += f" MFU {rates['mfu']:.1%}"
    return text


class RunLog:
    """The loop's logging: a `MetricWriter` and a `Progress` line (process 0 only, `enabled`).

    `train(step, epoch, means)` after every training step: the progress line; on the steps
    `due` (every `every` steps, and the last) the loop passes `means`, the step metrics' means
    since the previous record (with a throughput meter's rates in place of its counts), and a
    "train" record is written with the learning rate of this update, `learning_rate(step -
    1)`. Dev records go through `writer.write`. `epoch` is the loop's 0-based index of the
    epoch in progress, as the "train" records keep it; the progress line shows it 1-based
    (`epoch + 1`), the number the epoch's dev record and the run's summary give it.
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        *,
        total_steps: int,
        every: int,
        enabled: bool,
        progress: bool,
        tensorboard: bool,
        learning_rate: Callable,
        fields: dict[str, str] | None = None,
    ):
        self.writer = MetricWriter(workdir, enabled, tensorboard, fields)
        self.progress = Progress(total_steps, every=every, enabled=enabled and progress)
        self.total_steps, self.every, self.learning_rate = total_steps, every, learning_rate

    def due(self, step: int) -> bool:
        """Whether `step` gets a "train" record."""
        return step % self.every == 0 or step == self.total_steps

    def train(self, step: int, epoch: int, means: dict[str, float] | None) -> None:
        if means is None:
            self.progress.update(step, epoch + 1, None)
            return
        means = means | {"learning_rate": float(self.learning_rate(step - 1))}
        self.writer.write("train", step, epoch, means)
        self.progress.update(step, epoch + 1, means["loss"], means)

    def close(self) -> None:
        self.progress.close()
        self.writer.close()


def run_log(run, workdir: pathlib.Path, lead: bool) -> RunLog:
    """The training loop's `RunLog` of `run` (`loop.Run`): metrics.jsonl, TensorBoard,
    progress, the learning rate schedule it logs; its "train" records name the attention
    backend of each program and layer kind (`build.attention_plans`), logged once here (with
    the progress display, process 0)."""
    spec, opt = run.spec.loop, run.spec.state.optim
    fields = {}
    for program, plan in build.attention_plans(run.spec.model, run.model.encoder.config).items():
        if lead and spec.progress:
            logger.info("isojax: %s", attention.describe(program, plan))
        fields |= attention.fields(program, plan)
    return RunLog(
        workdir,
        total_steps=run.total_steps,
        every=spec.log_every,
        enabled=lead,
        progress=spec.progress,
        tensorboard=spec.tensorboard,
        fields=fields,
        learning_rate=optim.learning_rate_schedule(
            opt.learning_rate,
            run.total_steps,
            warmup_fraction=opt.warmup_fraction,
            kind=opt.schedule,
        ),
    )
