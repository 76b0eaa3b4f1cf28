"""The study runner's command line, `python -m experiments.study GRID [options]` (`runner`
runs the grid; see its docstring for the cells, records, claims and commits).

    python -m experiments.study GRID --tier 2                       # the cells, one by one, here
    python -m experiments.study GRID --tier 2 --executor ray [--address ADDR] [--cell-cpus N]
                                     [--cell-gpus N]                # each cell a Ray task
    python -m experiments.study GRID --tier 2 --list-cells          # one cell id a line
    python -m experiments.study GRID --tier 2 --cell ID             # that cell alone

`--executor ray` hands each cell to a Ray cluster (`ray_cells`): the one at `--address`, else
the one `ray.init()` finds or starts. `--list-cells` and `--cell` let a job array (SLURM's
`--array`, a Kubernetes indexed Job) run one cell per task: the cells are listed in the grid's
order, for the tiers asked, recorded or not, so that an index names the same cell on every
call; `--cell ID` runs that cell unless it is recorded (then it says so, exit 0).
"""

from __future__ import annotations

import argparse
import pathlib
import signal
import sys

from experiments.study import commit as study_commit
from experiments.study.cell import git_state
from experiments.study.grid import load_grid, plan
from experiments.study.records import StudyError, read_records_locked
from experiments.study.runner import REPO, RecordedElsewhere, check_budget, results_path, run_grid


def _terminate(signum, frame) -> None:
    """SIGTERM (a session's end) -> SystemExit: the cell's wall time is saved, no line is
    written, and its checkpoints let the next call resume it."""
    raise SystemExit(128 + signum)


def _absolute(path) -> str | None:
    return None if path is None else str(pathlib.Path(path).resolve())


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise StudyError(f"{message} (see `{self.prog} --help`)")


def _continue_at_recorded_commit(args, options: list[tuple[str, object]], where: str) -> None:
    """--at-recorded-commit: re-executes the runner of the commit the results file's records
    share, from a worktree at `where` ("": `study_commit.default_worktree`); returns (runs
    here) when the results file is empty or was recorded at this checkout's HEAD."""
    grid, _ = load_grid(args.grid)
    path = results_path(grid.name, args.results)
    records = read_records_locked(path, create=not args.dry_run)
    if not records:
        return
    commit = study_commit.recorded_commit(records, {r["cell"] for r in records})
    if commit is None:
        made = sorted({str(r.get("git_commit"))[:10] for r in records})
        raise StudyError(
            f"--at-recorded-commit: the records were not all made at one clean commit ({made})"
        )
    if commit == git_state()[0]:
        return
    worktree = pathlib.Path(where) if where else study_commit.default_worktree(REPO, commit)
    worktree = study_commit.ensure_worktree(REPO, commit, worktree)
    argv = study_commit.runner_argv(REPO, worktree, args.grid, options)
    from isojax.training import config as config_lib

    study_commit.reexec(argv, worktree, config_lib.default_glue_dir())


def _parser() -> argparse.ArgumentParser:
    """The runner's command line."""
    parser = _Parser(description=__doc__.split("\n\n")[0], prog="python -m experiments.study")
    parser.add_argument("grid", help="grid file, e.g. experiments/configs/study_normalizers.py")
    parser.add_argument("--tier", type=int, default=1, help="run tiers 1..TIER (default 1)")
    parser.add_argument("--budget-minutes", type=float, default=None, help="finite, >= 0")
    parser.add_argument("--runs-dir", default=str(REPO / "runs"), help="RUNS_DIR/<study>/<cell>")
    parser.add_argument("--results", default=None, help="default experiments/results/<study>.jsonl")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and estimate only")
    parser.add_argument("--retry-failed", action="store_true", help="rerun cells recorded failed")
    parser.add_argument(
        "--compile-cache",
        default=None,
        help="folder of compiled steps shared by the cells (default RUNS_DIR/.jax_cache; '' off)",
    )
    parser.add_argument(
        "--at-recorded-commit",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="continue the study with the code of the commit its records were made at, from a "
        "git worktree at DIR (created if absent; default ../<checkout>-at-<commit>)",
    )
    parser.add_argument(
        "--list-cells",
        action="store_true",
        help="print the cell ids of the tiers asked, one a line, and stop",
    )
    parser.add_argument("--cell", default=None, metavar="ID", help="run this cell only")
    parser.add_argument(
        "--executor",
        choices=("local", "ray"),
        default="local",
        help="local: the cells one by one here (default); ray: a Ray task each",
    )
    parser.add_argument("--address", default=None, help="the Ray cluster (--executor ray)")
    parser.add_argument(
        "--cell-cpus", type=float, default=None, help="CPUs a cell's Ray task asks for (default 1)"
    )
    parser.add_argument(
        "--cell-gpus",
        type=float,
        default=None,
        help="GPUs a cell's Ray task asks for (default 0: JAX on CPU)",
    )
    return parser


def _ray_options(args) -> dict | None:
    """The Ray executor's options (None: run here); a Ray flag without `--executor ray`, or a
    resource count that is not finite and >= 0 (> 0 for CPUs), is refused."""
    given = [
        f
        for f, v in (
            ("--address", args.address),
            ("--cell-cpus", args.cell_cpus),
            ("--cell-gpus", args.cell_gpus),
        )
        if v is not None
    ]
    if args.executor != "ray":
        if given:
            raise StudyError(f"{given[0]} needs --executor ray")
        return None
    cpus = 1.0 if args.cell_cpus is None else args.cell_cpus
    gpus = 0.0 if args.cell_gpus is None else args.cell_gpus
    if not (0 < cpus < float("inf")) or not (0 <= gpus < float("inf")):
        raise StudyError(f"--cell-cpus must be > 0 and --cell-gpus >= 0, got {cpus} and {gpus}")
    return {"address": args.address, "cpus": cpus, "gpus": gpus}


def _options(args) -> list[tuple[str, object]]:
    """The options a runner at the recorded commit is given (an older one refuses those it
    lacks)."""
    cache = args.compile_cache
    return [
        ("--tier", args.tier),
        ("--budget-minutes", args.budget_minutes),
        ("--runs-dir", _absolute(args.runs_dir)),
        ("--dry-run", args.dry_run),
        ("--retry-failed", args.retry_failed),
        ("--compile-cache", _absolute(cache) if cache else cache),
        ("--list-cells", args.list_cells),
        ("--cell", args.cell),
        ("--executor", None if args.executor == "local" else args.executor),
        ("--address", args.address),
        ("--cell-cpus", args.cell_cpus),
        ("--cell-gpus", args.cell_gpus),
    ]


def _run(args) -> None:
    """Lists the cells, or runs the grid (here or on Ray) after `--at-recorded-commit`."""
    ray = _ray_options(args)
    if args.list_cells and (args.cell or ray or args.dry_run):
        raise StudyError(
            "--list-cells lists the cells and runs none: give it without "
            "--cell, --executor ray or --dry-run"
        )
    if args.at_recorded_commit is not None:
        grid, _ = load_grid(args.grid)
        results = _absolute(results_path(grid.name, args.results))
        _continue_at_recorded_commit(
            args, [*_options(args), ("--results", results)], args.at_recorded_commit
        )
    if args.list_cells:
        grid, recipe = load_grid(args.grid)
        print("\n".join(c.name for c in plan(grid, recipe, args.tier)))
        return
    signal.signal(signal.SIGTERM, _terminate)
    cache = args.compile_cache
    cache = pathlib.Path(args.runs_dir) / ".jax_cache" if cache is None else cache or None
    if cache and not args.dry_run:
        from isojax.training import distributed

        distributed.enable_compilation_cache(cache)
    if ray is not None:
        ray["compile_cache"] = _absolute(cache) if cache else None
    run_grid(
        args.grid,
        tier=args.tier,
        runs_dir=args.runs_dir,
        results=args.results,
        budget_minutes=args.budget_minutes,
        dry_run=args.dry_run,
        retry_failed=args.retry_failed,
        cell=args.cell,
        ray=ray,
    )


def main(argv: list[str] | None = None) -> int:
    from isojax.logs import install_log_handler

    install_log_handler()  # the runs' progress and notices, as `isojax finetune` shows them
    args = None
    try:
        args = _parser().parse_args(argv)
        check_budget(args.budget_minutes)
        _run(args)
    except RecordedElsewhere as err:
        hint = ""
        if err.commit:
            options = [*_options(args), ("--results", _absolute(err.results))]
            command = study_commit.continue_command(REPO, err.commit, args.grid, options)
            hint = f"; to continue it there: {command} (or add --at-recorded-commit)"
        print(f"study: {err}{hint}", file=sys.stderr)
        return 2
    except (StudyError, study_commit.CommitError) as err:
        print(f"study: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
