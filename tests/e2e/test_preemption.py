"""Save on preemption: `isojax finetune` sent SIGTERM mid-epoch saves the step it stopped on,
exits with `stops.EXIT_PREEMPTED`, and resumes to the uninterrupted run's end (two processes
that stop together: tests/e2e/test_stops.py).

Each resume test costs an uninterrupted run and a chain of stopped ones resumed in turn, so
each carries as many kinds of running state, and each chain as many ways to stop, as it can:
the linen run is IsoBN + I-STAR (batch statistics and the C0 pass's stabiliser), sharded over
2 devices (the chain that checks a sharded run's stop and resume), stopped in both C0 passes,
mid-epoch (a second signal during that save), at an epoch's last step before its evaluation
(the audit's finding 6), during the epoch-end checkpoint write that follows the resumed
evaluation (held probes 11 and 12, /work/shared/AUDIT.md) and killed hard: each epoch is
logged once; the NNX run is `whiten` (its running mean, covariance and counters) on one
device and in the test process, where the property is the resume, not the sharding or the
process (the linen chain's three stops of the loop's position run there too)."""

import json
import pathlib
import signal
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from children import finetune_argv, finish, install_hooks, start_child
from helpers import dev_lines

from isojax import cli, logs
from isojax.cli import finetune
from isojax.training import distributed, loop, stops, throughput

pytestmark = pytest.mark.e2e


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


def _reference(argv: list, devices: int) -> None:
    """The run of `argv` (the uninterrupted one; the NNX test's stops too) in this process, on
    its first `devices`: the programs of a child on as many devices, the same numbers bit for
    bit, without a child's start (its imports, the tokenizer, the model's build: a few seconds
    of CPU)."""
    args = cli.build_parser().parse_args(argv)
    mesh = distributed.make_mesh(jax.devices()[:devices])
    loop.train_and_evaluate(finetune.finetune_config(args), args.workdir, mesh=mesh)


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


# The linen chain is sharded over 2 devices (a device's share of each batch, the sharded
# restore); 2 devices shard as 4 do, and each child starts faster.
SHARDED = 2


def _preempted(done: subprocess.CompletedProcess, cut: pathlib.Path, step: int):
    """`done` (a child) exited 75 naming the checkpoint of `step` it saved in `cut`."""
    assert done.returncode == stops.EXIT_PREEMPTED, done.stderr[-3000:]
    assert f"saved the checkpoint of step {step} at {cut}" in done.stderr
    return done


def _stopped(tmp_path, argv, hooks: dict, step: int, devices: int) -> subprocess.CompletedProcess:
    """A child on `devices` with the fault `hooks` (`children.CHILD`): exit 75, `step` saved."""
    done = finish(start_child(tmp_path, argv, hooks, devices=devices))
    return _preempted(done, pathlib.Path(argv[argv.index("--workdir") + 1]), step)


# SIGTERM right after step 3, SIGINT again while saving it (`children.CHILD`'s hooks).
_MID_EPOCH = {"signal_after_step": [3, "SIGTERM"], "signal_in_save": [3, "SIGINT"]}


def _stopped_mid_epoch(done, cut: pathlib.Path, resumed_at: str | None) -> None:
    """A child of `_MID_EPOCH` saved step 3 (epoch 0, batch 3, one train step since the last
    train line), ignoring the second signal, and exited 75, no results."""
    stopped = _preempted(done, cut, 3)
    assert "SIGINT again: still saving, ignored" in stopped.stderr
    if resumed_at is not None:
        assert f"at step {resumed_at}" in stopped.stderr
    assert not (cut / "results.json").exists()
    position = json.loads((cut / "checkpoints" / "3" / "position" / "metadata").read_text())
    assert (position["epoch"], position["batch"], position["train_count"]) == (0, 3, 1)


def test_sigterm_in_the_c0_passes_mid_epoch_at_an_epochs_end_and_in_a_save_resumes_identical(
    tmp_path, glue_dir, minilm_dir, capsys
):
    """The linen classifier with IsoBN and I-STAR's explicit C0 pass (two kinds of running
    state: batch_stats and the stabiliser's C0, issue 50), sharded over 2 devices. Stopped in
    turn: by SIGTERM during epoch 0's C0 pass (saves step 1); right after step 3 (SIGINT again
    during that save); right after step 6, epoch 0's last (saved before the evaluation: the
    audit's finding 6); during the epoch-end checkpoint write of step 6 that follows the
    resumed run's evaluation of epoch 1 (held probe 12); during epoch 1's C0 pass (saves step
    7; epoch 1 not evaluated again: held probe 11); killed hard after step 8 (exit 137,
    nothing saved past 7). Each rerun resumes where the last stopped, and the last ends with
    one dev line per epoch and every leaf of the state (params, opt_state, batch_stats, the
    stabiliser), results.json and metrics.jsonl of the uninterrupted run, bit for bit."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = [_argv(w, glue_dir, minilm_dir, "--penalty", "istar") for w in (full, cut)]
    stopping = start_child(tmp_path, argv[1], {"signal_in_c0": "SIGTERM"}, devices=SHARDED)
    _reference(argv[0], SHARDED)
    _preempted(finish(stopping), cut / "checkpoints" / "1", 1)
    stopped = finish(start_child(tmp_path, argv[1], _MID_EPOCH, devices=SHARDED))
    _stopped_mid_epoch(stopped, cut, "1 (epoch 0, batch 1)")
    assert _steps(cut) == [1, 3]
    # The three stops of the loop's position (finding 6, probes 12 and 11) in this process:
    # a child's exit status, its signals and a fresh interpreter's resume are the others'.
    stopped = _stopped_here(argv[1], {"signal_after_step": [6, "SIGTERM"]}, 6, SHARDED, capsys)
    assert "at step 3 (epoch 0, batch 3)" in stopped.stderr
    assert not (cut / "metrics.jsonl").exists() or dev_lines(cut) == []  # not evaluated
    stopped = _stopped_here(argv[1], {"signal_in_save": [6, "SIGTERM"]}, 6, SHARDED, capsys)
    assert "at step 6 (epoch 0, batch 6)" in stopped.stderr
    assert dev_lines(cut) == [(6, 1)]  # evaluated before the save it stopped in
    stopped = _stopped_here(argv[1], {"signal_in_c0": "SIGTERM"}, 7, SHARDED, capsys)
    assert "at step 6 (epoch 1, batch 0)" in stopped.stderr
    assert dev_lines(cut) == [(6, 1)]  # the checkpoint says evaluated: not again
    killed = finish(start_child(tmp_path, argv[1], {"exit_after_step": 8}, devices=SHARDED))
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert _steps(cut)[-1] == 7

    resumed = finish(start_child(tmp_path, argv[1], devices=SHARDED))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 7 (epoch 1, batch 1)" in resumed.stderr
    assert dev_lines(cut) == [(6, 1), (12, 2)]
    want = _assert_same_end(full, cut)
    assert want["stabilizer"]  # the C0 pass's state, compared too


def _stopped_here(argv, hooks: dict, step: int, devices: int, capsys):
    """`_stopped` in this process (`_reference`'s call, the child's programs on as many
    devices): `stops.Preempted` (exit status 75), `step` saved; the test process's signal
    handlers back after it. Returns what it wrote on stderr, as a completed process."""
    handlers = [signal.getsignal(s) for s in stops.SIGNALS]
    logs.install_log_handler()  # the library's lines on stderr, as `isojax finetune` shows them
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as patched:
        install_hooks(hooks, patched.setattr)  # `children.CHILD`'s hooks, here
        with pytest.raises(stops.Preempted) as stop:
            _reference(argv, devices)
    assert [signal.getsignal(s) for s in stops.SIGNALS] == handlers
    done = subprocess.CompletedProcess(argv, stop.value.code, "", capsys.readouterr().err)
    return _preempted(done, pathlib.Path(argv[argv.index("--workdir") + 1]), step)


def test_sigterm_saves_that_step_and_the_restart_ends_identical_for_nnx(
    tmp_path, glue_dir, minilm_dir, capsys
):
    """The NNX twin (`--front-end nnx`) with `whiten` (its running mean, covariance and
    counters; no stabiliser), on one device: SIGTERM after step 3, SIGINT again while saving;
    the restart ends with the uninterrupted run's state, results.json and metrics.jsonl, bit
    for bit. All in this process (`_reference`'s call): the property is the NNX state's save and
    resume; a child's exit status 75, its signals and its hard kill are the linen chain's."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    argv = [
        _argv(w, glue_dir, minilm_dir, "--front-end", "nnx", normalizer="whiten")
        for w in (full, cut)
    ]
    _reference(argv[0], 1)
    _stopped_mid_epoch(_stopped_here(argv[1], _MID_EPOCH, 3, 1, capsys), cut, None)
    assert _steps(cut) == [3]
    _reference(argv[1], 1)
    assert "at step 3 (epoch 0, batch 3)" in capsys.readouterr().err
    assert not _assert_same_end(full, cut).get("stabilizer")
