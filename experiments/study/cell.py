"""One cell of a study grid: train (or resume, or read back) its run folder, evaluate the step-0
model of a "pretrained" cell, and read what the folder holds into the run part of the cell's
record (`read_run`); the commit and device that the record names (`git_state`, `device_name`).
`runner.py` runs the grid around these.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import subprocess
import time

import ml_collections

from experiments.study.grid import PRETRAINED, config_hash

REPO = pathlib.Path(__file__).resolve().parents[2]
LOSS_CHUNK_STEPS = 10  # steps per point of a record's train_loss curve


# ----------------------------------------------------------------------------------------------
# The machine.
# ----------------------------------------------------------------------------------------------


def git_state() -> tuple[str, bool]:
    """(HEAD commit, whether tracked files differ from it outside experiments/results/).

    In a copy of the tree without its git repository (the device machine's, see
    `experiments/device/run.sh`): `$ISOJAX_GIT_COMMIT` and `$ISOJAX_GIT_DIRTY` ("0": clean), as
    `experiments/device/prepare.sh` recorded them; else ("unknown", True)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    ":!experiments/results")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("ISOJAX_GIT_COMMIT")
        if commit:
            return commit, os.environ.get("ISOJAX_GIT_DIRTY", "1") != "0"
        return "unknown", True
    return commit, bool(dirty)


def device_name() -> str:
    """`backend kind xcount`, e.g. "cpu cpu x1" or "gpu NVIDIA H200 x1": runs on other devices
    time (and round) differently."""
    import jax

    devices = jax.devices()
    return f"{jax.default_backend()} {devices[0].device_kind} x{len(devices)}"


def host_name() -> dict:
    """{"cpu": the CPU model (Linux's /proc/cpuinfo "model name", else `platform.processor()`,
    else "unknown"), "cores": `os.cpu_count()`}: the machine behind `device_name`'s "cpu cpu
    x1", which names only the backend."""
    import platform

    model = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model or platform.processor() or "unknown", "cores": os.cpu_count()}


# ----------------------------------------------------------------------------------------------
# One cell.
# ----------------------------------------------------------------------------------------------


def _add_wall(workdir: pathlib.Path, seconds: float) -> float:
    """Adds an attempt's seconds to `workdir/study_wall.json`; returns the cell's total."""
    path = workdir / "study_wall.json"
    data = json.loads(path.read_text()) if path.exists() else {"seconds": 0.0, "attempts": 0}
    data = {"seconds": data["seconds"] + seconds, "attempts": data["attempts"] + 1}
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) + "\n")
    return data["seconds"]


def wall_seconds(workdir: pathlib.Path) -> float:
    path = workdir / "study_wall.json"
    return json.loads(path.read_text())["seconds"] if path.exists() else 0.0


def read_run(workdir: pathlib.Path, chunk: int = LOSS_CHUNK_STEPS) -> dict:
    """eval / train_loss / train_loss_epoch / steps of a run folder, from its `metrics.jsonl`.

    A train line holds the mean loss of the steps since the previous one (`log_every` steps).
    `train_loss_epoch` weighs each line by its steps and assigns it to the epoch of its last
    step: exact when no line spans an epoch end (`log_every` 1, as the study recipe sets).
    `train_loss` merges consecutive lines of one epoch into means over >= `chunk` steps,
    `[last step, epoch (0-based, as metrics.jsonl), mean loss]`, to keep the record small.
    The lines are the loop's own reading (`reporting.metrics_lines`): a torn last line, what a
    kill mid-write leaves, is dropped with a warning; a bad line before it raises ValueError.
    """
    from isojax.training import reporting  # the loop's own reader

    evals, windows = [], []
    previous = 0
    for _, row in reporting.metrics_lines(workdir / "metrics.jsonl"):
        if row["split"] == "train":
            windows.append((row["step"], row["epoch"], row["loss"], row["step"] - previous))
            previous = row["step"]
        else:
            evals.append(row)
    per_epoch: dict[int, list[float]] = {}
    curve, pending = [], [0.0, 0]
    for index, (step, epoch, loss, n) in enumerate(windows):
        total = per_epoch.setdefault(epoch, [0.0, 0])
        total[0], total[1] = total[0] + loss * n, total[1] + n
        pending = [pending[0] + loss * n, pending[1] + n]
        last_of_epoch = index + 1 == len(windows) or windows[index + 1][1] != epoch
        if pending[1] >= chunk or last_of_epoch:
            curve.append([step, epoch, pending[0] / pending[1]])
            pending = [0.0, 0]
    epochs = [{"epoch": e + 1, "loss": s / n} for e, (s, n) in sorted(per_epoch.items()) if n]
    steps = max([row["step"] for row in evals] + [w[0] for w in windows] + [0])
    return {"eval": evals, "train_loss": curve, "train_loss_epoch": epochs, "steps": steps}


def _pretrained_eval(config: ml_collections.ConfigDict) -> list[dict]:
    """Dev metrics and isotropy of the step-0 model (pre-trained encoder, fresh head)."""
    from isojax.training import evaluation, loop

    run = loop.setup(config)
    rows = []
    for split, encoded in run.dev_encoded.items():
        result = evaluation.evaluate(run, run.state, encoded)
        rows.append({"step": 0, "epoch": 0, "split": split, **result})
    return rows


def run_cell(config: ml_collections.ConfigDict, workdir: pathlib.Path, kind: str) -> dict:
    """Runs (or resumes, or reads back) one cell; returns the run part of its record.
    Exceptions propagate after the attempt's wall time is saved."""
    from isojax.training import loop, stops

    start = time.monotonic()
    try:
        if kind == PRETRAINED:
            workdir.mkdir(parents=True, exist_ok=True)
            part = {"eval": _pretrained_eval(config), "train_loss": [], "train_loss_epoch": []}
            part["steps"] = 0
        else:
            # A run stopped on a non-finite loss has a results.json without a score: rerun
            # (it raises again, and the cell is recorded failed).
            if not (workdir / "results.json").exists() or stops.stopped(workdir):
                loop.train_and_evaluate(config, workdir)
            part = read_run(workdir)
    finally:
        seconds = _add_wall(workdir, time.monotonic() - start)
        # Each run jits its own step functions: drop them, so a long grid does not grow.
        import jax

        jax.clear_caches()
        gc.collect()
    part["wall_minutes"] = seconds / 60.0
    return part


def folder_config_matches(workdir: pathlib.Path, config, recipe) -> bool:
    saved = workdir / "config.json"
    if not saved.exists():
        return True
    before = ml_collections.ConfigDict(json.loads(saved.read_text()))
    return config_hash(before, recipe) == config_hash(config, recipe)
