"""Save on preemption: `isojax finetune` sent SIGTERM mid-epoch saves the step it stopped on,
exits with `stops.EXIT_PREEMPTED`, and resumes to the uninterrupted run's end; with 2
processes, the one signalled and the other save the same step.

Each resume test costs an uninterrupted run and a chain of stopped ones resumed in turn, so
each carries as many kinds of running state, and each chain as many ways to stop, as it can:
the linen run is IsoBN + I-STAR (batch statistics and the C0 pass's stabiliser) stopped in
both C0 passes, mid-epoch (a second signal during that save) and during an epoch-end
checkpoint write (the audit's held probes 11 and 12, /work/shared/AUDIT.md); the NNX run
IsoBN; the third `whiten`, stopped mid-epoch, at an epoch's last step and killed hard (the
audit's finding 6: each epoch logged once)."""

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
from helpers import dev_lines, finetune_argv, start_child

from isojax.training import stops, throughput

pytestmark = pytest.mark.e2e

# The two-process test's `isojax finetune` (the resume tests run `helpers.CHILD`): with STOP_AT,
# the child signals itself right after that step (from the log hook, as a scheduler's SIGTERM
# would arrive mid-epoch) and once more while whatever checkpoint it stops at is being written
# (a second signal during the save). RANK: which process.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from isojax.training import checkpointing, reporting
    from isojax import cli

    workdir, glue_dir, tokenizer, stop_at, rank = sys.argv[1:]
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
    sys.exit(cli.main([
        "finetune", "--task", "rte", "--normalizer", "isobn", "--model", "tiny-bert",
        "--data-dir", glue_dir, "--workdir", workdir,
        "--set", f"tokenizer={tokenizer}", "--set", "max_train_examples=48",
        "--set", "max_eval_examples=8", "--set", "batch_size=8", "--set", "eval_batch_size=8",
        "--set", "max_length=32", "--set", "buckets=()", "--set", "num_epochs=2",
        "--set", "log_every=2", "--set", "progress=False", "--set", "tensorboard=False",
        "--set", "dropout_rate=0.1", "--set", "optimizer.learning_rate=1e-3",
    ]))
    """
)


def _start(tmp_path, workdir, glue_dir, minilm_dir, stop_at, *, devices, rank, **env):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    args = [str(workdir), str(glue_dir), str(minilm_dir), str(stop_at), str(rank)]
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


def _argv(workdir, glue_dir, minilm_dir, *flags: str, normalizer: str = "isobn") -> list[str]:
    """48 RTE rows, batches of 8: 2 epochs of 6 steps (epoch-end checkpoints 6 and 12),
    dropout on, a train line every 2 steps (a stop at an odd step keeps partial log sums);
    `flags` (`--penalty istar`, `--front-end nnx`) last."""
    sets = ("log_every=2", "dropout_rate=0.1")
    argv = finetune_argv(workdir, glue_dir, minilm_dir, *sets, normalizer=normalizer)
    return [*argv, *flags]


def _assert_same_end(full: pathlib.Path, cut: pathlib.Path) -> dict:
    """Every leaf of the two runs' final state (step 12), their results.json and their
    metrics.jsonl (wall-clock figures aside) are equal, bit for bit; returns the state."""
    want, got = _state(full, 12), _state(cut, 12)
    assert set(want) >= {"params", "opt_state", "batch_stats"} and want["batch_stats"]
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
    return want


def _stopped(tmp_path, argv, hooks: dict, step: int) -> subprocess.CompletedProcess:
    """A child on 4 devices with the fault `hooks` (`helpers.CHILD`): exit 75, `step` saved."""
    done = finish(start_child(tmp_path, argv, hooks, devices=4))
    assert done.returncode == stops.EXIT_PREEMPTED, done.stderr[-3000:]
    assert f"saved the checkpoint of step {step} at {argv[argv.index('--workdir') + 1]}" in (
        done.stderr
    )
    return done


def _stop_mid_epoch(tmp_path, argv, resumed_at: str | None) -> None:
    """SIGTERM right after step 3, SIGINT again while saving it: the child saves step 3
    (epoch 0, batch 3, one train step since the last train line) and exits 75, no results."""
    hooks = {"signal_after_step": [3, "SIGTERM"], "signal_in_save": [3, "SIGINT"]}
    stopped = _stopped(tmp_path, argv, hooks, 3)
    assert "SIGINT again: still saving, ignored" in stopped.stderr
    if resumed_at is not None:
        assert f"at step {resumed_at}" in stopped.stderr
    cut = pathlib.Path(argv[argv.index("--workdir") + 1])
    assert not (cut / "results.json").exists()
    position = json.loads((cut / "checkpoints" / "3" / "position" / "metadata").read_text())
    assert (position["epoch"], position["batch"], position["train_count"]) == (0, 3, 1)


def test_sigterm_in_the_c0_passes_mid_epoch_and_in_a_save_resumes_identical(
    tmp_path, glue_dir, minilm_dir
):
    """The linen classifier with IsoBN and I-STAR's explicit C0 pass (two kinds of running
    state: batch_stats and the stabiliser's C0, issue 50), on 4 devices. Stopped in turn: by
    SIGTERM during epoch 0's C0 pass (saves step 1), right after step 3 (SIGINT again during
    that save), during the epoch-end checkpoint write of step 6 (after the evaluation), during
    epoch 1's C0 pass (saves step 7); each rerun resumes where the last stopped, and the last
    ends with every leaf of the state (params, opt_state, batch_stats, the stabiliser),
    results.json and metrics.jsonl of the uninterrupted run, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = [_argv(w, glue_dir, minilm_dir, "--penalty", "istar") for w in (full, cut)]
    children = [
        start_child(tmp_path, argv[0], devices=4),
        start_child(tmp_path, argv[1], {"signal_in_c0": "SIGTERM"}, devices=4),
    ]
    done, stopped = (finish(child) for child in children)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped.returncode == stops.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert f"saved the checkpoint of step 1 at {cut / 'checkpoints' / '1'}" in stopped.stderr
    _stop_mid_epoch(tmp_path, argv[1], resumed_at="1 (epoch 0, batch 1)")
    assert _steps(cut) == [1, 3]
    stopped = _stopped(tmp_path, argv[1], {"signal_in_save": [6, "SIGTERM"]}, 6)
    assert "at step 3 (epoch 0, batch 3)" in stopped.stderr
    assert dev_lines(cut) == [(6, 1)]  # evaluated before the save it stopped in
    stopped = _stopped(tmp_path, argv[1], {"signal_in_c0": "SIGTERM"}, 7)
    assert "at step 6 (epoch 1, batch 0)" in stopped.stderr

    resumed = finish(start_child(tmp_path, argv[1], devices=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 7 (epoch 1, batch 1)" in resumed.stderr
    want = _assert_same_end(full, cut)
    assert want["stabilizer"]  # the C0 pass's state, compared too


def test_sigterm_saves_that_step_and_the_restart_ends_identical_for_nnx(
    tmp_path, glue_dir, minilm_dir
):
    """The NNX twin (`--front-end nnx`) with IsoBN, on 4 devices: SIGTERM after step 3,
    SIGINT again while saving; the restart ends with the uninterrupted run's state (no
    stabiliser), results.json and metrics.jsonl, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = [_argv(w, glue_dir, minilm_dir, "--front-end", "nnx") for w in (full, cut)]
    done = start_child(tmp_path, argv[0], devices=4)
    _stop_mid_epoch(tmp_path, argv[1], resumed_at=None)
    assert _steps(cut) == [3]
    done = finish(done)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = finish(start_child(tmp_path, argv[1], devices=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 3 (epoch 0, batch 3)" in resumed.stderr
    assert not _assert_same_end(full, cut).get("stabilizer")


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


def test_whiten_stopped_mid_epoch_at_an_epochs_end_and_killed_ends_identical(
    tmp_path, glue_dir, minilm_dir
):
    """Held probe of the turn-5 audit (issue 50) and the audit's finding 6, for `whiten` (its
    running mean, covariance and counters): SIGTERM right after step 3 (exit 75); the rerun
    gets SIGTERM right after step 6, epoch 0's last (exit 75, before the evaluation); the next
    evaluates epoch 1 and is killed hard after step 8 (exit 137, nothing saved past 6); the
    last ends with one dev line per epoch and the uninterrupted run's state, results.json and
    metrics.jsonl, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = [_argv(w, glue_dir, minilm_dir, normalizer="whiten") for w in (full, cut)]
    children = [
        start_child(tmp_path, argv[0], devices=4),
        start_child(tmp_path, argv[1], {"signal_after_step": [3, "SIGTERM"]}, devices=4),
    ]
    done, stopped = (finish(child) for child in children)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stopped.returncode == stops.EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert _steps(cut) == [3]
    _stopped(tmp_path, argv[1], {"signal_after_step": [6, "SIGTERM"]}, 6)
    killed = finish(start_child(tmp_path, argv[1], {"exit_after_step": 8}, devices=4))
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert _steps(cut)[-1] == 6
    resumed = finish(start_child(tmp_path, argv[1], devices=4))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert dev_lines(cut) == [(6, 1), (12, 2)]
    assert "batch_stats" in _assert_same_end(full, cut)
