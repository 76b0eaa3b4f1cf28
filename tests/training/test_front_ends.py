"""One loop for both front ends: `config.front_end = "nnx"` fine-tunes the `isojax.nnx` twin of
the classifier through the same train state, steps, checkpoints and run folder as linen
(`isojax.nnx.pretrained.LinenApply`), and the two agree number for number with dropout off (the
NNX dropout streams draw other masks than linen's from the same key)."""

import json

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from helpers import tiny_bert_without_dropout, tiny_config, tiny_encoder_config

from isojax import linen, runs
from isojax.analysis import run as analysis_run
from isojax.data import glue
from isojax.nnx import pretrained
from isojax.runs import export, predict
from isojax.training import config as config_lib
from isojax.training import loop

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
@pytest.mark.parametrize("fields", [{"normalizer": "isobn"}, {"penalty": "istar"}])
def test_linen_and_nnx_runs_agree(glue_dir, minilm_dir, tmp_path, monkeypatch, fields):
    """RTE, 2 epochs, IsoBN and I-STAR (its C0 pass before each epoch): every logged loss and
    dev metric of the NNX run within 1e-5 of the linen run's, and the same results."""
    tiny_bert_without_dropout(monkeypatch)
    results = {}
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
    if "normalizer" in fields:
        _assert_same_tools(tmp_path, results["nnx"], glue_dir)


def _assert_same_tools(tmp_path, nnx_results: dict, glue_dir) -> None:
    """`predict`, `export` and `analyze --run` on the NNX run: its own dev numbers exactly
    (the restore runs its NNX modules), the linen run's logits, exported weights and head
    inputs within 1e-5."""
    restored = {f: runs.restore(tmp_path / f) for f in ("linen", "nnx")}
    assert isinstance(restored["nnx"].apply, pretrained.LinenApply)
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


def test_the_nnx_apply_is_the_linen_apply_of_the_same_variables():
    """`LinenApply` over the tiny classifier: the eval-mode logits and the train-mode
    `batch_stats` (dropout off) of linen's `apply`, gradients too; with dropout on, a function
    of the key."""
    enc = tiny_encoder_config()
    head = linen.SequenceClassifier(
        encoder=linen.Encoder(enc), num_labels=2, normalizer="isobn", dropout_rate=0.0
    )
    variables = linen.init_variables(head, jax.random.key(0))
    apply = pretrained.LinenApply.of(lambda: pretrained.from_linen(head, rngs=nnx.Rngs(0)))
    ids = jax.random.randint(jax.random.key(1), (8, 12), 1, 99)
    mask = np.ones(ids.shape, np.int32)
    kwargs = dict(deterministic=False, rngs={"dropout": jax.random.key(2)}, mutable=["batch_stats"])
    (want, _), want_stats = head.apply(variables, ids, mask, **kwargs)
    (got, _), got_stats = jax.jit(lambda v: apply(v, ids, mask, **kwargs))(variables)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), got_stats, want_stats)

    def loss(apply_fn, params):
        v = {"params": params, "batch_stats": variables["batch_stats"]}
        return apply_fn(v, ids, mask, deterministic=True)[0].sum()

    grads = jax.grad(lambda p: loss(apply, p))(variables["params"])
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        grads,
        jax.grad(lambda p: loss(head.apply, p))(variables["params"]),
    )
    assert apply == pretrained.LinenApply.of(lambda: pretrained.from_linen(head, rngs=nnx.Rngs(1)))


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
