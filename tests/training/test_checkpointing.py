"""Checkpointer.restore: a changed train state stops with the differences named and moves no
file; only damaged files fall back to an older checkpoint; atomic saves; a full disk is one
line."""

import errno
import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import logged_warning

from isojax.training import checkpointing, run_folder


def _state(value: float, **changes) -> dict:
    params = {"w": jnp.full((4, 3), value), "b": jnp.zeros(3)}
    state = {
        "params": params,
        "opt_state": optax.chain(optax.clip(1.0), optax.adamw(1e-3)).init(params),  # empty nodes
        "batch_stats": {},
        "stabilizer": None,
        "step": jnp.asarray(int(value), jnp.int32),
    }
    state["params"].update(changes)
    return state


def _files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _saved(tmp_path) -> dict[str, bytes]:
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(float(step)), {"epoch": 0, "batch": step})
    return _files(tmp_path)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"c": jnp.zeros(2)}, r"params\.c: in the train state, not in the checkpoint"),
        ({"b": None}, r"params\.b: in the checkpoint, not in the train state"),
        (
            {"w": jnp.zeros((5, 3))},
            r"params\.w: saved float32\[4, 3\], train state float32\[5, 3\]",
        ),
        (
            {"w": jnp.zeros((4, 3), jnp.bfloat16)},
            r"params\.w: saved float32\[4, 3\], train state bfloat16\[4, 3\]",
        ),
    ],
)
def test_changed_train_state_is_named_and_no_file_moves(tmp_path, changes, named):
    before = _saved(tmp_path)
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(checkpointing.CheckpointMismatch, match=rf"step 2 .*{named}"):
            ckpt.restore(_state(0.0, **changes))
        assert ckpt.all_steps() == [1, 2]
    assert _files(tmp_path) == before  # nothing renamed, rewritten or removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


def test_damaged_metadata_falls_back_and_sets_the_step_aside(caplog, tmp_path):
    _saved(tmp_path)
    (tmp_path / "2" / "state" / "_METADATA").write_bytes(b"{not json")
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with logged_warning(caplog, r"step 2 .* cannot be restored.*back to step 1"):
            state, position = ckpt.restore(_state(0.0))
        assert ckpt.all_steps() == [1]
    assert (tmp_path / "2.unreadable").is_dir()
    np.testing.assert_array_equal(state["params"]["w"], 1.0)
    assert position == {"epoch": 0, "batch": 1}


def test_damaged_position_file_falls_back(caplog, tmp_path):
    _saved(tmp_path)
    (tmp_path / "2" / "position" / "metadata").write_text("][")
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with logged_warning(caplog, r"step 2 .* cannot be restored.*back to step 1"):
            _, position = ckpt.restore(_state(0.0))
    assert position == {"epoch": 0, "batch": 1}


# ---------------------------------------------------------------------------------------------
# Fallback past an unreadable newest checkpoint, atomic saves.
# ---------------------------------------------------------------------------------------------


def _plain_state(value: float) -> dict:
    return {
        "params": {"w": jnp.full((4, 3), value), "b": jnp.zeros(3)},
        "batch_stats": {},
        "step": jnp.asarray(int(value), jnp.int32),
    }


# A failed tensorstore read can leave orbax an asyncio callback that fires after its event loop
# closed ("Event loop is closed", reported as unraisable); the restore itself behaves.
_ORBAX_LATE_CALLBACK = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@_ORBAX_LATE_CALLBACK
def test_truncated_newest_checkpoint_falls_back_with_a_warning(caplog, tmp_path):
    with checkpointing.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, _plain_state(float(step)), {"epoch": 0, "batch": step})
        assert ckpt.all_steps() == [2, 3]  # max_to_keep
    data = [
        p for p in (tmp_path / "3" / "state").rglob("*") if p.is_file() and p.parent.name == "d"
    ]
    assert data
    for path in data:  # a disk that filled up mid-write
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with logged_warning(caplog, "step 3 .* cannot be restored.*back to step 2"):
            state, position = ckpt.restore(_plain_state(0.0))
        assert ckpt.all_steps() == [2]  # the bad one is set aside, and may be written again
        ckpt.save(3, _plain_state(3.0), {"epoch": 0, "batch": 3})
    assert (tmp_path / "3.unreadable").is_dir() and (tmp_path / "3").is_dir()
    np.testing.assert_array_equal(state["params"]["w"], 2.0)
    assert position == {"epoch": 0, "batch": 2}


def test_unfinished_save_is_ignored(tmp_path):
    """orbax writes into `<step>.orbax-checkpoint-tmp-*` and renames when complete: a run
    killed while saving leaves such a folder, which restore skips."""
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _plain_state(1.0), {"epoch": 0, "batch": 1})
    partial = tmp_path / "2.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(tmp_path / "1", partial)
    (partial / "state" / "_METADATA").unlink()
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [1]
        state, position = ckpt.restore(_plain_state(0.0))
    assert position == {"epoch": 0, "batch": 1} and int(state["step"]) == 1


@_ORBAX_LATE_CALLBACK
def test_no_checkpoint_restores_none_and_unreadable_only_raises(caplog, tmp_path):
    with checkpointing.Checkpointer(tmp_path / "a") as ckpt:
        assert ckpt.restore(_plain_state(0.0)) is None
    with checkpointing.Checkpointer(tmp_path / "b") as ckpt:
        ckpt.save(1, _plain_state(1.0), {})
    for path in (tmp_path / "b" / "1" / "state").rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")
    with checkpointing.Checkpointer(tmp_path / "b") as ckpt:
        with logged_warning(caplog, "none left"), pytest.raises(RuntimeError):
            ckpt.restore(_plain_state(0.0))


# ---------------------------------------------------------------------------------------------
# A full disk (issue 25, item 15) is one line, and keeps the old checkpoint.
# ---------------------------------------------------------------------------------------------


def test_a_full_disk_is_one_line_and_keeps_the_older_checkpoint(monkeypatch, tmp_path):
    state = {"w": jnp.ones(3)}
    ckpt = checkpointing.Checkpointer(tmp_path)
    ckpt.save(1, state, {"epoch": 0})
    real = ckpt._manager.save

    def full(step, args):  # what tensorstore raises once the disk fills mid-write
        (tmp_path / f"{step}.orbax-checkpoint-tmp").mkdir()
        raise ValueError(
            f'RESOURCE_EXHAUSTED: Error writing "w/0": Failed writing: "{tmp_path}/d/0": '
            "No space left on device [os_error_code='28']"
        )

    monkeypatch.setattr(ckpt._manager, "save", full)
    with pytest.raises(checkpointing.CheckpointWriteError) as info:
        ckpt.save(2, state, {"epoch": 1})
    assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
    assert f"step 2 in {tmp_path}: No space left on device" in str(info.value)
    assert "steps [1] are kept" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # the unfinished folder is gone
    monkeypatch.setattr(ckpt._manager, "save", real)
    restored, position = ckpt.restore(state)
    assert position == {"epoch": 0}
    ckpt.close()


def test_writer_thread_errors_of_every_kind_are_logged_not_printed(capfd, caplog):
    """tensorstore's C++ threads print a failed callback with `PyErr_Print` (through
    `sys.excepthook`) or `PyErr_WriteUnraisable` (`sys.unraisablehook`), Python threads with
    `threading.excepthook`: during a save all three go to the DEBUG log, and after it the hooks
    are the ones before."""
    import ctypes
    import logging
    import sys
    import threading

    class Dies:
        def __del__(self):
            raise RuntimeError("unraisable: Event loop is closed")

    def thread_dies():
        raise RuntimeError("thread: Event loop is closed")

    before = threading.excepthook, sys.unraisablehook, sys.excepthook
    with caplog.at_level(logging.DEBUG, "isojax"), checkpointing._ThreadErrors().caught():
        ctypes.pythonapi.PyRun_SimpleString(b"raise RuntimeError('print: Event loop is closed')")
        Dies()
        worker = threading.Thread(target=thread_dies)
        worker.start()
        worker.join()
    assert (threading.excepthook, sys.unraisablehook, sys.excepthook) == before
    assert capfd.readouterr().err == ""
    logged = " ".join(r.getMessage() for r in caplog.records)
    for kind in ("print", "unraisable", "thread"):
        assert f"{kind}: Event loop is closed" in logged


@pytest.mark.parametrize(
    "before, now, named",
    [
        ({"normalizer_kwargs": {}}, {"normalizer_kwargs.iterations": 7},
         "(normalizer_kwargs.iterations differs)"),
        ({"front_end": "linen"}, {"front_end": "nnx"}, "(front_end differs)"),
        ({"seed": 0, "front_end": "linen"}, {"seed": 1, "front_end": "nnx"},
         "(front_end and seed differ)"),
    ],
)  # fmt: skip
def test_a_changed_config_names_each_field_once(tmp_path, before, now, named):
    """Audit 6, finding 11: "(normalizer_kwargs, normalizer_kwargs.iterations differ)" and
    "(front_end differ)"; each changed field is named once, in grammatical English."""
    (tmp_path / "config.json").write_text(
        json.dumps({"task": "rte", "normalizer": "none", **before})
    )
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(run_folder.ConfigChanged) as err:
        run_folder.check_same_run({"task": "rte", "normalizer": "none", **now}, tmp_path)
    assert named in str(err.value), str(err.value)
