"""Resuming a run: the run folder's checkpointers and the restore of the newest checkpoint.

A checkpoint holds the train state and the loop's `position.Position`, with the run's config
stamp (`run_folder.config_stamp`), which the restore compares with the config it is given
(`run_folder.check_stamp`). A resumed run ends with the same parameters, metrics and
`metrics.jsonl` as an uninterrupted one.

`metrics.jsonl` follows the checkpoint: a resumed run drops the lines written after it, a fresh
start (no checkpoint) begins an empty log, and a torn last line (a kill mid-write) is dropped
with a warning (`reporting.metrics_lines`).
"""

from __future__ import annotations

import logging
import pathlib

from isojax.training import checkpointing, reporting, run_folder, steps
from isojax.training.position import Position

logger = logging.getLogger(__name__)


def checkpointers(
    workdir: pathlib.Path, keep: int
) -> tuple[checkpointing.Checkpointer, checkpointing.Checkpointer]:
    """The run folder's checkpointers: the newest `keep` steps (`run_folder.LATEST_DIR`) and
    the best dev epoch's (`run_folder.BEST_DIR`, one step)."""
    return (
        checkpointing.Checkpointer(workdir / run_folder.LATEST_DIR, max_to_keep=keep),
        checkpointing.Checkpointer(workdir / run_folder.BEST_DIR, max_to_keep=1),
    )


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
    checkpoint trained with another config (`run_folder.check_stamp`) raises
    `run_folder.ConfigChanged`."""
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
        run_folder.check_stamp(stamp, fields, f"checkpoint step {step} in {ckpt.directory}")
    position = Position.from_json(saved, f"checkpoint step {step} in {ckpt.directory}")
    if lead and path.exists():
        lines = path.read_text().splitlines(keepends=True)
        kept = [line for line, record in reporting.metrics_lines(path) if record["step"] <= step]
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
