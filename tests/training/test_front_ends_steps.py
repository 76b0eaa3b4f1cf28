"""Audit 6's probes of NNX through the loop that held, as fast step-level tests (no run folder):
with dropout off, the NNX front end's updates equal linen's for IterNorm under gradient
accumulation and for IterNorm with I-STAR on packed rows, and `remat` changes nothing."""

import jax
import numpy as np
from flax import nnx
from helpers import nnx_from_linen_weights, one_device_mesh, tiny_bert_without_dropout, tiny_config

from isojax.training import distributed, feeds, front_ends, loop


def _updates(config, count: int):
    """`count` updates of epoch 0 (after I-STAR's C0 pass): every step's metrics and the final
    `(params, batch_stats, stabilizer)`."""
    run = loop.setup(config, mesh=one_device_mesh())
    state, logged = run.state, []
    if config.penalty == "istar":
        state = loop.c0_pass(run, state, 0)
    stacked = config.grad_accum_steps > 1
    for batch in feeds.update_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh):
        state, metrics = run.train_fn(
            state, distributed.global_batch(batch, run.mesh, stacked=stacked)
        )
        logged.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        if len(logged) == count:
            break
    params, batch_stats = state.params, state.batch_stats
    if isinstance(params, nnx.State):  # NNX's tree, compared in linen's names
        params, batch_stats = (
            front_ends.to_linen_tree(params),
            front_ends.to_linen_tree(batch_stats),
        )
    final = jax.device_get((params, batch_stats, state.stabilizer))
    return logged, final


def _assert_same(a, b, tol, param_tol):
    (logged_a, final_a), (logged_b, final_b) = a, b
    assert [m.keys() for m in logged_a] == [m.keys() for m in logged_b]
    for ma, mb in zip(logged_a, logged_b, strict=True):
        for key in ma:
            np.testing.assert_allclose(mb[key], ma[key], rtol=tol, atol=tol, err_msg=key)
    leaves_a = jax.tree_util.tree_leaves_with_path(final_a)
    leaves_b = jax.tree.leaves(final_b)
    assert len(leaves_a) == len(leaves_b)
    for (path, x), y in zip(leaves_a, leaves_b, strict=True):
        where = jax.tree_util.keystr(path)
        np.testing.assert_allclose(y, x, rtol=param_tol, atol=param_tol, err_msg=where)


# One case drives both probes of the audit: IterNorm under gradient accumulation (the scan of
# micro-batches) and I-STAR (after its C0 pass) on packed rows; each was a case of its own.
CASE = {
    "normalizer": "iternorm", "grad_accum_steps": 2,
    "penalty": "istar", "packing": True, "istar.weight": -0.5,
}  # fmt: skip


def test_nnx_updates_equal_linen_and_remat_changes_nothing(glue_dir, minilm_dir, monkeypatch):
    """3 updates on RTE, dropout off, IterNorm and I-STAR on packed rows in 2 micro-batches:
    NNX's losses, gradient norms, parameters, running statistics and C0 equal linen's within
    1e-6 (the audit saw every logged figure equal).
    NNX with `remat` equals NNX without within 1e-5 on every logged figure; its parameters
    within 1e-4 (recomputed activations round differently, and Adam's first steps turn a
    gradient at rounding level into an update of up to the learning rate; 3.7e-5 measured).
    Adam's eps is 1e-6, not 1e-8, for the same reason (a rarely seen token's embedding).
    The NNX runs start from linen's initial weights (`nnx_from_linen_weights`)."""
    tiny_bert_without_dropout(monkeypatch)
    nnx_from_linen_weights(monkeypatch)
    fields = {"dropout_rate": 0.0, "max_train_examples": 48, "optimizer.learning_rate": 1e-3,
              "optimizer.warmup_fraction": 0.0, "optimizer.adam_eps": 1e-6,
              **CASE}  # fmt: skip
    linen_run = _updates(tiny_config(glue_dir, minilm_dir, **fields), 3)
    nnx_run = _updates(tiny_config(glue_dir, minilm_dir, front_end="nnx", **fields), 3)
    _assert_same(linen_run, nnx_run, 1e-6, 1e-6)
    remat = _updates(tiny_config(glue_dir, minilm_dir, front_end="nnx", remat=True, **fields), 3)
    _assert_same(nnx_run, remat, 1e-5, 1e-4)  # recomputed activations round differently
    assert len(linen_run[0]) == 3 and linen_run[0][0]["loss"] != linen_run[0][-1]["loss"]
