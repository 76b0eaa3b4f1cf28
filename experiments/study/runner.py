"""Runs a study grid: one `train.train_and_evaluate` run per cell, one JSON line per finished run.

    python -m experiments.study experiments/configs/study_normalizers.py --dry-run
    python -m experiments.study experiments/configs/study_normalizers.py --budget-minutes 240
    python -m experiments.study experiments/configs/study_normalizers.py --tier 2
    python -m experiments.study experiments/configs/study_normalizers.py --at-recorded-commit

A grid file (`experiments/configs/study_*.py`, read by `grid`) has `get_config(arg)`
returning a ConfigDict: `name` (the study), `base` (an isojax train config: the shared recipe),
`tiers` (`{"1": blocks, "2": blocks, ...}`, each block a dict `{field: [values]}` whose
Cartesian product, in the block's key order, gives cells), `pretrained` (record one step-0
evaluation per task), `baseline` ((field, value) pairs: the arm of the paired differences) and
`sweep` (the scalar field the report correlates with isotropy, or ""). Field names are those of
`study_recipe.FIELDS`, the one place that knows config paths; the grid file imports it as
`from experiments.configs import study_recipe` (run from the checkout's root). `--tier N` runs
tiers 1..N in order. One cell's run, and what its folder holds, are `cell`'s.

Cell `c` runs in `RUNS/<study>/<c>` (RUNS: `--runs-dir`, default `runs/`, ignored by git), and
its line goes to `experiments/results/<study>.jsonl` (`--results`). A cell whose line exists is
skipped (a failed one too, unless `--retry-failed`, whose new line replaces it); a cell whose
folder holds checkpoints but no line resumes from them (`train_and_evaluate` restores the
newest checkpoint and the data position); a folder with `results.json` of the same config is
recorded without training. `--budget-minutes` (finite, >= 0) is checked between cells: a started
cell runs to its end (or, killed, stays resumable), and the next call continues the grid. Cells
share JAX's persistent compilation cache (`--compile-cache`, default RUNS/.jax_cache): a cell
loads the steps that earlier cells compiled for the same shapes (the same executables).

Several runners may share a grid (one machine or several over a shared disk, each with the same
`--runs-dir` and `--results`): a runner claims a cell before training it (`records.claim`,
a flock in the cell's folder, dropped when the runner exits or dies), skips a cell another
runner holds, and at the end lists the cells it skipped so. Lines are written whole, with one
`write` under the lock `<results>.lock` beside the results file, and a cell already recorded is
never appended again. The same cells can be handed to a Ray cluster (`--executor ray`,
`ray_cells`: a Ray task per cell, the driver the results file's one writer) or to a job array
(`--list-cells`, then `--cell ID` in each task); the command line is `command`'s.

Records of a commit whose configs hash differently from this checkout's are not continued here:
the runner refuses in one line that names the commit and the command continuing the study there.
`--at-recorded-commit [DIR]` runs that command itself whenever the records were all made at one
clean commit other than HEAD (`commit`: a worktree detached at the commit, its own
runner, this checkout's results file, runs folder and data folder).

Each line (`record`): study, cell, tier, kind ("run" | "pretrained"), status ("ok" | "failed",
with `error`), fields (every grid axis's value, plus task/method/seed), seed, config_hash
(SHA-256 of the config without `study_recipe.NON_RUN_FIELDS`), config, git_commit, git_dirty
(tracked changes outside experiments/results/), device (`device_name`), host (`host_name`: CPU
model and cores), jax_version, sweep, baseline, metric (the task's `score`: the GLUE metric, or
the mean of two), eval (one dict per dev evaluation, from `metrics.jsonl`: epoch, step, split
and every metric/isotropy key the loop records), train_loss ([last step, epoch, mean loss] over
chunks of 10 steps within an epoch), train_loss_epoch (the mean training loss of each epoch, see
`read_run`), steps, wall_minutes (all attempts of the cell), finished (UTC time).
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import pathlib
import time
import traceback

from experiments.study import commit as study_commit
from experiments.study import eta as study_eta
from experiments.study import records as study_records
from experiments.study.cell import (
    device_name,
    folder_config_matches,
    git_state,
    host_name,
    read_run,
    run_cell,
    wall_seconds,
)
from experiments.study.grid import (
    PRETRAINED,
    Cell,
    config_hash,
    config_of,
    grid_axes,
    load_grid,
    plan,
)
from experiments.study.records import (
    StudyError,
    read_records_locked,
    write_record,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "experiments" / "results"
logger = logging.getLogger("study")


class RecordedElsewhere(StudyError):
    """Recorded cells hash differently here; `commit`: the one commit they were made at."""

    def __init__(self, message: str, results: pathlib.Path, commit: str | None):
        super().__init__(message)
        self.results, self.commit = results, commit


# ----------------------------------------------------------------------------------------------
# The runner.
# ----------------------------------------------------------------------------------------------


def check_budget(budget_minutes: float | None) -> None:
    """A budget is None (no limit) or finite and >= 0: NaN compares false with every elapsed
    time, so it would run the whole grid."""
    if budget_minutes is not None and not (math.isfinite(budget_minutes) and budget_minutes >= 0):
        raise StudyError(f"--budget-minutes must be a finite number >= 0, got {budget_minutes}")


def results_path(study: str, results: str | os.PathLike | None) -> pathlib.Path:
    return pathlib.Path(results) if results else RESULTS_DIR / f"{study}.jsonl"


def check_hashes(results: pathlib.Path, records: list[dict], hashes: dict[str, str]) -> None:
    """Refuses records whose config hash differs from this checkout's grid (`RecordedElsewhere`,
    naming the commit they were made at when they share one)."""
    by_cell = {r["cell"]: r for r in records}
    changed = [c for c, h in hashes.items() if c in by_cell and by_cell[c]["config_hash"] != h]
    if not changed:
        return
    first = by_cell[changed[0]]
    commit = study_commit.recorded_commit(records, set(changed))
    where = f"at commit {commit[:10]}" if commit else "at another commit"
    raise RecordedElsewhere(
        f"{results}: {len(changed)} recorded cells were made {where}, whose configs hash "
        f"differently from this checkout's (cell {changed[0]}: {first['config_hash']} there, "
        f"{hashes[changed[0]]} here): a changed recipe needs a new study name",
        results,
        commit,
    )


class Plan:
    """One call's view of a grid: its cells, their configs and hashes, the records so far and
    the estimates (`study_eta`) of the cells still to run. Without `create_lock` (a dry run)
    reading the results file creates no lock file."""

    def __init__(
        self, grid_spec: str, tier: int, runs_dir, results, retry_failed: bool,
        create_lock: bool = True,
    ):  # fmt: skip
        self.grid_spec, self.tier = grid_spec, tier
        self.grid, self.recipe = load_grid(grid_spec)
        self.study = self.grid.name
        self.results = results_path(self.study, results)
        self.study_dir = pathlib.Path(runs_dir) / self.study
        self.axes = grid_axes(self.grid)
        self.cells = plan(self.grid, self.recipe, tier)
        self.retry_failed = retry_failed
        self.records = read_records_locked(self.results, create=create_lock)
        self.by_cell = {r["cell"]: r for r in self.records}
        self.configs = {c.name: config_of(c, self.grid, self.recipe) for c in self.cells}
        self.hashes = {n: config_hash(c, self.recipe) for n, c in self.configs.items()}
        check_hashes(self.results, self.records, self.hashes)
        self.device = device_name()
        self.host = host_name()

    def cell_named(self, name: str) -> Cell:
        """The cell `name` of the tiers planned; StudyError naming the command that lists them."""
        for cell in self.cells:
            if cell.name == name:
                return cell
        tiers = max((c.tier for c in self.cells), default=0)
        raise StudyError(
            f"grid {self.study}: no cell {name!r} in tiers 1-{max(tiers, 1)} "
            "(`--list-cells` lists them, with the same --tier)"
        )

    def todo(self, cell: Cell) -> bool:
        old = self.by_cell.get(cell.name)
        return old is None or (self.retry_failed and old["status"] == "failed")

    def estimate(self, cell: Cell) -> float | None:
        """Minutes left for `cell`; None (unknown) also where its folder cannot be read: an
        estimate never stops the runner (the cell's own run repairs or refuses its folder)."""
        try:
            evals = read_run(self.study_dir / cell.name)["eval"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("%s: no estimate (%s)", cell.name, err)
            return None
        done = max([row["epoch"] for row in evals] + [0])
        return study_eta.estimate_minutes(
            cell.values, self.configs[cell.name], self.records, self.recipe, done, self.device
        )

    def left(self, explain: bool = False) -> str:
        return study_eta.eta([self.estimate(c) for c in self.cells if self.todo(c)], explain)

    def counts(self, *, ran: int, held: int) -> dict:
        return _counts(self.cells, self.by_cell, ran=ran, held=held)

    def remember(self, record: dict) -> None:
        self.records = [r for r in self.records if r["cell"] != record["cell"]] + [record]
        self.by_cell[record["cell"]] = record

    def record_head(self, cell: Cell, commit: str, dirty: bool) -> dict:
        """A cell's record before its run: everything but status, error and the run's part."""
        import jax

        config = self.configs[cell.name]
        return {
            "study": self.study,
            "cell": cell.name,
            "tier": cell.tier,
            **_record_head(cell, config, self.recipe, self.axes),
            "config_hash": self.hashes[cell.name],
            "config": json.loads(config.to_json()),
            "git_commit": commit,
            "git_dirty": dirty,
            "device": self.device,
            "host": self.host,
            "jax_version": jax.__version__,
            "sweep": self.grid.get("sweep", ""),
            "baseline": dict(self.grid.get("baseline", ())),
            "metric": "score",
        }


def run_grid(
    grid_spec: str,
    *,
    tier: int = 1,
    runs_dir: str | os.PathLike = REPO / "runs",
    results: str | os.PathLike | None = None,
    budget_minutes: float | None = None,
    dry_run: bool = False,
    retry_failed: bool = False,
    cell: str | None = None,
    ray: dict | None = None,
    log=print,
) -> dict:
    """Runs the cells of tiers 1..`tier` not yet recorded and not claimed by another runner
    (only the cell named `cell`, when given); returns counts {"cells", "done", "failed", "ran",
    "held", "left"} after this call ("held": cells skipped because another runner held them).
    `ray` (the options of `ray_cells.run_on_ray`) runs each cell as a Ray task instead of here."""
    check_budget(budget_minutes)
    p = Plan(grid_spec, tier, runs_dir, results, retry_failed, create_lock=not dry_run)
    pending = [c for c in p.cells if p.todo(c)]
    recorded = len(p.cells) - len(pending)
    if cell is not None:
        named = p.cell_named(cell)
        pending = [c for c in pending if c is named]
        if not pending:
            log(f"{cell}: recorded already ({p.by_cell[cell]['status']}) in {p.results}")
    failed = sum(p.by_cell.get(c.name, {}).get("status") == "failed" for c in p.cells)
    log(
        f"study {p.study} (tiers 1-{tier}): {len(p.cells)} cells, {recorded} "
        f"recorded ({failed} failed), {len(pending)} to run; estimate {p.left(True)} -> "
        f"{p.results}"
    )
    if dry_run:
        for c in pending:
            minutes, busy = p.estimate(c), study_records.holder(p.study_dir / c.name)
            log(
                f"  tier {c.tier} {c.name}: "
                + ("time unknown" if minutes is None else f"~{minutes:.1f} min")
                + (f" (running: {busy})" if busy else "")
            )
        return p.counts(ran=0, held=0)

    commit, dirty = git_state()
    if ray is not None and pending:
        from experiments.study import ray_cells  # Ray is an extra: imported when asked for

        ran, held = ray_cells.run_on_ray(p, pending, commit, dirty, budget_minutes, log, **ray)
    else:
        ran, held = _run_here(p, pending, commit, dirty, budget_minutes, log)
    p.by_cell = {r["cell"]: r for r in read_records_locked(p.results)}  # other runners' too
    p.records = list(p.by_cell.values())
    counts = p.counts(ran=ran, held=len(held))
    log(
        f"study {p.study}: {counts['done']}/{counts['cells']} recorded "
        f"({counts['failed']} failed), {counts['left']} left (~{p.left()})"
    )
    if held:
        log(
            f"skipped {len(held)} cells another runner held: "
            + "; ".join(f"{name} ({who})" for name, who in held.items())
        )
    return counts


def _run_here(p: Plan, pending: list[Cell], commit, dirty, budget_minutes, log) -> tuple:
    """Runs `pending` one after the other in this process; (cells run, {cell: holder} of the
    cells another runner held)."""
    start = time.monotonic()
    ran, held = 0, {}
    for index, cell in enumerate(pending):
        elapsed = (time.monotonic() - start) / 60.0
        if budget_minutes is not None and elapsed >= budget_minutes:
            log(f"budget of {budget_minutes:g} min reached after {elapsed:.1f} min: stopping")
            break
        where = f"[{index + 1}/{len(pending)}] {cell.name}"
        claim = study_records.claim(p.study_dir / cell.name)
        if not isinstance(claim, study_records.Claim):
            held[cell.name] = claim
            log(f"{where}: held by {claim}; next cell")
            continue
        with claim:
            record = run_claimed(p, cell, where, elapsed, commit, dirty, log)
        if record is not None:
            record_line(p, record, log)
            ran += 1
    return ran, held


def record_line(p: Plan, record: dict, log, where: str = "") -> None:
    """Writes `record`'s line (under the results lock) and says how the cell ended (after
    `where`: "[k/n] cell:" where cells end out of order)."""
    write_record(p.results, record)
    p.remember(record)
    last = record["eval"][-1] if record["eval"] else {}
    log(
        f"{where}  {record['status']} in {record['wall_minutes']:.1f} min"
        + (f", dev score {last['score']:.4f}" if "score" in last else "")
    )


def run_claimed(p: Plan, cell: Cell, where: str, elapsed: float, commit, dirty, log) -> dict | None:
    """Runs `cell`, claimed by this process; returns its record (to write), or None if another
    runner recorded it since `p` read the results file."""
    now = {r["cell"]: r for r in read_records_locked(p.results)}.get(cell.name)
    if now != p.by_cell.get(cell.name):
        p.remember(now)
        log(f"{where}: recorded by another runner")
        return None
    config, workdir = p.configs[cell.name], p.study_dir / cell.name
    if not folder_config_matches(workdir, config, p.recipe):
        raise StudyError(f"{workdir} holds a run of another config: move it away")
    log(f"{where} (tier {cell.tier}); grid left ~{p.left()}, {elapsed:.1f} min into this call")
    return _run_record(p.record_head(cell, commit, dirty), config, workdir, log)


def _record_head(cell: Cell, config, recipe, axes: list[str]) -> dict:
    """kind, fields (every axis with the cell's value; a pre-trained row has only task, method
    and seed) and seed of a cell's record."""
    kind = PRETRAINED if cell.values["method"] == PRETRAINED else "run"
    fields = {
        a: cell.values.get(a, None if kind == PRETRAINED else recipe.get_field(config, a))
        for a in axes
    }
    return {"kind": kind, "fields": fields, "seed": recipe.get_field(config, "seed")}


def _run_record(record: dict, config, workdir: pathlib.Path, log) -> dict:
    """Runs the cell of `record` (its head filled in) and returns the whole record."""
    try:
        part = run_cell(config, workdir, record["kind"])
        record |= {"status": "ok", "error": None} | part
    except Exception as err:  # recorded; the grid goes on (KeyboardInterrupt stops it)
        tail = "".join(traceback.format_exception(err)[-3:])
        record |= {"status": "failed", "error": f"{type(err).__name__}: {err}\n{tail}"}
        record |= read_run(workdir) | {"wall_minutes": wall_seconds(workdir) / 60.0}
        log(f"  FAILED: {type(err).__name__}: {err}")
    record["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return record


def _counts(cells: list[Cell], by_cell: dict, *, ran: int, held: int) -> dict:
    done = sum(c.name in by_cell for c in cells)
    failed = sum(by_cell.get(c.name, {}).get("status") == "failed" for c in cells)
    return {"cells": len(cells), "done": done, "failed": failed, "ran": ran, "held": held,
            "left": len(cells) - done}  # fmt: skip
