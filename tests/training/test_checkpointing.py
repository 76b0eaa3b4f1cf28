"""Checkpointer.restore: a changed train state stops with the differences named and moves no
file; only damaged files fall back to an older checkpoint."""

import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from isojax.training import checkpointing


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


def test_damaged_metadata_falls_back_and_sets_the_step_aside(tmp_path):
    _saved(tmp_path)
    (tmp_path / "2" / "state" / "_METADATA").write_bytes(b"{not json")
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"step 2 .* cannot be restored.*back to step 1"):
            state, position = ckpt.restore(_state(0.0))
        assert ckpt.all_steps() == [1]
    assert (tmp_path / "2.unreadable").is_dir()
    np.testing.assert_array_equal(state["params"]["w"], 1.0)
    assert position == {"epoch": 0, "batch": 1}


def test_damaged_position_file_falls_back(tmp_path):
    _saved(tmp_path)
    (tmp_path / "2" / "position" / "metadata").write_text("][")
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(RuntimeWarning, match=r"step 2 .* cannot be restored.*back to step 1"):
            _, position = ckpt.restore(_state(0.0))
    assert position == {"epoch": 0, "batch": 1}
