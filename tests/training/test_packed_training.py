"""Packed batches in the loop (`config.packing`): the same training, evaluation and C0 as padded
batches, with a bounded number of compiled shapes.

The model-level equality (per-example logits, loss, gradients and `batch_stats` of one packed
batch, for all four encoder families) is in data/test_packing.py; here the wiring: `feeds.batches`,
`distributed.global_batch`, the steps' masks, the C0 pass and the dev evaluation. Dropout masks
have the shape of the rows, so packed and padded training agree in distribution only; the
equality tests switch dropout off.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import arm, tiny_config

from isojax.data import packing
from isojax.training import config as config_lib
from isojax.training import distributed, evaluation, feeds, front_ends, loop, steps


def _without_dropout(run: loop.Run) -> loop.Run:
    """`run` with every dropout rate 0 (encoder and head) and its steps recompiled."""
    encoder = run.model.encoder
    enc_config = encoder.config.replace(hidden_dropout=0.0, attention_dropout=0.0)
    model = run.model.clone(encoder=encoder.clone(config=enc_config), dropout_rate=0.0)
    state = run.state.replace(apply_fn=front_ends.LinenApply(model))
    train_fn, eval_fn, c0_pass_fn = steps.jit_steps(state, run.mesh)
    return dataclasses.replace(
        run, state=state, model=model, train_fn=train_fn, eval_fn=eval_fn, c0_pass_fn=c0_pass_fn
    )


def _config(glue_dir, minilm_dir, method: str, packed: bool, **overrides):
    fields = {
        "task": "rte",  # pairs; max_length 32 truncates most, so many fill a whole row
        **arm(method),
        "packing": packed,
        "max_train_examples": 40,
        "max_eval_examples": 12,  # the last dev batch of 8 holds 4 fillers
        "optimizer.learning_rate": 1e-3,
        "optimizer.warmup_fraction": 0.0,
        # The attention key bias has no true gradient (softmax is shift-invariant): Adam with
        # eps 1e-8 would turn the two layouts' different rounding noise into updates.
        "optimizer.adam_eps": 1e-6,
        "istar.weight": -0.5,
        "istar.stabilizer.tokens": 300,
    }
    return tiny_config(glue_dir, minilm_dir, **(fields | overrides))


@pytest.fixture(scope="module")
def isobn_runs(glue_dir, minilm_dir) -> dict:
    """`{packed: run}` of the IsoBN config, dropout off, built once: the padded-vs-packed
    training and evaluation tests read them (the training copies the state it donates)."""
    return {
        p: _without_dropout(loop.setup(_config(glue_dir, minilm_dir, "isobn", p)))
        for p in (False, True)
    }


def _packed_epoch_rows(run, state, packed: bool) -> tuple:
    """The epoch's updates from a copy of `state` (the step donates it): the final state, the
    losses, and the row counts of the batches (packed: one compiled shape per row count)."""
    state, losses, rows = jax.tree.map(jnp.copy, state), [], set()
    for batch in feeds.train_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh):
        assert packing.is_packed(batch) == packed
        rows.add(batch["input_ids"].shape[0])
        state, m = run.train_fn(state, distributed.global_batch(batch, run.mesh))
        losses.append(float(m["loss"]))
    return state, losses, rows


def _bounded_compiles(run, rows: set) -> None:
    """The packed train step compiled once per row count used, never more than the row
    buckets (2 for 8 examples a step on 4 devices), each a multiple of the devices."""
    bound = len(packing.resolve_row_buckets(None, run.spec.feed.batch_size, run.mesh.size))
    assert run.train_fn._cache_size() == len(rows) <= bound == 2
    assert all(r % run.mesh.size == 0 for r in rows)


@pytest.mark.parametrize("method", ["isobn", "istar"])
def test_packed_training_equals_padded_training_after_5_steps(
    glue_dir, minilm_dir, isobn_runs, method
):
    """5 updates (I-STAR: after its C0 pass) on 4 devices: parameters, `batch_stats` and C0
    agree to 1e-4, and so does every step's loss. The packed epoch of RTE's long pairs
    compiles at most one shape per row bucket (CoLA's short sentences: the test below)."""
    finals = {}
    for packed in (False, True):
        if method == "isobn":
            run = isobn_runs[packed]
        else:
            run = _without_dropout(loop.setup(_config(glue_dir, minilm_dir, method, packed)))
        assert run.steps_per_epoch == 5
        state = run.state
        initial = jax.device_get(state.params)  # the same for both layouts (same seed)
        if method == "istar":
            state = loop.c0_pass(run, state, 0)
        state, losses, rows = _packed_epoch_rows(run, state, packed)
        if packed:
            _bounded_compiles(run, rows)
        finals[packed] = (jax.device_get(state), losses)
    (plain, plain_losses), (packed, packed_losses) = finals[False], finals[True]
    np.testing.assert_allclose(packed_losses, plain_losses, rtol=1e-5, atol=1e-6)
    assert plain_losses[-1] != plain_losses[0]
    for name in ("params", "batch_stats", "stabilizer"):
        flat_plain = jax.tree_util.tree_leaves_with_path(getattr(plain, name))
        flat_packed = jax.tree.leaves(getattr(packed, name))
        assert len(flat_plain) == len(flat_packed)
        for (path, a), b in zip(flat_plain, flat_packed, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-4, err_msg=f"{name} {path}")
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), plain.params, initial))
    assert max(moved) > 1e-3  # the steps did change the parameters


def test_packed_evaluation_counts_each_dev_example_once(isobn_runs):
    """The dev evaluation over packed batches (12 examples, last batch 4 fillers) gives the
    padded evaluation's logits row for row, and its metrics and isotropy (the initial state:
    the same for both layouts; an evaluation has no dropout)."""
    results = {}
    for packed, run in isobn_runs.items():
        encoded = run.dev_encoded["dev"]
        logits, acc = evaluation.eval_outputs(
            run.eval_fn, run.state, encoded, run.spec.feed, run.mesh, run.hidden_size
        )
        assert logits.shape == (12, 2)
        assert int(acc.sentence.moments.count) == 12
        results[packed] = (logits, acc, evaluation.evaluate(run, run.state, encoded))
    np.testing.assert_allclose(results[True][0], results[False][0], atol=1e-5)
    assert int(results[True][1].tokens.count) == int(results[False][1].tokens.count)
    plain, packed = results[False][2], results[True][2]
    assert plain.keys() == packed.keys()
    for key in plain:
        np.testing.assert_allclose(packed[key], plain[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_an_epoch_of_packed_steps_compiles_at_most_one_shape_per_row_bucket(glue_dir, minilm_dir):
    """CoLA's short sentences, 8 examples per step on 4 devices: the train step compiles once
    per row count used, never more than the row buckets (RTE's long pairs: in the packed
    training above, which runs a packed epoch of RTE on the same mesh)."""
    config = _config(glue_dir, minilm_dir, "none", True, task="cola", max_train_examples=48)
    run = loop.setup(config)
    _, _, rows = _packed_epoch_rows(run, run.state, True)
    _bounded_compiles(run, rows)


def test_packing_refuses_the_reference_padding_option():
    config = config_lib.default_config()
    config.packing, config.penalty, config.istar.include_padding = True, "istar", True
    with pytest.raises(ValueError, match="istar.include_padding"):
        config_lib.validate_config(config)
    config.penalty = "none"  # the option of a penalty that is not run does not matter
    config_lib.validate_config(config)


@pytest.mark.e2e  # a whole run
def test_packed_run_end_to_end(glue_dir, minilm_dir, tmp_path):
    """`train_and_evaluate` with packing: two I-STAR steps (C0 pass) and a dev evaluation."""
    config = _config(glue_dir, minilm_dir, "istar", True, max_steps=2)
    result = loop.train_and_evaluate(config, tmp_path)
    assert (result["step"], result["epoch"]) == (2, 1)
    dev = result["dev"]
    assert 0.0 <= dev["accuracy"] <= 1.0 and 0.0 < dev["tokens_isoscore_star"] <= 1.0
