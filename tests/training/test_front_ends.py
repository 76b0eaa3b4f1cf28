"""One loop for both front ends (`isojax.training.front_ends`): `config.front_end = "nnx"`
fine-tunes an `isojax.nnx` classifier that runs its own code (its constructors' initialisers,
`nnx.merge` in the step, its own dropout streams, NNX's paths in the checkpoints), through the
same steps, checkpoints and run folder as linen; started from the same weights, the two agree
number for number with dropout off (NNX's dropout streams draw other masks than linen's key)."""

import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy
from flax import nnx
from helpers import (
    nnx_from_linen_weights,
    one_device_mesh,
    tiny_bert_without_dropout,
    tiny_config,
    tiny_encoder_config,
)

from isojax import runs
from isojax.analysis import run as analysis_run
from isojax.data import glue
from isojax.nnx import heads as nnx_heads
from isojax.runs import export, predict
from isojax.training import config as config_lib
from isojax.training import distributed, feeds, front_ends, loop

MEASURED = ("_per_s", "_time_s", "flops_per_step", "_bytes", "mfu")


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _assert_same_run(linen_dir, nnx_dir, tol=1e-5) -> int:
    """Every logged figure of the two runs but the measured ones (time, throughput, the
    compiled step's FLOPs and memory) within `tol`: the training losses, gradient norms and
    every dev metric; returns how many values were compared."""
    compared = 0
    a, b = _records(linen_dir), _records(nnx_dir)
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key, value in ra.items():
            if key.endswith(MEASURED) or isinstance(value, str):
                continue
            np.testing.assert_allclose(rb[key], value, rtol=tol, atol=tol, err_msg=key)
            compared += 1
    return compared


@pytest.mark.e2e  # whole runs
def test_linen_and_nnx_runs_agree(glue_dir, minilm_dir, tmp_path, monkeypatch):
    """RTE, 2 epochs, IsoBN with I-STAR (its C0 pass before each epoch; one run drives both,
    which were a run each): every logged loss and dev metric of the NNX run within 1e-5 of the
    linen run's, and the same results; the NNX run starts from linen's initial weights
    (`nnx_from_linen_weights`)."""
    tiny_bert_without_dropout(monkeypatch)
    nnx_from_linen_weights(monkeypatch)
    results = {}
    fields = {"normalizer": "isobn", "penalty": "istar"}
    for front_end in ("linen", "nnx"):
        config = tiny_config(
            glue_dir, minilm_dir, num_epochs=2, dropout_rate=0.0, front_end=front_end, **fields
        )
        results[front_end] = loop.train_and_evaluate(config, tmp_path / front_end)
    compared = _assert_same_run(tmp_path / "linen", tmp_path / "nnx")
    assert compared > 40
    for key, value in results["linen"]["dev"].items():
        np.testing.assert_allclose(results["nnx"]["dev"][key], value, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "nnx" / "config.json").read_text())["front_end"] == "nnx"
    assert {"penalty", "tokens_isoscore_star"} <= set(_records(tmp_path / "nnx")[0]) | set(
        results["nnx"]["dev"]
    )  # I-STAR's figures were compared too
    _assert_same_tools(tmp_path, results["nnx"], glue_dir)


def _assert_same_tools(tmp_path, nnx_results: dict, glue_dir) -> None:
    """`predict`, `export` and `analyze --run` on the NNX run: its own dev numbers exactly
    (the restore runs its NNX modules), the linen run's logits, exported weights and head
    inputs within 1e-5."""
    restored = {f: runs.restore(tmp_path / f) for f in ("linen", "nnx")}
    assert isinstance(restored["nnx"].apply, front_ends.NnxApply)
    preds = {f: predict.predict(r, "dev") for f, r in restored.items()}
    assert preds["nnx"].metrics == nnx_results["dev"]
    np.testing.assert_allclose(preds["nnx"].logits, preds["linen"].logits, atol=1e-5)
    weights = {}
    for front_end, one in restored.items():
        folder = export.export_run(one, tmp_path / f"hf-{front_end}").folder
        weights[front_end] = safetensors.numpy.load_file(folder / "model.safetensors")
    assert weights["nnx"].keys() == weights["linen"].keys()
    for name, value in weights["linen"].items():
        np.testing.assert_allclose(weights["nnx"][name], value, atol=1e-5, err_msg=name)
    examples = glue.load_tsv(glue_dir, "rte", "dev", labelled=True)[:16]
    z = {f: analysis_run.head_inputs(r, examples)[0] for f, r in restored.items()}
    np.testing.assert_allclose(z["nnx"], z["linen"], atol=1e-5)
    report = analysis_run.analyze_run(restored["nnx"], examples)
    assert report.dropout["examples"] == 16 and report.dropout["dropout"] == 0.0  # dropout off


def test_nnx_front_end_refuses_one_row_micro_batches():
    """`validate_config` is the NNX run's too: IsoBN on one-row micro-batches, one line."""
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {"front_end": "nnx", "normalizer": "isobn", "batch_size": 4, "grad_accum_steps": 4}
    )
    with pytest.raises(config_lib.ConfigError, match="1 row.s. per micro-batch") as info:
        config_lib.validate_config(config)
    assert "\n" not in str(info.value)
    config.front_end = "flax"
    with pytest.raises(config_lib.ConfigError, match="front_end must be one of"):
        config_lib.validate_config(config)


def test_the_command_refuses_nnx_one_row_micro_batches_in_one_line(tmp_path, capsys):
    """`isojax finetune --front-end nnx` with one-row micro-batches: one line, status 2, before
    anything is built (as linen's, tests/e2e/test_stops.py)."""
    from isojax import cli

    argv = ["finetune", "--front-end", "nnx", "--normalizer", "isobn", "--workdir", tmp_path]
    argv += ["--set", "batch_size=4", "--set", "grad_accum_steps=4"]
    assert cli.main([str(a) for a in argv]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("isojax finetune: error: config: batch_size / grad_accum_steps")
    assert "1 row(s) per micro-batch" in line and "'isobn'" in line
    assert not any(tmp_path.iterdir())


def _tiny_nnx(normalizer="isobn", dropout_rate=0.0) -> front_ends.NnxClassifier:
    return front_ends.NnxClassifier(
        encoder=front_ends.NnxEncoder(tiny_encoder_config()),
        num_labels=2,
        sentence="pooled",
        normalizer=normalizer,
        normalizer_kwargs={},
        dropout_rate=dropout_rate,
    )


def test_the_nnx_apply_merges_the_nnx_model_and_equals_its_linen_twin():
    """`NnxApply` over the tiny classifier's own NNX state: the eval-mode logits, the
    train-mode `batch_stats` (dropout off) and the gradients of its linen twin
    (`isojax.nnx.export.to_linen`, the same weights), by `linen_path`; it compares by value."""
    model = _tiny_nnx()
    params, batch_stats, rngs = front_ends.NNX.init(
        model, jax.random.key(0), jax.random.key_data(jax.random.key(1)), None, "threefry2x32"
    )
    apply = front_ends.NNX.apply(model, None, "threefry2x32")
    variables = {"params": params, "batch_stats": batch_stats}
    head, linen_variables = apply.to_linen(variables)
    ids = jax.random.randint(jax.random.key(1), (8, 12), 1, 99)
    mask = np.ones(ids.shape, np.int32)
    (got, _), stats, after = jax.jit(lambda v, r: apply.train(v, r, ids, mask))(variables, rngs)
    (want, _), want_stats = jax.jit(  # one program each, not op by op
        lambda v: head.apply(v, ids, mask, deterministic=False, mutable=["batch_stats"])
    )(linen_variables)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    want_flat = jax.tree.leaves_with_path(want_stats["batch_stats"])
    assert len(want_flat) == len(jax.tree.leaves(stats)) > 0
    got_linen = front_ends.to_linen_tree(stats)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got_linen,
                 want_stats["batch_stats"])  # fmt: skip

    def loss(params):
        v = {"params": params, "batch_stats": batch_stats}
        return apply(v, ids, mask, deterministic=True)[0].sum()

    grads = front_ends.to_linen_tree(jax.jit(jax.grad(loss))(params))
    want_grads = jax.jit(
        jax.grad(
            lambda p: head.apply({**linen_variables, "params": p}, ids, mask, deterministic=True)[
                0
            ].sum()
        )
    )(linen_variables["params"])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), grads,
                 want_grads)  # fmt: skip
    assert apply == front_ends.NNX.apply(model, None, "threefry2x32")


def _linen_apply_refused(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a linen module was applied in an NNX run")

    monkeypatch.setattr(nn.Module, "apply", refuse)


def test_an_nnx_train_step_applies_no_linen_module_and_moves_its_own_streams(
    glue_dir, minilm_dir, monkeypatch
):
    """With linen's `Module.apply` patched to raise: an NNX run's train steps (IsoBN, I-STAR,
    dropout on, 2 micro-batches) run; the same seed gives the same step bit for bit; the
    dropout streams' counters move on every micro-batch (the scan carries the streams)."""
    _linen_apply_refused(monkeypatch)
    fields = {"normalizer": "isobn", "penalty": "istar", "istar.stabilizer.kind": "ema"}
    config = tiny_config(glue_dir, minilm_dir, front_end="nnx", grad_accum_steps=2, **fields)
    run = loop.setup(config, mesh=one_device_mesh())
    # A second build from the seed starts from the same state bit for bit (params, running
    # statistics, dropout streams); the step from that state, run twice (from copies: it
    # donates), gives the same result bit for bit: together, the same seed's same step.
    again = loop.setup(config, mesh=one_device_mesh()).state
    built = [jax.tree_util.tree_leaves_with_path(jax.device_get(s)) for s in (run.state, again)]
    assert [p for p, _ in built[0]] == [p for p, _ in built[1]] and len(built[0]) > 50
    for (path, a), (_, b) in zip(*built, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    batch = next(iter(feeds.update_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh)))
    batch = distributed.global_batch(batch, run.mesh, stacked=True)
    logged = []
    for start in (jax.tree.map(jnp.copy, run.state), run.state):
        state, metrics = run.train_fn(start, batch)
        logged.append(jax.device_get((metrics, state.params)))
    assert isinstance(state.params, nnx.State) and isinstance(state.rng, nnx.State)
    counts = [v.get_value() for _, v in nnx.to_flat_state(state.rng) if isinstance(v, nnx.RngCount)]
    # Each stream draws once per call of its dropout in each of the 2 micro-batches.
    assert len(counts) > 4 and all(int(c) > 0 and int(c) % 2 == 0 for c in counts)
    jax.tree.map(np.testing.assert_array_equal, logged[0], logged[1])
    assert int(state.stabilizer["count"]) == 2  # the ema stabiliser moved in the core step


@pytest.mark.e2e  # a whole run
def test_an_nnx_run_initialises_with_its_own_constructors_and_saves_nnx_paths(
    glue_dir, minilm_dir, tmp_path, monkeypatch
):
    """A distinct initialiser planted in the NNX head's constructor (its kernel 0.125
    everywhere) is in the run's first checkpoint (the warm-up's first step has learning rate 0,
    the second moves a weight by about 1e-5); no linen module is applied in the whole run; the
    checkpoint's paths are NNX's (`encoder/layers/0/...`, the dropout streams' keys)."""
    init = types.SimpleNamespace(
        normal=lambda std: nnx.initializers.constant(0.125), constant=nnx.initializers.constant
    )
    monkeypatch.setattr(
        nnx_heads, "nnx", types.SimpleNamespace(**{**vars(nnx), "initializers": init})
    )
    _linen_apply_refused(monkeypatch)
    config = tiny_config(glue_dir, minilm_dir, front_end="nnx", normalizer="isobn")
    loop.train_and_evaluate(config, tmp_path)
    first = min(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    with ocp.StandardCheckpointer() as reader:
        state = reader.restore(tmp_path / "checkpoints" / str(first) / "state")
        tree = reader.metadata(tmp_path / "checkpoints" / str(first) / "state").item_metadata.tree
    kernel = np.asarray(state["params"]["classifier"]["kernel"]["value"])
    assert kernel.shape == (32, 2)
    np.testing.assert_allclose(kernel, 0.125, atol=1e-4)
    paths = {"/".join(map(str, k)) for k in ocp.tree.to_flat_dict(tree)}
    assert "params/encoder/layers/0/attention/query/kernel/value" in paths
    assert "batch_stats/norm/cov/value" in paths
    assert "rng/encoder/layers/1/output_dropout/rngs/key/value" in paths or any(
        p.startswith("rng/encoder/layers/1/") and p.endswith("rngs/key/value") for p in paths
    )
    assert not any("layer_0" in p for p in paths)


def test_a_study_cell_keeps_its_hash_with_the_front_end_field(monkeypatch):
    """`front_end` joined the config after studies were recorded: at its default ("linen") a
    cell's `config_hash` is the one it had without the field, and "nnx" changes it."""
    from experiments.study import grid

    class Recipe:
        NON_RUN_FIELDS = ("data_dir",)

    config = config_lib.default_config()
    with_field = grid.config_hash(config, Recipe)
    del config["front_end"]
    assert grid.config_hash(config, Recipe) == with_field
    config.front_end = "nnx"
    assert grid.config_hash(config, Recipe) != with_field
