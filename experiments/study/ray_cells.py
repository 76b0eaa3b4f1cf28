"""A study grid's cells as Ray tasks: `python -m experiments.study GRID --executor ray` (issue
62, item 7), for a grid that outgrows one machine.

The driver (this process) plans the grid as the plain runner does (`runner.Plan`: the records,
the config hashes checked against them) and hands each cell to run to a Ray task (`cell_job`)
that asks for `cpus` CPUs and `gpus` GPUs (a task without a GPU runs JAX on CPU). The task, on
whichever worker Ray picks:
- loads the grid from the same checkout (the workers import the driver's checkout: `PYTHONPATH`
  is its root, which every node must see at the same path, as it must see `--runs-dir` and
  `--results`), and refuses to run when its commit, its tracked changes or the cell's config
  hash differ from the driver's: a record names the code that made it;
- claims the cell's folder (`records.claim`), skips a cell another runner holds or recorded,
  and runs it (`cell.run_cell`), returning the record without writing it.
The driver alone writes the results file, one line per finished task under the results lock,
so the file has one writer however many workers run. At most as many cells are in flight as
the cluster's resources hold, submitted in the grid's order, so that `--budget-minutes` stops
the submitting (a started cell runs to its end) as it stops the plain runner. A task whose
worker dies is retried by Ray (its retries resume from the cell's checkpoints); one that still
fails is reported and left for the next call. A task that refuses (`StudyError`) stops new
submissions; the cells in flight finish and are recorded, then the refusal is raised.
"""

from __future__ import annotations

import os
import pathlib
import socket

from experiments.study import records as study_records
from experiments.study import runner
from experiments.study.cell import git_state
from experiments.study.records import StudyError


def cell_job(job: dict) -> dict:
    """The Ray task of one cell (`job`: the grid, tier, runs folder, results file, cell name,
    the driver's commit, dirty flag and the cell's config hash, the compile cache): {"record":
    its record}, {"held": who holds it} or {"recorded": True}."""
    from isojax.logs import install_log_handler

    install_log_handler()  # the run's progress, in the worker's log (shown by the driver)
    if job["compile_cache"]:
        from isojax.training import distributed

        distributed.enable_compilation_cache(job["compile_cache"])
    p = runner.Plan(job["grid"], job["tier"], job["runs_dir"], job["results"], job["retry"])
    cell = p.cell_named(job["cell"])
    commit, dirty = git_state()
    here = (commit, dirty, p.hashes[cell.name])
    there = (job["commit"], job["dirty"], job["config_hash"])
    if here != there:
        raise StudyError(
            f"{cell.name}: the Ray worker on {socket.gethostname()} runs commit {commit[:10]} "
            f"(dirty {dirty}, config hash {here[2]}), the driver {there[0][:10]} (dirty "
            f"{there[1]}, config hash {there[2]}): every node must run the driver's checkout"
        )
    if not p.todo(cell):
        return {"recorded": True}
    claim = study_records.claim(p.study_dir / cell.name)
    if not isinstance(claim, study_records.Claim):
        return {"held": claim}
    with claim:
        record = runner.run_claimed(p, cell, job["where"], 0.0, commit, dirty, print)
    return {"recorded": True} if record is None else {"record": record}


def _ray():
    try:
        import ray
    except ImportError:
        raise StudyError(
            "--executor ray needs Ray: pip install 'isojax[ray]' (or pip install ray)"
        ) from None
    return ray


def _connect(ray, address: str | None) -> None:
    """Joins the cluster at `address` (None: the one `ray.init()` finds or starts), unless this
    process already has; the workers import this checkout (`PYTHONPATH` its root)."""
    if ray.is_initialized():
        return
    path = os.pathsep.join(filter(None, [str(runner.REPO), os.environ.get("PYTHONPATH")]))
    try:
        ray.init(
            address=address,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            include_dashboard=False if address is None else None,
        )
    except (ConnectionError, ValueError, RuntimeError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        where = address or "auto"
        raise StudyError(f"--executor ray: no Ray cluster at {where}: {first}") from None


def _absolute_spec(spec: str) -> str:
    """`path.py[:arg]` with the path absolute: a worker's working folder is not the driver's."""
    path, sep, arg = spec.partition(":")
    return str(pathlib.Path(path).resolve()) + sep + arg


def _slots(ray, cpus: float, gpus: float) -> int:
    """How many cells the cluster's resources hold at once (at least 1)."""
    total = ray.cluster_resources()
    fits = [total.get("CPU", 0.0) // cpus] + ([total.get("GPU", 0.0) // gpus] if gpus else [])
    return max(1, int(min(fits)))


def run_on_ray(
    p,
    pending: list,
    commit: str,
    dirty: bool,
    budget_minutes,
    log,
    *,
    address=None,
    cpus=1.0,
    gpus=0.0,
    compile_cache=None,
) -> tuple[int, dict]:
    """Runs `pending` (cells of `p`, a `runner.Plan`) as Ray tasks, writing each finished
    cell's line here; returns (cells run, {cell: holder} of the cells another runner held)."""
    import time

    ray = _ray()
    _connect(ray, address)
    env = {} if gpus else {"JAX_PLATFORMS": "cpu"}  # a task without a GPU leaves them alone
    task = ray.remote(
        num_cpus=cpus,
        num_gpus=gpus,
        max_calls=1 if gpus else 0,  # a new worker per GPU cell: JAX frees the GPU at exit
        runtime_env={"env_vars": env} if env else None,
    )(cell_job)
    log(
        f"Ray: {len(pending)} cells, {cpus:g} CPUs and {gpus:g} GPUs each, on "
        f"{ray.cluster_resources()}"
    )
    start, ran, held, refusal = time.monotonic(), 0, {}, None
    flight: dict = {}
    queue = list(enumerate(pending))
    while queue or flight:
        elapsed = (time.monotonic() - start) / 60.0
        stop = refusal or (budget_minutes is not None and elapsed >= budget_minutes)
        if stop and queue:
            if refusal is None:
                log(
                    f"budget of {budget_minutes:g} min reached after {elapsed:.1f} min: "
                    f"no new cell ({len(flight)} running)"
                )
            queue = []
        while queue and len(flight) < _slots(ray, cpus, gpus):
            index, cell = queue.pop(0)
            where = f"[{index + 1}/{len(pending)}] {cell.name}"
            job = {
                "grid": _absolute_spec(p.grid_spec),
                "tier": p.tier,
                "runs_dir": str(p.study_dir.parent.resolve()),
                "results": str(p.results.resolve()),
                "retry": p.retry_failed,
                "cell": cell.name,
                "commit": commit,
                "dirty": dirty,
                "config_hash": p.hashes[cell.name],
                "compile_cache": compile_cache,
                "where": where,
            }
            flight[task.remote(job)] = (cell, where)
        if not flight:
            break
        done, _ = ray.wait(list(flight), num_returns=1)
        cell, where = flight.pop(done[0])
        try:
            answer = ray.get(done[0])
        except StudyError as err:  # the task's refusal (RayTaskError is also a StudyError)
            why = StudyError(str(getattr(err, "cause", err)))
            refusal = refusal or why
            log(f"{where}: refused: {why}")
            continue
        except ray.exceptions.RayError as err:
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log(f"{where}: the Ray task failed ({type(err).__name__}: {first}); not recorded")
            continue
        if "held" in answer:
            held[cell.name] = answer["held"]
            log(f"{where}: held by {answer['held']}; next cell")
        elif "record" in answer:
            try:  # a plain runner may have claimed the cell once the task let go, and written
                runner.record_line(p, answer["record"], log, f"{where}:")
                ran += 1
            except StudyError as err:
                log(f"{where}: not written: {err}")
        else:
            log(f"{where}: recorded by another runner")
    if refusal is not None:
        raise refusal
    return ran, held
