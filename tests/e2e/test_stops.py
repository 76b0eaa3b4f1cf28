"""The audit's findings on how a run stops, as whole runs (/work/shared/AUDIT.md numbering): 1
(the command's refusal of one-row micro-batches), 2 (SIGINT to one of two processes during the
evaluation: both stop and save the same step), 4 (a failed save after a stop ends the study
runner), 13 (a signal before the first step), 14 (one process a run folder). Finding 6 (a
preemption at an epoch's last step, then a hard kill) and the held probes 11 and 12 (a signal
during a checkpoint write and during the C0 pass: the resumed run ends bit-identical) ride on
the resume chain of tests/e2e/test_preemption.py, which compares with an uninterrupted run
already."""

import json
import os
import socket
import subprocess
import sys

import pytest
from children import finetune_argv, finish, start_child
from helpers import study_grid

from experiments.study import runner
from isojax import cli
from isojax.training import checkpointing, reporting, stops

pytestmark = pytest.mark.e2e


def test_the_command_refuses_one_row_micro_batches_in_one_line(
    tmp_path, glue_dir, minilm_dir, capfd
):
    """In this process (a refusal before anything is built; `capfd` reads the file
    descriptors, so a library's stray line would show as a child's would)."""
    argv = finetune_argv(tmp_path / "run", glue_dir, minilm_dir, "grad_accum_steps=8")
    assert cli.main(argv) == 2
    (line,) = capfd.readouterr().err.strip().splitlines()
    assert "batch_size / grad_accum_steps = 8 / 8 = 1" in line and "'isobn'" in line


def test_a_second_finetune_on_a_held_run_folder_is_refused(tmp_path, glue_dir, minilm_dir, capsys):
    """Another process holds the folder's lock: `isojax finetune` there says so in one line,
    naming its pid, with status 2, before building anything."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(workdir)], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout.readline().strip() == "held"
            assert cli.main(finetune_argv(workdir, glue_dir, minilm_dir)) == 2
        finally:
            holder.kill()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"is in use by isojax pid {holder.pid}" in line
    assert not (workdir / "config.json").exists()


# What `isojax finetune` holds in its run folder (`run_folder.hold_run_folder`), held by hand.
_HOLD = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".isojax_lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"isojax pid {os.getpid()} on here\\n".encode(), 0)
print("held", flush=True)
time.sleep(60)
"""


def test_a_signal_before_the_first_step_exits_75_at_once(tmp_path, glue_dir, minilm_dir):
    argv = finetune_argv(tmp_path / "run", glue_dir, minilm_dir)
    done = finish(start_child(tmp_path, argv, {"signal_in_setup": "SIGTERM"}), timeout=60)
    assert done.returncode == stops.EXIT_PREEMPTED, done.stderr[-2000:]
    assert "SIGTERM before the first training step: nothing to save" in done.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigint_to_one_of_two_processes_during_the_evaluation_stops_both(
    tmp_path, glue_dir, minilm_dir
):
    """Two processes of one CPU device each (the stop is the processes', not the devices');
    process 1 alone gets SIGINT during the first dev evaluation (after step 6). JAX's
    preemption sync point stops both at the same step, after the evaluation (7 unless the
    notice reaches process 0 through the coordinator a few steps later under load), before
    the run's last (12): both exit 75, one checkpoint of that step beside the epoch-end one
    (6), its position that step's, and process 0 names it. A hang (the old process-local stop
    after the evaluation) fails at the timeout."""
    port, workdir = _free_port(), tmp_path / "two"
    argv = finetune_argv(workdir, glue_dir, minilm_dir)
    children = [
        start_child(
            tmp_path,
            argv,
            {"signal_in_eval": "SIGINT", "rank": "1"},
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(rank),
        )
        for rank in range(2)
    ]
    first, second = (finish(child, timeout=240) for child in children)
    for child in (first, second):
        assert child.returncode == stops.EXIT_PREEMPTED, child.stderr[-3000:]
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    step = steps[-1]
    assert 6 < step < 12 and steps == [6, step], steps
    assert f"saved the checkpoint of step {step}" in first.stderr  # process 0 prints it
    metadata = workdir / "checkpoints" / str(step) / "position" / "metadata"
    position = json.loads(metadata.read_text())
    assert position["epoch"] * 6 + position["batch"] == step  # 6 steps an epoch


# ---------------------------------------------------------------------------------------------
# Finding 4: the study runner, a SIGTERM whose save fails.
# ---------------------------------------------------------------------------------------------


def test_a_failed_save_after_a_stop_ends_the_study_runner(
    monkeypatch, tmp_path, glue_dir, minilm_dir
):
    """SIGTERM after step 1 of the first cell, and every save fails (a full disk): the runner
    ends with status 1 and starts no other cell (it used to record each cell failed)."""
    grid = study_grid(
        tmp_path, glue_dir, minilm_dir, methods=("none",), seeds=(1, 2), epochs=1, tier_2=False,
        pretrained=False,
    )  # fmt: skip
    train = reporting.RunLog.train

    def signal_after_step_1(self, step, epoch, means):
        train(self, step, epoch, means)
        if step == 1:
            os.kill(os.getpid(), 15)

    def full_disk(self, step, *args, **kwargs):
        raise checkpointing.CheckpointWriteError(28, f"cannot write checkpoint step {step}")

    monkeypatch.setattr(reporting.RunLog, "train", signal_after_step_1)
    monkeypatch.setattr(checkpointing.Checkpointer, "save", full_disk)
    lines = []
    with pytest.raises(SystemExit) as stop:
        runner.run_grid(
            grid, runs_dir=tmp_path / "runs", results=tmp_path / "r.jsonl", log=lines.append
        )
    assert stop.value.code == 1
    assert sum(line.startswith("[") for line in lines) == 1, lines
    assert not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").read_text()
