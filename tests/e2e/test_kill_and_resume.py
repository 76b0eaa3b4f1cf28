"""A killed run resumes to the same parameters and metrics as an uninterrupted one (bit for
bit, CPU)."""

import json
import pathlib
import signal
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from children import child_env, finish
from helpers import one_device_mesh

from isojax.logs import install_log_handler
from isojax.training import config as config_lib
from isojax.training import loop, throughput

pytestmark = pytest.mark.e2e

# A failed tensorstore read can leave orbax an asyncio callback that fires after its event loop
# closed ("Event loop is closed", reported as unraisable); the restore itself behaves.
_ORBAX_LATE_CALLBACK = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# The run: I-STAR with the "epoch" stabiliser (a window of 5 steps) on 24 RTE rows in packed
# batches of 8 (2 epochs of 3 steps), a checkpoint every 2 steps, dropout keys from "rbg".
def _settings(glue_dir, minilm_dir) -> dict:
    return {
        "data_dir": str(glue_dir), "model": "tiny-bert", "tokenizer": str(minilm_dir),
        "task": "rte", "penalty": "istar", "istar.weight": 0.5,
        "istar.stabilizer.kind": "epoch", "istar.stabilizer.unit": "steps",
        "istar.stabilizer.window": 5, "max_train_examples": 24, "max_eval_examples": 8,
        "batch_size": 8, "eval_batch_size": 8, "max_length": 32, "buckets": (),
        "num_epochs": 2, "checkpoint_every": 2, "log_every": 1, "progress": False,
        "tensorboard": False, "rng_impl": "rbg", "packing": True,
    }  # fmt: skip


_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from isojax.logs import install_log_handler
    from isojax.training import checkpointing, loop
    from isojax.training import config as config_lib

    install_log_handler()  # the lines `isojax finetune` shows ("resumed ...") on stderr
    mode, workdir, settings = sys.argv[1:]
    config = config_lib.default_config()
    config.update_from_flattened_dict(json.loads(settings))
    if mode == "kill":  # die right after the checkpoint of step 4 (epoch 1, batch 1)
        save = checkpointing.Checkpointer.save
        def save_then_die(self, step, state, position):
            save(self, step, state, position)
            if step == 4:
                os.kill(os.getpid(), signal.SIGKILL)
        checkpointing.Checkpointer.save = save_then_die
    loop.train_and_evaluate(config, workdir)
    """
)


def _start_child(tmp_path, mode, workdir, settings: dict) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    # The session's executables (the same programs as this process's: bit-identical). One
    # device: the property is the resume, not the sharding (tests/e2e/test_preemption.py
    # stops and resumes a sharded run).
    env = child_env(devices=1)
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(workdir), json.dumps(settings)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _untimed(path: pathlib.Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures (`throughput.TIMED_KEYS`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in throughput.TIMED_KEYS} for row in rows]


def _final_state(workdir: pathlib.Path, step: int) -> dict:
    return ocp.StandardCheckpointer().restore(workdir / "checkpoints" / str(step) / "state")


# The previous test's late orbax callback may fire only once this one has started.
@_ORBAX_LATE_CALLBACK
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, glue_dir, minilm_dir, capsys):
    """I-STAR ("epoch" stabiliser, a window of 5 steps) on 24 RTE rows in packed batches (the
    presets' layout; padded batches resume through the same `start_batch`, data/test_batching.py), 2
    epochs of 3 steps, a checkpoint every 2 steps, dropout keys from "rbg". The killed run dies
    after saving step 4 (mid-epoch 1, mid-window); the restarted run picks up there (state, the
    stabiliser's open window, data position, partial log sums) and ends exactly where the
    uninterrupted run does: every leaf of the final state, results, metrics.jsonl."""
    full, broken = tmp_path / "full", tmp_path / "broken"
    settings = _settings(glue_dir, minilm_dir)
    # The killed run in a child; meanwhile the uninterrupted one in this process on its first
    # device (a child's programs on one device: the same numbers, bit for bit, without a
    # child's start); the resume after both, here too.
    killing = _start_child(tmp_path, "kill", broken, settings)
    config = config_lib.default_config()
    config.update_from_flattened_dict(settings)
    loop.train_and_evaluate(config, full, mesh=one_device_mesh())
    killed = finish(killing)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (broken / "results.json").exists()
    assert sorted(int(p.name) for p in (broken / "checkpoints").iterdir()) == [3, 4]
    # The resume in this process too (a run folder on disk is all it reads; the kill is the
    # child's): the lines `isojax finetune` shows on stderr.
    install_log_handler()
    capsys.readouterr()
    loop.train_and_evaluate(config, broken, mesh=one_device_mesh())
    resumed = capsys.readouterr().err
    assert "resumed" in resumed and "at step 4 (epoch 1, batch 1)" in resumed

    want, got = _final_state(full, 6), _final_state(broken, 6)
    assert jax.tree.structure(want) == jax.tree.structure(got)
    jax.tree_util.tree_map_with_path(
        lambda path, a, b: np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        ),
        want,
        got,
    )
    assert int(want["step"]) == 6 and want["stabilizer"]["c0"].shape == (32, 32)
    # The window closed at step 5 (after the resume), and step 6 opened the next one.
    assert int(want["stabilizer"]["windows_closed"]) == 1
    assert int(want["stabilizer"]["steps_in_window"]) == 1
    assert json.loads((full / "results.json").read_text()) == json.loads(
        (broken / "results.json").read_text()
    )
    assert _untimed(full / "metrics.jsonl") == _untimed(broken / "metrics.jsonl")
