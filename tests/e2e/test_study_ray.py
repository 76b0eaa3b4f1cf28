"""A study grid's cells as Ray tasks (issue 62, item 7): a local Ray cluster started by the
test runs a tiny grid of 4 cells through `python -m experiments.study --executor ray
--address ADDR` (its `main`, called in the test's process, the driver); its results file holds
the plain runner's cells with the same scores and the same record format, and a second call
writes nothing new."""

import importlib.util
import os
import signal
import subprocess
import sys

import pytest
from helpers import REPO, study_grid

from experiments.study import command, runner
from experiments.study.records import read_records
from isojax.training import distributed

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="Ray is not installed: pip install 'isojax[ray]' (the test extra installs it)",
    ),
]
# The cluster's head, in a child that never imports JAX (Ray forks; JAX warns on a fork): it
# prints the address, then holds the cluster until its standard input closes.
HEAD = """
import sys, ray
ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""

SAME = ("config_hash", "config", "git_commit", "git_dirty", "fields", "seed", "tier", "kind",
        "status", "device", "steps", "eval", "train_loss", "train_loss_epoch")  # fmt: skip


def _env() -> dict:
    """This process's environment with the checkout's root first on PYTHONPATH, for the
    cluster's head (its workers' too: the cluster is started from there)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return os.environ | {"PYTHONPATH": path, "JAX_PLATFORMS": "cpu", "RAY_AUTH_MODE": "disabled"}


@pytest.mark.slow
def test_ray_tasks_record_the_plain_runners_cells_and_scores(
    tmp_path, glue_dir, minilm_dir, monkeypatch, capsys
):
    """The plain run and the Ray run (`python -m experiments.study`'s `main`, called in this
    process: the driver, then the cluster's two workers), in turn; then the records are
    compared field by field."""
    grid = study_grid(
        tmp_path, glue_dir, minilm_dir, seeds=(1, 2), epochs=1, tier_2=False, pretrained=False
    )
    results, runs, plain = tmp_path / "ray.jsonl", tmp_path / "ray", tmp_path / "plain.jsonl"
    head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env())  # fmt: skip
    try:
        runner.run_grid(grid, runs_dir=tmp_path / "plain", results=plain, log=lambda _: None)
        address = head.stdout.readline().strip()
        assert address, "the Ray head did not start"
        argv = [grid, "--executor", "ray", "--address", address, "--runs-dir", str(runs),
                "--results", str(results),
                "--compile-cache", os.environ["ISOJAX_TEST_JAX_CACHE"]]  # fmt: skip
        # The driver's own settings, put back for the next tests of this process: its SIGTERM
        # handler, and its compilation cache (the workers get the cache's folder in each job).
        monkeypatch.setattr(distributed, "enable_compilation_cache", lambda folder: None)
        sigterm = signal.getsignal(signal.SIGTERM)
        capsys.readouterr()
        try:
            assert command.main(argv) == 0
        finally:
            signal.signal(signal.SIGTERM, sigterm)
        out, err = capsys.readouterr()
        log = out + err
        assert "Traceback" not in log, log
        expected = {r["cell"]: r for r in read_records(plain, full=True)}
        got = {r["cell"]: r for r in read_records(results, full=True)}
        assert len(expected) == 4 and sorted(got) == sorted(expected)
        for name, record in got.items():
            assert set(record) == set(expected[name])  # the record's format is the runner's
            assert record["status"] == "ok", record["error"]
            for key in SAME:  # every metric and isotropy number of every evaluation too
                assert record[key] == expected[name][key], (name, key)
            assert (runs / "tiny" / name / "results.json").is_file()
        assert log.count(":  ok in ") == 4, log  # the driver wrote the 4 lines

        # A second call: every cell recorded, nothing handed to Ray, nothing written.
        before, lines = results.read_bytes(), []
        ray_options = {"address": address, "cpus": 1.0, "gpus": 0.0}
        counts = runner.run_grid(grid, runs_dir=runs, results=results, ray=ray_options,
                                 log=lines.append)  # fmt: skip
        assert counts == {"cells": 4, "done": 4, "failed": 0, "ran": 0, "held": 0, "left": 0}
        assert "4 recorded (0 failed), 0 to run" in lines[0]
        assert results.read_bytes() == before
    finally:
        import ray

        ray.shutdown()  # this process, the driver, leaves first: a driver whose cluster is
        # gone exits on its own (Ray's GCS reconnection timeout), and this one runs more tests
        head.communicate(timeout=120)  # its standard input closed: ray.shutdown()
