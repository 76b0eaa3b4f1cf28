"""Save on preemption: `isojax finetune` sent SIGTERM mid-epoch saves the step it stopped on,
exits with `stops.EXIT_PREEMPTED`, and resumes to the uninterrupted run's end; with 2
processes, the one signalled and the other save the same step.

Each resume test costs three whole runs (uninterrupted, stopped, resumed), so each run carries
as many kinds of running state as it can: the linen run is IsoBN + I-STAR (batch statistics and
the C0 pass's stabiliser), the NNX run IsoBN, the third `whiten`."""

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from children import child_env, finish, free_port

from isojax.training import stops, throughput

pytestmark = pytest.mark.e2e

# `isojax finetune` in a child; with STOP_AT, the child signals itself right after that step
# (from the log hook, as a scheduler's SIGTERM would arrive mid-epoch) and once more while the
# checkpoint is being written (a second signal during the save). SIGNAL_RANK: which process.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from isojax.training import checkpointing, reporting
    from isojax import cli

    workdir, glue_dir, tokenizer, stop_at, rank, front_end = sys.argv[1:]
    stop_at = int(stop_at)
    if stop_at and os.environ.get("JAX_PROCESS_ID", "0") == rank:
        train_log = reporting.RunLog.train
        def train_then_signal(self, step, epoch, means):
            train_log(self, step, epoch, means)
            if step == stop_at:
                os.kill(os.getpid(), signal.SIGTERM)
        reporting.RunLog.train = train_then_signal
        save = checkpointing.Checkpointer.save
        def signal_during_save(self, step, state, position):
            if step < 6 and self.directory.name == "checkpoints":
                os.kill(os.getpid(), signal.SIGINT)
            save(self, step, state, position)
        checkpointing.Checkpointer.save = signal_during_save
    arm = os.environ.get("ISOJAX_TEST_ARM", "--normalizer isobn").split()
    sys.exit(cli.main([
        "finetune", "--task", "rte", *arm, "--model", "tiny-bert",
        "--data-dir", glue_dir, "--workdir", workdir, "--front-end", front_end,
        "--set", f"tokenizer={tokenizer}", "--set", "max_train_examples=48",
        "--set", "max_eval_examples=8", "--set", "batch_size=8", "--set", "eval_batch_size=8",
        "--set", "max_length=32", "--set", "buckets=()", "--set", "num_epochs=2",
        "--set", "log_every=2", "--set", "progress=False", "--set", "tensorboard=False",
        "--set", "dropout_rate=0.1", "--set", "optimizer.learning_rate=1e-3",
    ]))
    """
)


def _start(
    tmp_path, workdir, glue_dir, minilm_dir, stop_at=0, *, devices=4, rank=0, front_end="linen",
    **env,
):  # fmt: skip
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    args = [str(workdir), str(glue_dir), str(minilm_dir), str(stop_at), str(rank), front_end]
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        env=child_env(devices=devices, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _steps(workdir: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _untimed(path: pathlib.Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures (`throughput.TIMED_KEYS`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in throughput.TIMED_KEYS} for row in rows]


def _state(workdir: pathlib.Path, step: int) -> dict:
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


@pytest.mark.parametrize(
    "front_end, arm",
    [("linen", "--normalizer isobn --penalty istar"), ("nnx", "--normalizer isobn")],
    ids=["linen-isobn+istar", "nnx-isobn"],
)
def test_sigterm_saves_that_step_and_the_restart_ends_identical(
    tmp_path, glue_dir, minilm_dir, front_end, arm
):
    """48 RTE rows, batches of 8: 2 epochs of 6 steps (epoch-end checkpoints 6 and 12), dropout
    on, on 4 devices; the linen classifier with IsoBN and I-STAR (two kinds of running state:
    batch_stats and the stabiliser's C0, the held probe of the turn-5 audit, issue 50) and its
    NNX twin (`--front-end nnx`) with IsoBN. SIGTERM after step 3, SIGINT again while saving:
    the child saves step 3 (epoch 0, batch 3) and exits 75; the restart ends with every leaf of
    the state (params, opt_state, batch_stats, the stabiliser), results.json and metrics.jsonl
    of the uninterrupted run, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    env = {"ISOJAX_TEST_ARM": arm}
    children = [
        _start(tmp_path, full, glue_dir, minilm_dir, front_end=front_end, **env),
        _start(tmp_path, cut, glue_dir, minilm_dir, stop_at=3, front_end=front_end, **env),
    ]
    done, stopped = (finish(child) for child in children)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped.returncode == stops.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert _steps(cut) == [3]
    assert f"saved the checkpoint of step 3 at {cut / 'checkpoints' / '3'}" in stopped.stderr
    assert "SIGINT again: still saving, ignored" in stopped.stderr
    assert not (cut / "results.json").exists()
    position = json.loads((cut / "checkpoints" / "3" / "position" / "metadata").read_text())
    assert (position["epoch"], position["batch"], position["train_count"]) == (0, 3, 1)

    resumed = finish(_start(tmp_path, cut, glue_dir, minilm_dir, front_end=front_end, **env))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 3 (epoch 0, batch 3)" in resumed.stderr
    want, got = _state(full, 12), _state(cut, 12)
    assert set(want) >= {"params", "opt_state", "batch_stats"} and want["batch_stats"]
    assert bool(want.get("stabilizer")) == ("istar" in arm)  # the C0 pass's state, compared too
    assert jax.tree.structure(want) == jax.tree.structure(got)
    jax.tree_util.tree_map_with_path(
        lambda path, a, b: np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        ),
        want,
        got,
    )
    assert json.loads((full / "results.json").read_text()) == json.loads(
        (cut / "results.json").read_text()
    )
    assert _untimed(full / "metrics.jsonl") == _untimed(cut / "metrics.jsonl")


def test_two_processes_save_the_same_step(tmp_path, glue_dir, minilm_dir):
    """Two processes of 2 CPU devices; process 1 alone is sent SIGTERM after step 2 (and
    SIGINT while saving). JAX's preemption sync point stops both at the same step: one
    checkpoint, mid-epoch, and both exit 75 naming it."""
    port = free_port()
    children = [
        _start(
            tmp_path,
            tmp_path / "two",
            glue_dir,
            minilm_dir,
            stop_at=2,
            devices=2,
            rank=1,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(rank),
        )
        for rank in range(2)
    ]
    first, second = (finish(child) for child in children)
    for child in (first, second):
        assert child.returncode == stops.EXIT_PREEMPTED, child.stderr[-3000:]
    # The notice reaches process 0 through the coordinator a few steps later under load, so
    # the agreed step lies anywhere after the signal, before the run's last (12) step; past
    # the epoch's end (6) the epoch-end checkpoint is there too.
    steps = _steps(tmp_path / "two")
    step = steps[-1]
    assert 2 <= step < 12 and steps in ([step], [6, step]), steps
    assert f"saved the checkpoint of step {step}" in first.stderr  # process 0 prints it
    position = json.loads(
        (tmp_path / "two" / "checkpoints" / str(step) / "position" / "metadata").read_text()
    )
    assert position["epoch"] * 6 + position["batch"] == step  # 6 steps an epoch


def test_sigterm_and_resume_end_identical_for_whiten(tmp_path, glue_dir, minilm_dir):
    """Held probe of the turn-5 audit (issue 50): the same SIGTERM at step 3 and restart for
    `whiten` (its running mean, covariance and counters; `isobn + istar` is the linen case
    above): the restart's results.json, metrics and final state are the uninterrupted run's,
    bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    env = {"ISOJAX_TEST_ARM": "--normalizer whiten"}
    children = [
        _start(tmp_path, full, glue_dir, minilm_dir, **env),
        _start(tmp_path, cut, glue_dir, minilm_dir, stop_at=3, **env),
    ]
    done, stopped = (finish(child) for child in children)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped.returncode == stops.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert _steps(cut) == [3]
    resumed = finish(_start(tmp_path, cut, glue_dir, minilm_dir, **env))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = _state(full, 12), _state(cut, 12)
    assert "batch_stats" in want and jax.tree.structure(want) == jax.tree.structure(got)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), want, got
    )
    results = json.loads((full / "results.json").read_text())
    assert results == json.loads((cut / "results.json").read_text())
    assert _untimed(full / "metrics.jsonl") == _untimed(cut / "metrics.jsonl")
