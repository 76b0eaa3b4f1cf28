"""`isojax analyze --run`: a fine-tuned run's isotropy report equals its own dev evaluation.

A tiny run (random 2-layer BERT, hidden 32, MiniLM's WordPiece vocabulary) trains two epochs of
two steps on a synthetic RTE-format TSV written in tmp_path; the dev split has 19 rows, so the
last evaluation batch of 8 carries filler rows. The reference is the run's own dev evaluation
(`evaluation.evaluate` -> `evaluation.isotropy_metrics`) of the same checkpoint, as
`results.json` holds it: the newest checkpoint's under "dev", the best dev epoch's under "best".
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from helpers import tiny_config

from isojax import analysis, cli, runs
from isojax.analysis import run as run_analysis
from isojax.core import posthoc
from isojax.data import batching
from isojax.runs import predict
from isojax.training import loop

pytestmark = pytest.mark.e2e  # whole runs: the e2e lane

WORDS = "the a cat dog man woman car city ran saw ate big small red old new house".split()
DEV_ROWS = 19
# The tiny random model's sentence vectors are nearly parallel (mean cosine 0.999994), so their
# covariance is a small difference of large float32 numbers: the run's evaluation (batch sharded
# over 4 devices) and analyze (one device) differ by up to 3e-5 relative in IsoScore. A wrong
# mode (the normaliser's batch statistics instead of its running ones) moves the head input's
# EV_1, EV_3 and IsoScore by 0.7-12 %.
RTOL = 1e-4
# analyze's Report keys -> the suffixes of the isotropy keys of the run's dev evaluation.
KEYS = {"EV_1": "ev1", "EV_3": "ev3", "isoscore": "isoscore", "mean_cosine": "mean_cosine"}
KEYS |= {key: key for key in analysis.GEOMETRY}  # SPEC.md §10.4


def write_rte(root, rows: dict[str, int], seed: int = 0):
    """`root/RTE/<split>.tsv` of random word pairs, labels alternating."""
    rng = np.random.default_rng(seed)
    folder = root / "RTE"
    folder.mkdir(parents=True)
    for split, n in rows.items():
        lines = ["index\tsentence1\tsentence2\tlabel"]
        for i in range(n):
            a, b = (" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(2))
            lines.append(f"{i}\t{a}.\t{b}.\t{('entailment', 'not_entailment')[i % 2]}")
        (folder / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def run_cli(capsys, argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def isobn_run(tmp_path_factory, minilm_dir):
    """`(run folder, results)` of an IsoBN run: 2 epochs of 2 steps, 19 dev rows."""
    root = tmp_path_factory.mktemp("analyze_run")
    data = write_rte(root / "glue", {"train": 16, "dev": DEV_ROWS})
    config = tiny_config(data, minilm_dir, normalizer="isobn", num_epochs=2)
    config.max_eval_examples = None
    results = loop.train_and_evaluate(config, root / "run")
    return root / "run", results


@pytest.fixture(scope="module")
def latest(isobn_run):
    """`runs.restore` of the run's newest checkpoint, restored once for the tests that read it
    (each builds what it changes anew: `dataclasses.replace`, never in place)."""
    return runs.restore(isobn_run[0])


def assert_equals_evaluation(summary: dict, evaluation: dict) -> None:
    """The sentence vector's and the head input's figures equal the run's evaluation."""
    compared = 0
    for name, prefix in ((summary["sentence"], "sentence"), (analysis.HEAD_INPUT, "pre_logits")):
        assert summary[name]["count"] == DEV_ROWS
        for key, suffix in KEYS.items():
            if f"{prefix}_{suffix}" not in evaluation:  # pre_logits_mean_cosine: newer steps
                continue
            compared += 1
            np.testing.assert_allclose(
                summary[name][key], evaluation[f"{prefix}_{suffix}"], rtol=RTOL, err_msg=name
            )
    assert compared >= 7


@pytest.mark.parametrize("best", [False, True])
def test_analyze_run_equals_the_runs_dev_evaluation(capsys, tmp_path, isobn_run, best):
    run_dir, results = isobn_run
    evaluation = (results["best"] if best else results)["dev"]
    step = (results["best"] if best else results)["step"]
    argv = ["analyze", "--run", run_dir, "--out", tmp_path]
    # Batches of 5 (the run evaluated in 8s): the statistics do not depend on the batching.
    argv += ["--best"] if best else ["--batch-size", "5"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0, err
    checkpoint = "best" if best else "latest"
    assert f"({checkpoint} checkpoint, step {step}) on rte dev ({DEV_ROWS} rows)" in out
    assert "pre_logits = isobn(pooled)" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sentence"] == "pooled"
    assert set(summary) == {
        "cls",
        "pooled",
        "pre_logits",
        "layers",
        "sentence",
        "head_input_dropout",
    }
    noise = summary["head_input_dropout"]
    assert noise["examples"] == DEV_ROWS and noise["dropout"] > 0
    assert f"one draw of dropout moves a row by {noise['dropout']:.4f}" in out
    assert_equals_evaluation(summary, evaluation)
    # The normaliser changes the head input: its figures are not the sentence vector's.
    figures = lambda name: [summary[name][key] for key in ("EV_1", "EV_3", "isoscore")]  # noqa: E731
    assert not np.allclose(figures("pre_logits"), figures("pooled"), rtol=10 * RTOL)
    assert f"{summary['pre_logits']['EV_3']:.4f}" in out
    assert len(summary["layers"]["token_isoscore"]) == 2
    names = ("ev_curve", "std_histogram", "abs_correlation", "layer_isoscore")
    names += ("pre_logits_std_histogram", "pre_logits_abs_correlation")
    for name in names:
        assert (tmp_path / f"{name}.png").stat().st_size > 2000


def test_analyze_run_encoder_figures_are_analyze_encoders(isobn_run):
    """The fine-tuned encoder's part of the report ([CLS], pooled, per layer) is what
    `analyze_encoder` gives for the run's encoder parameters on the same rows."""
    run_dir, _ = isobn_run
    restored = runs.restore(run_dir, best=True)
    examples = predict.load_split(restored, "dev", labelled=True)
    rep = analysis.analyze_run(restored, examples)
    encoder = analysis.analyze_encoder(
        restored.model.encoder,
        restored.state.params["encoder"],
        restored.tokenizer,
        examples,
        max_length=restored.config.max_length,
        batch_size=4,
    )
    assert set(rep.embeddings) == {"cls", "pooled", "pre_logits"}
    for name in ("cls", "pooled"):
        for key in ("EV_1", "EV_3", "isoscore", "mean_cosine", "std"):
            np.testing.assert_allclose(
                rep.embeddings[name][key], encoder.embeddings[name][key], rtol=1e-5, atol=1e-6
            )
    for key, values in encoder.layers.items():
        np.testing.assert_allclose(rep.layers[key], values, rtol=1e-5, atol=1e-6)


def test_outlier_score_of_a_run_is_the_brute_force_one(capsys, tmp_path, isobn_run, latest):
    """`analyze --run --outlier-score`: the head input's principal outlier is the train rows'
    highest-variance dimension, and its 1-D dev accuracy is a brute-force threshold's."""
    run_dir, _ = isobn_run
    code, out, err = run_cli(
        capsys, ["analyze", "--run", run_dir, "--outlier-score", "--out", tmp_path]
    )
    assert code == 0, err
    scores = json.loads((tmp_path / "summary.json").read_text())["principal_outlier_score"]
    assert set(scores) == {"cls", "pooled", "pre_logits"}
    restored = latest
    train = predict.load_split(restored, "train", labelled=True)
    dev = predict.load_split(restored, "dev", labelled=True)
    x_train, _ = run_analysis.head_inputs(restored, train)
    x_dev, _ = run_analysis.head_inputs(restored, dev)
    y_train = np.array([e.label for e in train])
    y_dev = np.array([e.label for e in dev])
    dim = int(np.argmax(x_train.var(0)))
    got = scores["pre_logits"]
    assert got["dimension"] == dim
    x, best = x_train[:, dim], (-1.0, None)
    u = np.unique(x)
    for t in [-np.inf, *((u[:-1] + u[1:]) / 2), np.inf]:
        for a, b in ((0, 1), (1, 0)):
            accuracy = np.mean(np.where(x <= t, a, b) == y_train)
            if accuracy > best[0]:
                best = (accuracy, np.mean(np.where(x_dev[:, dim] <= t, a, b) == y_dev))
    np.testing.assert_allclose(got["rule"]["train_accuracy"], best[0], rtol=1e-6)
    np.testing.assert_allclose(got["score"], best[1], rtol=1e-6)
    assert f"dimension {dim:>4} (train share {got['train_share']:.3f})" in out


def test_analyze_refuses_contradictory_flags(capsys, tmp_path, isobn_run):
    run_dir, _ = isobn_run
    out = tmp_path / "out"
    # A config.json of the layout before istar.stabilizer.*: read under the new paths (0.6:
    # `config.RENAMED` translates), so what is refused is the folder's missing checkpoint.
    old_layout = tmp_path / "old"
    old_layout.mkdir()
    saved = json.loads((run_dir / "config.json").read_text())
    saved["istar"]["stabilizer_tokens"] = saved["istar"].pop("stabilizer")["tokens"]
    (old_layout / "config.json").write_text(json.dumps(saved))
    cases = [
        (["--run", old_layout], f"no checkpoint in {old_layout / 'checkpoints'}"),
        (["--run", run_dir, "--model", "tiny-bert"], "--model contradicts --run"),
        (["--run", run_dir, "--task", "mrpc"], "--task contradicts --run"),
        (["--run", run_dir, "--max-length", "16"], "--max-length contradicts --run"),
        (["--run", run_dir, "--tokenizer", tmp_path], "--tokenizer contradicts --run"),
        (["--run", run_dir, "--seed", "3"], "--seed contradicts --run"),
        (["--best"], "--best chooses a run's checkpoint: it needs --run RUN_DIR"),
        (["--step", "0"], "--step chooses a run's checkpoint: it needs --run RUN_DIR"),
        (["--run", run_dir, "--best", "--step", "2"], "not allowed with argument"),
        (["--run", run_dir, "--step", "3"], "no checkpoint at step 3"),
        (["--run", tmp_path], "not a run folder (no config.json)"),
        (["--run", run_dir, "--split", "test"], "--split 'test': task rte has"),
        (["--run", run_dir, "--zeta", "2"], "--zeta 2.0 not in [0, 1]"),
        (["--run", run_dir, "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--run", run_dir, "--data-dir", tmp_path], "RTE/dev.tsv"),
        (["--run", run_dir, "--max-train-examples", "3"], "limits the --posthoc or --outlier"),
        (["--run", run_dir, "--outlier-score", "--split", "train"], "--split must be dev"),
        # Audit 6, finding 8b: a ValueError traceback after all the encoding.
        (
            ["--run", run_dir, "--outlier-score", "--max-train-examples", "1"],
            "rte train: 1 row(s); the report needs at least 2",
        ),
        (["--posthoc", "abtt", "--outlier-score"], "--outlier-score is a part of the isotropy"),
    ]
    for flags, message in cases:
        code, stdout, err = run_cli(capsys, ["analyze", *flags, "--out", out])
        assert code == 2, (flags, err)
        assert message in err and err.count("\n") == 1, (flags, err)
        assert stdout == ""
    assert not out.exists()


def test_dropout_noise_is_numpys_spread_and_displacement_of_the_head_input(latest):
    """One batch (all 19 rows): the head input without and with dropout (the draw
    `fold_in(key(seed), 0)`, running statistics in both), and NumPy's float64 sqrt(tr cov) of
    the first and root mean squared row displacement between the two."""
    restored = latest
    examples = predict.load_split(restored, "dev", labelled=True)
    got = run_analysis.dropout_noise(restored, examples, batch_size=32, seed=7)
    (batch,) = batching.batches(
        batching.encode(examples, restored.tokenizer, restored.config.max_length),
        batch_size=32,
        buckets=tuple(restored.config.buckets),
    )
    inputs = [batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")]
    # One program per mode (op by op, every operation compiled alone).
    apply = jax.jit(restored.model.apply, static_argnames=("deterministic", "use_running_average"))
    z = [
        np.asarray(
            apply(restored.variables, *inputs, deterministic=deterministic,
                                  use_running_average=True,
                                  rngs={"dropout": jax.random.fold_in(jax.random.key(7), 0)})[1][
                "pre_logits"
            ],
            np.float64,
        )[:DEV_ROWS]
        for deterministic in (True, False)
    ]  # fmt: skip
    between = np.sqrt(np.trace(np.cov(z[0].T)))
    moved = np.sqrt(np.mean(np.linalg.norm(z[1] - z[0], axis=1) ** 2))
    assert got["examples"] == DEV_ROWS
    np.testing.assert_allclose(got["between_sentences"], between, rtol=1e-5)
    np.testing.assert_allclose(got["dropout"], moved, rtol=1e-5)
    np.testing.assert_allclose(got["dropout_to_spread"], moved / between, rtol=1e-5)
    assert moved > 0.01 * between  # dropout on: the rows move


def test_noise_to_spread_is_numpys_and_blind_to_rotation_and_scale():
    """Float64 NumPy's sqrt(tr cov) and root mean squared displacement; a rotation and a scale
    of both sets leave the ratio as it is."""
    rng = np.random.default_rng(0)
    clean = rng.normal(size=(50, 6)) * [3.0, 1.0, 1.0, 0.5, 0.2, 0.1]
    noisy = clean + 0.3 * rng.normal(size=clean.shape)
    got = run_analysis.noise_to_spread(clean, noisy)
    moved = np.sqrt(np.mean(np.linalg.norm(noisy - clean, axis=1) ** 2))
    between = np.sqrt(np.trace(np.cov(clean.T)))
    assert got["examples"] == 50
    np.testing.assert_allclose(got["dropout"], moved, rtol=1e-12)
    np.testing.assert_allclose(got["between_sentences"], between, rtol=1e-12)
    q, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    turned = run_analysis.noise_to_spread(2.0 * clean @ q, 2.0 * noisy @ q)
    np.testing.assert_allclose(turned["dropout_to_spread"], got["dropout_to_spread"], rtol=1e-12)
    assert run_analysis.noise_to_spread(clean, clean)["dropout"] == 0.0


def test_whitening_a_low_rank_signal_under_isotropic_noise_raises_the_ratio():
    """The mechanism the whitening study measures (docs/study/whitening.md): sentences spread
    along 2 of 64 directions, dropout-like noise along all. ZCA fitted on the noisy rows (as the
    running statistics are, in training) brings every direction towards the same variance, so
    the 62 directions of noise grow against the 2 of signal: the ratio goes from 0.11 to 1.77
    (with the default shrinkage α = 0.1, which bounds the gain; 5.48 at α = 0)."""
    rng = np.random.default_rng(1)
    clean = np.zeros((2000, 64))
    clean[:, :2] = rng.normal(size=(2000, 2)) * 5.0
    noisy = clean + 0.1 * rng.normal(size=clean.shape)
    before = run_analysis.noise_to_spread(clean, noisy)["dropout_to_spread"]
    fit = posthoc.fit_zca(noisy.astype(np.float32))
    after = run_analysis.noise_to_spread(
        np.asarray(posthoc.apply_zca(fit, clean)), np.asarray(posthoc.apply_zca(fit, noisy))
    )["dropout_to_spread"]
    assert before < 0.15 and after > 1.5, (before, after)


def test_dropout_noise_is_zero_without_dropout(latest):
    """The same run with the encoder's and the head's dropout rates at 0: nothing moves, so a
    pass that left dropout off, or let the normaliser read the batch, would show here."""
    restored = latest
    examples = predict.load_split(restored, "dev", labelled=True)
    module = restored.model
    quiet = dataclasses.replace(module.encoder.config, hidden_dropout=0.0, attention_dropout=0.0)
    module = module.clone(encoder=module.encoder.clone(config=quiet), dropout_rate=0.0)
    got = run_analysis.dropout_noise(dataclasses.replace(restored, model=module), examples)
    assert got["dropout"] < 1e-6 * got["between_sentences"] and got["between_sentences"] > 0
    with pytest.raises(ValueError, match="at least two rows"):
        run_analysis.dropout_noise(restored, examples[:1])
