"""Gradient accumulation: 4 micro-batches of 8 per update give the updates of batches of 32
(padded and packed), running statistics see each micro-batch in order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_device_mesh, tiny_bert_without_dropout

from isojax.training import config as config_lib
from isojax.training import distributed, feeds, loop, steps


def _config(glue_dir, minilm_dir, **overrides):
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {
            "data_dir": str(glue_dir),
            "model": config_lib.TINY_MODEL,
            "tokenizer": str(minilm_dir),
            "task": "rte",
            "normalizer": "none",
            "max_train_examples": 160,
            "max_eval_examples": 8,
            "batch_size": 32,
            "eval_batch_size": 8,
            "max_length": 48,
            "buckets": (16, 32),
            "dropout_rate": 0.0,
            "optimizer.learning_rate": 1e-3,
            "optimizer.warmup_fraction": 0.4,  # the schedule moves within the 5 updates
            **overrides,
        }
    )
    return config


@pytest.fixture(scope="module")
def padded_run(glue_dir, minilm_dir):
    """The padded run without accumulation (dropout off), built once: the reference of the
    equality test and the model of the weighing test (each steps from a copy of its state)."""
    with pytest.MonkeyPatch.context() as patch:
        tiny_bert_without_dropout(patch)
        return loop.setup(_config(glue_dir, minilm_dir), mesh=one_device_mesh())


def _five_updates(config, run=None):
    run = run or loop.setup(config, mesh=one_device_mesh())
    state, seen = jax.tree.map(jnp.copy, run.state), []  # the step donates its state
    start = jax.device_get(run.state.params)
    stacked = config.grad_accum_steps > 1
    for batch in feeds.update_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh):
        seen.append(batch["idx"].reshape(-1))
        state, _ = run.train_fn(state, distributed.global_batch(batch, run.mesh, stacked=stacked))
    assert len(seen) == 5
    return jax.device_get(state), np.concatenate(seen), start


@pytest.mark.parametrize("packed", [False, True])
def test_four_micro_batches_of_8_equal_batches_of_32(
    glue_dir, minilm_dir, monkeypatch, padded_run, packed
):
    """Dropout off (encoder and head), method none: after 5 updates the parameters and the
    optimizer state agree to 1e-5, the step counts updates (the LR schedule's count), and
    both runs saw the same examples in the same order. Packed micro-batches hold different
    numbers of rows, and the stacked batch pads them to a common count."""
    tiny_bert_without_dropout(monkeypatch)
    reference = None if packed else padded_run
    want, want_idx, start = _five_updates(_config(glue_dir, minilm_dir, packing=packed), reference)
    got, got_idx, _ = _five_updates(
        _config(glue_dir, minilm_dir, packing=packed, grad_accum_steps=4)
    )
    np.testing.assert_array_equal(got_idx, want_idx)
    assert int(got.step) == int(want.step) == 5
    jax.tree_util.tree_map_with_path(
        lambda path, a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=jax.tree_util.keystr(path)
        ),
        (got.params, got.opt_state),
        (want.params, want.opt_state),
    )
    moved = jax.tree.map(
        lambda a, b: np.abs(np.asarray(a) - np.asarray(b)).max(), got.params, start
    )
    assert max(jax.tree.leaves(moved)) > 1e-3  # the updates did something


def test_batch_norm_sees_every_micro_batch(glue_dir, minilm_dir):
    """Batch norm's running statistics count each micro-batch (4 per update) under
    accumulation, as PyTorch's accumulation loop does."""
    config = _config(glue_dir, minilm_dir, normalizer="batchnorm", grad_accum_steps=4)
    run = loop.setup(config, mesh=distributed.make_mesh(jax.devices()[:1]))
    batch = next(iter(feeds.update_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh)))
    assert batch["input_ids"].shape[:2] == (4, 8)
    state, _ = run.train_fn(run.state, distributed.global_batch(batch, run.mesh, stacked=True))
    assert int(jax.device_get(state.batch_stats)["norm"]["count"]) == 4


def test_stack_pads_packed_rows_and_moves_global_rows():
    """Packed micro-batches with 2 and 3 rows stack to 3 rows; on process 1 the [CLS] row
    indices (global: process * rows + row) move with the new row count."""
    micro = []
    for rows in (2, 3):
        micro.append(
            {
                "input_ids": np.ones((rows, 4), np.int32),
                "token_type_ids": np.zeros((rows, 4), np.int32),
                "position_ids": np.zeros((rows, 4), np.int32),
                "segment_ids": np.ones((rows, 4), np.int32),
                "token_mask": np.ones((rows, 4), np.int32),
                "cls_index": np.array([[rows + 0, 0], [rows + 1, 0]], np.int32),
                "labels": np.zeros(2, np.int32),
                "example_mask": np.ones(2, np.int32),
                "idx": np.arange(2),
            }
        )
    out = feeds.stack(micro, pad_id=7, process_index=1)
    assert out["input_ids"].shape == (2, 3, 4)
    np.testing.assert_array_equal(out["input_ids"][0, 2], 7)
    np.testing.assert_array_equal(out["token_mask"][0, 2], 0)
    np.testing.assert_array_equal(out["cls_index"][:, :, 0], [[3, 4], [3, 4]])


def test_micro_batches_weigh_real_examples(padded_run):
    """Micro-batches of 8 and of 4 real examples (+4 fillers) make the update of one batch of
    the 12 (not the mean of the two micro-batch means): fails with weights 1/k. The two are
    rows 0-7 and 8-15 of the padded run's first batch of 32 (one padded length)."""
    run = padded_run
    batch = next(iter(feeds.train_batches(run.train_encoded, run.spec.feed, 0)))
    first, second = ({k: v[rows] for k, v in batch.items()} for rows in (slice(8), slice(8, 16)))
    second = second | {"example_mask": np.array([1] * 4 + [0] * 4, np.int32)}
    keys = distributed.BATCH_KEYS
    one = {k: np.concatenate([first[k], second[k][:4]]) for k in keys}
    stacked = {k: np.stack([first[k], second[k]]) for k in keys}
    step = jax.jit(steps.train_step)
    want, want_metrics = step(run.state, one)
    got, got_metrics = step(run.state, stacked)
    jax.tree_util.tree_map_with_path(
        lambda path, a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        ),
        jax.device_get(got.params),
        jax.device_get(want.params),
    )
    assert float(got_metrics["loss"]) == pytest.approx(float(want_metrics["loss"]), rel=1e-5)
    assert float(got_metrics["examples"]) == float(want_metrics["examples"]) == 12
