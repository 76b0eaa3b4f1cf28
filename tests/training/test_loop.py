"""Tests for isojax.training.loop / isojax.training.steps: the steps, the loop (the config and
optimizer: test_config.py).

A random tiny BERT (hidden 32, 2 layers) over the real MiniLM WordPiece vocabulary (30522 ids,
so no id is clipped) runs on 16 real rows of each local GLUE task.
"""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import arm, one_device_mesh, tiny_config

from isojax.core import isotropy, penalties
from isojax.core.normalizers import NORMALIZERS
from isojax.data import batching
from isojax.models import transformer
from isojax.training import config as config_lib
from isojax.training import distributed, evaluation, feeds, loop, run_folder, specs, steps

# ---------------------------------------------------------------------------------------------
# Steps.
# ---------------------------------------------------------------------------------------------


@jax.jit  # one trace per state layout, not one per call
def _train_mode_forward(s, b):
    return s.apply_fn(
        {"params": s.params, "batch_stats": s.batch_stats},
        **transformer.model_inputs(b),
        deterministic=False,
        use_running_average=False,
        example_mask=b["example_mask"],
        rngs={"dropout": steps.dropout_key(s)},
        mutable=["batch_stats"],
    )


def _train_mode_tokens(run, state, batch) -> np.ndarray:
    """float64 `[n, d]`: every layer's real tokens of the forward pass that `train_step` runs
    on `batch` from `state` (train mode, the step's dropout key)."""
    (_, out), _ = _train_mode_forward(state, batch)
    hidden = np.stack([np.asarray(h, np.float64) for h in out["encoder"].hidden_states])
    real = np.asarray(steps.penalty_mask(batch, False)).astype(bool)  # [b, t]
    return hidden[:, real].reshape(-1, hidden.shape[-1])


# "recenter" and "batchnorm" take the path of "isobn" (a head normaliser with batch_stats),
# "layernorm" that of "none" (one without); the normalisers themselves: test_norms.py.
SAME_PATH = ("recenter", "batchnorm", "layernorm")
STEP_CASES = [
    (method, "pass") for method in (*NORMALIZERS, "istar", "cosreg") if method not in SAME_PATH
] + [
    ("istar", "epoch"),
    ("istar", "ema"),
]


@pytest.mark.parametrize("method, stabilizer", STEP_CASES)
def test_repeated_steps_lower_the_loss_for_every_method(glue_dir, minilm_dir, method, stabilizer):
    """Ten updates on one batch (no classifier dropout, lr 5e-3) lower that batch's loss; the
    state's collections are what the method needs, and the step counter advances. A running
    I-STAR stabiliser is checked against the covariance of the tokens of the model's own
    forward passes: "epoch" (window of 2 steps) keeps C0 until the window closes, then holds
    the unbiased covariance of the window's tokens; "ema" (debiased, the default) starts at
    zero, so C0 after step t is the debiased average of the batch covariances: cov(batch 1)
    after the first step, at the hidden states' scale."""
    config = tiny_config(
        glue_dir,
        minilm_dir,
        **arm(method),
        dropout_rate=0.0,
        **{"optimizer.learning_rate": 5e-3, "optimizer.warmup_fraction": 0.0},
        **{"optimizer.schedule": "constant", "istar.weight": 0.5, "cosreg.weight": 0.5},
        **{"istar.stabilizer.kind": stabilizer, "istar.stabilizer.unit": "steps"},
        **{"istar.stabilizer.window": 2, "istar.stabilizer.momentum": 0.75},
    )
    run = loop.setup(config, mesh=one_device_mesh())
    batch = distributed.global_batch(
        next(feeds.train_batches(run.train_encoded, run.spec.feed, 0)), run.mesh
    )
    state = run.state
    assert (state.stabilizer is not None) == (method == "istar")
    assert bool(state.batch_stats) == (
        method in ("recenter", "batchnorm", "isobn", "whiten", "iternorm")
    )
    want = np.eye(run.hidden_size)  # C0 before any update
    ema = np.zeros_like(want)
    losses, tokens = [], []
    for i in range(10):
        if i < 2 and stabilizer != "pass":
            tokens.append(_train_mode_tokens(run, state, batch))
        state, m = run.train_fn(state, batch)
        losses.append(float(m["loss"]))
        assert float(m["grads_finite"]) == 1.0
        if i < 2 and stabilizer != "pass":
            c0 = np.asarray(state.stabilizer["c0"])
            if stabilizer == "ema":
                ema = 0.75 * ema + 0.25 * np.cov(tokens[-1], rowvar=False)
                want = ema / (1 - 0.75 ** (i + 1))
                if i == 0:  # the first C0 is the first batch's covariance
                    np.testing.assert_allclose(
                        want, np.cov(tokens[0], rowvar=False), rtol=1e-12, atol=1e-15
                    )
            elif i == 1:  # the window of 2 steps closes
                want = np.cov(np.concatenate(tokens), rowvar=False)
                assert int(state.stabilizer["steps_in_window"]) == (i + 1) % 2
            np.testing.assert_allclose(c0, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert int(state.step) == 10
    assert np.all(np.isfinite(losses))
    # Whitening a 32-d vector from 8-row batches (shrunk towards tau I) learns slower in 10
    # steps: 0.694 -> 0.625 measured, where the others lose more than 10 %.
    assert losses[-1] < (0.95 if method == "whiten" else 0.9) * losses[0], losses
    if method in ("istar", "cosreg"):
        assert float(m["penalty"]) != 0.0
        np.testing.assert_allclose(
            float(m["loss"]), float(m["task_loss"]) + 0.5 * float(m["penalty"]), rtol=1e-5
        )
    if stabilizer == "epoch":
        assert int(state.stabilizer["windows_closed"]) == 5


def _penalty_inputs(seed: int, filler: int):
    """Hidden states `L=2 x [6 + filler, 5, 8]` and a batch whose last `filler` rows are filler
    rows (example_mask 0) full of huge values; 6 real rows with ragged padding."""
    rng = np.random.default_rng(seed)
    b = 6 + filler
    hidden = [rng.normal(size=(8, 5, 8)) @ rng.normal(size=(8, 8)) + 2.0 for _ in range(2)]
    hidden = [h[:b] for h in hidden]
    lengths = np.array([5, 3, 2, 5, 4, 1] + [5] * filler)
    attention = (np.arange(5)[None] < lengths[:, None]).astype(np.int32)
    example = np.array([1] * 6 + [0] * filler, np.int32)
    for h in hidden:
        h[6:] = 1e4
    batch = {"attention_mask": jnp.asarray(attention), "example_mask": jnp.asarray(example)}
    return [jnp.asarray(h, jnp.float32) for h in hidden], batch


@pytest.mark.parametrize(
    "method, stabilizer", [("istar", "pass"), ("istar", "ema"), ("cosreg", "")]
)
@pytest.mark.parametrize("include_padding", [False, True])
def test_filler_rows_never_enter_the_penalty_or_c0(method, stabilizer, include_padding):
    """The penalty, the running stabiliser and the C0 pass of a batch padded with filler rows
    equal those of the batch without them; `include_padding` adds only real rows' padding
    (the I-STAR penalty checked against `penalties.istar_penalty` on the real rows)."""
    c0 = specs.StabilizerSpec(kind=stabilizer or "pass", momentum=0.5)
    objective = specs.ObjectiveSpec(
        penalty=method,
        istar=specs.IStarSpec(weight=1.0, include_padding=include_padding, stabilizer=c0),
        cosreg=specs.CosRegSpec(weight=1.0, include_padding=include_padding),
    )
    results = []
    for filler in (0, 2):
        hidden, batch = _penalty_inputs(0, filler)
        out = {"encoder": types.SimpleNamespace(hidden_states=hidden)}
        state = types.SimpleNamespace(
            objective=objective,
            stabilizer=steps.init_istar_state(objective, 8),
            params=None,
            batch_stats={},
            apply_fn=lambda *args, out=out, **kwargs: (None, out),  # the C0 pass's "model"
        )
        penalty, new_stabilizer = steps._penalty(state, out, batch)
        inputs = batch | {"input_ids": None, "token_type_ids": None}
        acc = steps.c0_pass_step(state, inputs, penalties.c0_pass_init(8))
        results.append((penalty, new_stabilizer, acc, acc.count))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
        results[0][1:],
        results[1][1:],
    )
    hidden, batch = _penalty_inputs(0, 0)
    real_tokens = 30 if include_padding else 20
    assert float(results[1][3]) == 2 * real_tokens
    if method == "istar":
        mask = None if include_padding else batch["attention_mask"]
        want = penalties.istar_penalty(hidden, mask, zeta=0.2)
        np.testing.assert_allclose(results[1][0], want, rtol=1e-5)


def test_eval_isotropy_equals_direct_computation(glue_dir, minilm_dir):
    """The dev-set accumulation over padded, sharded batches equals isotropy.* on all the
    sentence vectors and tokens at once (12 rows: the last batch has 4 filler rows)."""
    config = tiny_config(glue_dir, minilm_dir, normalizer="isobn", max_eval_examples=12)
    run = loop.setup(config)  # 4 devices
    state = run.state
    acc = evaluation.eval_accumulator_init(run.hidden_size)
    sentences, pre_logits, tokens, last_tokens = [], [], [], []
    logits_all = []
    apply = jax.jit(run.model.apply)
    for batch in batching.batches(run.dev_encoded["dev"], batch_size=8, buckets=None):
        acc, out = run.eval_fn(state, distributed.global_batch(batch, run.mesh), acc)
        logits, direct = apply(
            {"params": state.params, "batch_stats": state.batch_stats},
            batch["input_ids"],
            batch["attention_mask"],
            batch["token_type_ids"],
        )
        real = batch["example_mask"].astype(bool)
        sentences.append(np.asarray(direct["sentence"])[real])
        pre_logits.append(np.asarray(direct["pre_logits"])[real])
        hidden = np.stack([np.asarray(h) for h in direct["encoder"].hidden_states])
        token_mask = batch["attention_mask"][real].astype(bool)
        tokens.append(hidden[:, real][token_mask[None].repeat(2, 0)])
        last_tokens.append(hidden[-1, real][token_mask])
        logits_all.append(np.asarray(logits)[real])
        np.testing.assert_allclose(np.asarray(out["logits"])[real], logits_all[-1], atol=1e-5)
    got = jax.device_get(evaluation.isotropy_metrics(acc))
    x = np.concatenate(sentences).astype(np.float64)
    cov = np.cov(x, rowvar=False, bias=True)
    eig = np.sort(np.linalg.eigvalsh(cov))[::-1]
    np.testing.assert_allclose(got["sentence_ev1"], eig[0] / eig.sum(), rtol=1e-4)
    np.testing.assert_allclose(got["sentence_ev3"], eig[:3].sum() / eig.sum(), rtol=1e-4)
    np.testing.assert_allclose(got["sentence_isoscore"], isotropy.isoscore(x), rtol=1e-4)
    np.testing.assert_allclose(
        got["sentence_mean_cosine"], isotropy.mean_cosine_similarity(x), rtol=1e-4, atol=1e-6
    )
    t = np.concatenate(tokens).astype(np.float64)
    np.testing.assert_allclose(got["tokens_isoscore"], isotropy.isoscore(t), rtol=1e-4)
    assert int(acc.sentence.moments.count) == 12
    for key, points in (("pre_logits", pre_logits), ("last_tokens", last_tokens)):
        x = np.concatenate(points).astype(np.float64)
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        cosines = unit @ unit.T
        n = len(x)
        want = (cosines.sum() - np.trace(cosines)) / (n * (n - 1))
        np.testing.assert_allclose(got[f"{key}_mean_cosine"], want, rtol=1e-4, atol=1e-6)
    for key, points in (("sentence", sentences), ("pre_logits", pre_logits)):
        _assert_geometry(got, key, np.concatenate(points).astype(np.float64))
    mean = np.concatenate(last_tokens).astype(np.float64).mean(0)
    np.testing.assert_allclose(got["last_tokens_max_abs_mean"], np.abs(mean).max(), rtol=1e-4)
    assert np.abs(mean).max() > 2 * np.median(np.abs(mean))  # an outlier to find


def _assert_geometry(got: dict, key: str, x: np.ndarray) -> None:
    """The SPEC.md §10.4 keys of `key` against float64 NumPy on the rows `x` (12 < d here)."""

    def entropy_rank(s, eps=0.0):
        p = s / s.sum() + eps
        p = p[p > 0]
        return np.exp(-np.sum(p * np.log(p)))

    erank = entropy_rank(np.linalg.svd(x - x.mean(0), compute_uv=False))
    rankme = entropy_rank(np.linalg.svd(x, compute_uv=False), 1e-7)
    var = x.var(0)
    np.testing.assert_allclose(got[f"{key}_erank"], erank, rtol=1e-4)
    np.testing.assert_allclose(got[f"{key}_rankme"], rankme, rtol=1e-4)
    assert got[f"{key}_outliers"] == np.sum(var >= 5 * var.mean())
    assert got[f"{key}_principal_outlier"] == np.argmax(var)
    np.testing.assert_allclose(got[f"{key}_principal_outlier_share"], var.max() / var.sum(), 1e-4)


# ---------------------------------------------------------------------------------------------
# The loop, end to end.
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e  # a whole run
@pytest.mark.parametrize(
    "task, method, stabilizer",
    [
        ("cola", "isobn", "pass"),
        ("mrpc", "istar", "pass"),
        ("rte", "istar", "ema"),
        ("stsb", "istar", "epoch"),
    ],
)
def test_two_steps_end_to_end(glue_dir, minilm_dir, tmp_path, task, method, stabilizer):
    """Two steps and a dev evaluation through `train_and_evaluate` on one device (the loop on
    4 devices: test_distributed, test_checkpoint_resume), for each task type and each I-STAR
    stabiliser (the other methods' steps: test_repeated_steps_lower_the_loss_...)."""
    config = tiny_config(
        glue_dir,
        minilm_dir,
        task=task,
        **arm(method),
        max_steps=2,
        **{"istar.stabilizer.kind": stabilizer},
    )
    config.tensorboard = task == "rte"
    result = loop.train_and_evaluate(config, tmp_path, mesh=one_device_mesh())
    assert (result["step"], result["epoch"]) == (2, 1)
    dev = result["dev"]
    metric = {"cola": "matthews_correlation", "mrpc": "f1", "rte": "accuracy", "stsb": "pearson"}
    assert -1.0 <= dev[metric[task]] <= 1.0 and "score" in dev
    for key in ("sentence_ev1", "sentence_ev3", "sentence_isoscore", "sentence_mean_cosine"):
        assert np.isfinite(dev[key])
    assert 0.0 < dev["sentence_ev1"] <= dev["sentence_ev3"] <= 1.0
    assert 0.0 <= dev["tokens_isoscore"] <= 1.0
    assert ("tokens_isoscore_star" in dev) == (method == "istar")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("dev", 2)]
    # 2 steps, int(0.1 * 2) = 0 warm-up steps: the linear decay from 2e-5 at update 0.
    np.testing.assert_allclose([r["learning_rate"] for r in records[:2]], [2e-5, 1e-5], rtol=1e-6)
    assert json.loads((tmp_path / "results.json").read_text()) == result
    assert (tmp_path / "checkpoints" / "2").is_dir()
    if method == "istar":  # the checkpoint holds the stabiliser's whole collection
        saved = ocp.StandardCheckpointer().restore(tmp_path / "checkpoints" / "2" / "state")
        stabilizer_state = saved["stabilizer"]
        assert set(stabilizer_state) >= {"c0"} and stabilizer_state["c0"].shape == (32, 32)
        if stabilizer != "pass":
            assert int(stabilizer_state["count"]) == 2
        else:  # the C0 pass replaced the identity
            assert not np.allclose(stabilizer_state["c0"], np.eye(32))
    assert bool(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == (task == "rte")


def test_resume_refuses_a_config_that_changes_the_run(tmp_path):
    config = config_lib.default_config()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text(config.to_json())
    config.log_every, config.progress = 7, False  # harmless
    run_folder.check_same_run(specs.RunSpec.of(config).fields, tmp_path)
    config.method, config.optimizer.learning_rate = "isobn", 1e-3
    with pytest.raises(
        ValueError, match=r"another config \(method and optimizer.learning_rate differ\)"
    ):
        run_folder.check_same_run(specs.RunSpec.of(config).fields, tmp_path)


# ---------------------------------------------------------------------------------------------
# The C0 pass that training runs (method "istar", stabilizer kind "pass").
# ---------------------------------------------------------------------------------------------


_EVAL_APPLY: dict[int, tuple] = {}  # id(model) -> (model, its jitted apply)


def _eval_apply(model):
    """`model.apply` jitted once per model (each bound `model.apply` is a new function to jit,
    traced again at every call)."""
    if id(model) not in _EVAL_APPLY or _EVAL_APPLY[id(model)][0] is not model:
        jitted = jax.jit(model.apply, static_argnames=("deterministic", "use_running_average"))
        _EVAL_APPLY[id(model)] = (model, jitted)
    return _EVAL_APPLY[id(model)][1]


def _eval_tokens(run, state, batch) -> np.ndarray:
    """float64 `[n, d]`: every layer's real tokens of `batch` in eval mode (dropout off)."""
    _, out = _eval_apply(run.model)(
        {"params": state.params, "batch_stats": state.batch_stats},
        batch["input_ids"],
        batch["attention_mask"],
        batch["token_type_ids"],
        deterministic=True,
        use_running_average=True,
    )
    hidden = np.stack([np.asarray(h, np.float64) for h in out["encoder"].hidden_states])
    real = (batch["attention_mask"] * batch["example_mask"][:, None]).astype(bool)
    return hidden[:, real].reshape(-1, hidden.shape[-1])


def test_c0_pass_stops_at_its_token_count_and_equals_the_numpy_covariance(glue_dir, minilm_dir):
    """`loop.c0_pass` reads the epoch's training batches in order until
    `istar.stabilizer.tokens` token vectors (every layer's real tokens counted), the batch
    that reaches the count included whole, and its C0 is the float64 unbiased covariance of
    those eval-mode tokens (a count of one batch's tokens, and of one token more: one run
    serves both)."""
    config = tiny_config(glue_dir, minilm_dir, penalty="istar", max_train_examples=24)
    run = loop.setup(config, mesh=distributed.make_mesh(jax.devices()[:1]))
    batches = list(feeds.train_batches(run.train_encoded, run.spec.feed, 0))
    assert len(batches) == 3
    tokens = [_eval_tokens(run, run.state, b) for b in batches]
    for extra in (0, 1):
        # `istar.stabilizer.tokens`: 1 batch, or 1 token more: 2
        objective = run.spec.state.objective
        c0 = dataclasses.replace(objective.istar.stabilizer, tokens=len(tokens[0]) + extra)
        istar = dataclasses.replace(objective.istar, stabilizer=c0)
        objective = dataclasses.replace(objective, istar=istar)
        spec = dataclasses.replace(
            run.spec, state=dataclasses.replace(run.spec.state, objective=objective)
        )
        calls = []

        def counting(state, batch, acc, calls=calls):
            calls.append(1)
            return run.c0_pass_fn(state, batch, acc)

        changed = dataclasses.replace(run, spec=spec, c0_pass_fn=counting)
        state = loop.c0_pass(changed, run.state, 0)
        used = 1 + extra
        assert len(calls) == used
        want = np.cov(np.concatenate(tokens[:used]), rowvar=False)
        c0 = np.asarray(state.stabilizer["c0"])
        np.testing.assert_allclose(c0, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        assert not np.allclose(c0, np.cov(np.concatenate(tokens), rowvar=False), rtol=1e-3)


@pytest.mark.e2e  # a whole run
def test_c0_pass_is_rebuilt_before_each_epoch_from_the_updated_parameters(
    glue_dir, minilm_dir, tmp_path, monkeypatch
):
    """Two epochs: the loop runs the pass before each, over that epoch's batches and the
    parameters trained so far; the second C0 differs from the first."""
    config = tiny_config(
        glue_dir, minilm_dir, penalty="istar", num_epochs=2, **{"optimizer.learning_rate": 1e-3}
    )
    config.istar.stabilizer.tokens = 10**6  # every batch of the epoch
    passes = []
    original = loop.c0_pass

    def recording(run, state, epoch):
        new_state = original(run, state, epoch)
        passes.append((run, jax.device_get(state), epoch, np.asarray(new_state.stabilizer["c0"])))
        return new_state

    monkeypatch.setattr(loop, "c0_pass", recording)
    loop.train_and_evaluate(config, tmp_path, mesh=one_device_mesh())
    assert [(int(s.step), epoch) for _, s, epoch, _ in passes] == [(0, 0), (2, 1)]
    for run, state, epoch, c0 in passes:
        batches = feeds.train_batches(run.train_encoded, run.spec.feed, epoch)
        want = np.cov(np.concatenate([_eval_tokens(run, state, b) for b in batches]), rowvar=False)
        np.testing.assert_allclose(c0, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert np.abs(passes[1][3] - passes[0][3]).max() > 1e-3 * np.abs(passes[0][3]).max()
