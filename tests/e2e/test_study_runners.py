"""Several study runners on one grid (issue 25, items 2, 3 and 13; issue 26, item 8): the
results file's lock is keyed by the file, a cell is claimed before it is trained and a held
cell is skipped and reported, two runner processes share a grid without a duplicated line,
evaluation or metrics line; a non-finite budget is one line; the time estimate of a model
without a measured epoch is unknown rather than another model's prior."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, study_grid

from experiments.configs import study_recipe
from experiments.study import command, runner
from experiments.study import records as study_records
from experiments.study.eta import epoch_minutes
from experiments.study.grid import cell_config, load_grid
from experiments.study.records import StudyError, read_records

pytestmark = pytest.mark.e2e

WRITER = """
import pathlib, sys
from experiments.study.records import write_record
path, who, n = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(n):
    if who == "replacer":  # a failed line, then its retry's line replacing it (rename)
        write_record(path, {{"cell": f"r{{i}}", "status": "failed"}})
        write_record(path, {{"cell": f"r{{i}}", "status": "ok"}})
    else:
        write_record(path, {{"cell": f"a{{i}}", "status": "ok"}})
"""


def _writer(tmp_path, results, who, n):
    script = tmp_path / "writer.py"
    script.write_text(WRITER.format())
    return subprocess.Popen([sys.executable, str(script), str(results), who, str(n)],
                            stderr=subprocess.PIPE, text=True, env=_env())  # fmt: skip


def _env() -> dict:
    """This process's environment with the checkout's root first on PYTHONPATH (`experiments`)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path}


def test_the_results_lock_is_the_results_files_own(tmp_path):
    """Whoever holds `<results>.lock` keeps a writer out, whatever its runs folder; two writers
    (one replacing failed lines by renames, one appending) lose no line."""
    results = tmp_path / "shared" / "s.jsonl"
    results.parent.mkdir()
    with open(study_records.lock_path_of(results), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        writer = _writer(tmp_path, results, "appender", 1)
        time.sleep(2.0)
        assert writer.poll() is None and not results.exists()  # waiting for the lock
        fcntl.flock(held, fcntl.LOCK_UN)
    _, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert [r["cell"] for r in read_records(results)] == ["a0"]

    results.unlink()
    writers = [_writer(tmp_path, results, who, 40) for who in ("replacer", "appender")]
    for writer in writers:
        _, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
    records = read_records(results)
    assert sorted(r["cell"] for r in records) == sorted(
        [f"r{i}" for i in range(40)] + [f"a{i}" for i in range(40)]
    )
    assert all(r["status"] == "ok" for r in records)


def test_a_claim_is_exclusive_names_its_holder_and_dies_with_it(tmp_path):
    first = study_records.claim(tmp_path / "cell")
    assert isinstance(first, study_records.Claim)
    second = study_records.claim(tmp_path / "cell")
    assert second.startswith(f"pid {os.getpid()} on ")
    assert study_records.holder(tmp_path / "cell") == second
    first.release()
    assert study_records.holder(tmp_path / "cell") is None
    # A holder killed with SIGKILL leaves no stale claim.
    code = ("import pathlib, time; from experiments.study import records; "
            f"c = records.claim(pathlib.Path({str(tmp_path / 'cell')!r})); "
            "print('held', flush=True); time.sleep(60)")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=_env())  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "held"
        assert study_records.holder(tmp_path / "cell").startswith(f"pid {child.pid} on ")
    finally:
        child.kill()
        child.communicate()
    assert isinstance(study_records.claim(tmp_path / "cell"), study_records.Claim)


def _grid_file(tmp_path, glue_dir, minilm_dir, methods=("none", "isobn")) -> str:
    return study_grid(tmp_path, glue_dir, minilm_dir, methods=methods)


def test_a_cell_another_runner_holds_is_skipped_and_reported(tmp_path, glue_dir, minilm_dir):
    grid = _grid_file(tmp_path, glue_dir, minilm_dir)
    runs, results = tmp_path / "runs", tmp_path / "tiny.jsonl"
    names = ("rte-pretrained", "rte-none-s1", "rte-isobn-s1")
    claims = [study_records.claim(runs / "tiny" / c) for c in names]
    lines = []
    dry = runner.run_grid(grid, runs_dir=runs, results=results, dry_run=True, log=lines.append)
    assert sum("(running: pid" in line for line in lines) == 3
    lines.clear()
    counts = runner.run_grid(grid, runs_dir=runs, results=results, log=lines.append)
    assert dry["held"] == 0 and counts == {
        "cells": 3, "done": 0, "failed": 0, "ran": 0, "held": 3, "left": 3,
    }  # fmt: skip
    assert not results.exists() or not read_records(results)
    assert lines[-1].startswith("skipped 3 cells another runner held: rte-pretrained (pid ")
    assert lines[-1].count(f"pid {os.getpid()} on ") == 3
    for c in claims:
        c.release()
    assert study_records.holder(runs / "tiny" / "rte-none-s1") is None


def test_two_runner_processes_share_a_grid(tmp_path, glue_dir, minilm_dir):
    """Runner A is stopped (SIGSTOP) while it evaluates rte-pretrained; runner B skips that
    cell, trains rte-none-s1 and names A as the holder; A, continued, finishes its cell and
    skips the one B recorded. Each cell has one line, one evaluation per epoch, one metrics
    line per step; no traceback."""
    grid = _grid_file(tmp_path, glue_dir, minilm_dir, methods=("none",))
    runs, results = tmp_path / "runs", tmp_path / "tiny.jsonl"
    argv = [sys.executable, "-m", "experiments.study", grid, "--runs-dir", str(runs),
            "--results", str(results)]  # fmt: skip
    env = _env() | {"JAX_PLATFORMS": "cpu"}

    def start(name):
        with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own descriptor
            return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    cell = runs / "tiny" / "rte-pretrained"
    a = start("a")
    try:
        deadline = time.monotonic() + 300
        while True:  # stop A inside its rte-pretrained cell, the results lock free
            assert a.poll() is None and time.monotonic() < deadline, "A never claimed a cell"
            claim_file = cell / study_records.CLAIM_FILE
            if claim_file.exists() and claim_file.read_text().startswith(f"pid {a.pid} "):
                os.kill(a.pid, signal.SIGSTOP)
                with open(study_records.lock_path_of(results), "a") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        done = [r["cell"] for r in read_records(results)]
                        assert not done, "A finished its cell before it was stopped"
                        break
                    except BlockingIOError:
                        os.kill(a.pid, signal.SIGCONT)
            time.sleep(0.02)
        b = start("b")
        assert b.wait(timeout=300) == 0, (tmp_path / "b.log").read_text()
        os.kill(a.pid, signal.SIGCONT)
        assert a.wait(timeout=300) == 0, (tmp_path / "a.log").read_text()
    finally:
        for p in (a,):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    log_a, log_b = (tmp_path / "a.log").read_text(), (tmp_path / "b.log").read_text()
    assert "Traceback" not in log_a + log_b
    assert f"skipped 1 cells another runner held: rte-pretrained (pid {a.pid} on " in log_b
    assert "rte-none-s1: recorded by another runner" in log_a
    records = read_records(results)
    assert sorted(r["cell"] for r in records) == ["rte-none-s1", "rte-pretrained"]
    for record in records:
        assert record["status"] == "ok", record["error"]
        wall = json.loads((runs / "tiny" / record["cell"] / "study_wall.json").read_text())
        assert wall["attempts"] == 1
        if record["kind"] != "run":
            assert [e["epoch"] for e in record["eval"]] == [0]
        else:
            assert [e["epoch"] for e in record["eval"]] == [1, 2]
            rows = (runs / "tiny" / record["cell"] / "metrics.jsonl").read_text().splitlines()
            assert [json.loads(r)["step"] for r in rows if '"train"' in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("budget", ["nan", "inf", "-1"])
def test_a_non_finite_or_negative_budget_is_one_line(budget, tmp_path, capsys):
    grid = REPO / "experiments" / "configs" / "study_pilot.py"
    argv = [str(grid), "--budget-minutes", budget, "--dry-run", "--results",
            str(tmp_path / "p.jsonl")]  # fmt: skip
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--budget-minutes must be a finite number >= 0" in err
    with pytest.raises(StudyError):
        runner.run_grid(str(grid), budget_minutes=float(budget), dry_run=True)


def test_the_estimate_of_an_unmeasured_model_is_unknown(tmp_path, glue_dir, minilm_dir):
    grid, recipe = load_grid(_grid_file(tmp_path, glue_dir, minilm_dir))
    tiny = cell_config(grid, recipe, {"task": "rte", "method": "none", "seed": 1})
    assert epoch_minutes([], "rte", "none", recipe, "cpu", tiny) is None
    lines = []
    runner.run_grid(str(tmp_path / "study_tiny.py"), runs_dir=tmp_path / "r", dry_run=True,
                   results=tmp_path / "none.jsonl", log=lines.append)  # fmt: skip
    assert "estimate unknown" in lines[0] and "time unknown" in lines[1]
    # A measured tiny run counts for tiny runs only; the recipe's shape keeps the prior.
    minilm = recipe.set_fields(recipe.base_config(), {"task": "rte", "method": "none"})
    measured = {"fields": {"task": "rte", "method": "none"}, "status": "ok", "kind": "run",
                "wall_minutes": 0.2, "eval": [{"epoch": 1}, {"epoch": 2}], "device": "cpu",
                "config": json.loads(tiny.to_json())}  # fmt: skip
    assert epoch_minutes([measured], "rte", "none", recipe, "cpu", tiny) == 0.1
    assert (
        epoch_minutes([measured], "rte", "none", recipe, "cpu", minilm)
        == (study_recipe.EPOCH_MINUTES_PRIOR["rte"])
    )
