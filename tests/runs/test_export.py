"""isojax.runs / predict / export and `isojax export|predict`: a run folder to transformers and
to GLUE submission files, the best dev checkpoint, one-line errors with exit status 2.

Tiny runs (random 2-layer BERT or RoBERTa, hidden 32, over the MiniLM WordPiece vocabulary; 16
real rows) train a few steps; transformers' PyTorch classes are the reference for the export.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
import torch
import transformers
from helpers import TINY_HF, arm, tiny_config

import isojax
from isojax import cli, linen, runs
from isojax.data import glue, tasks
from isojax.models import config as config_lib
from isojax.runs import predict
from isojax.training import (
    build,
    checkpointing,
    distributed,
    evaluation,
    loop,
    optim,
    run_folder,
    specs,
)
from isojax.training.position import Position

pytestmark = pytest.mark.e2e  # whole runs: the e2e lane

TEST_ROWS = {"cola": 1063, "mrpc": 1725, "rte": 3000, "stsb": 1379}
ALLOWED = {"cola": {"0", "1"}, "mrpc": {"0", "1"}, "rte": {"entailment", "not_entailment"}}


def run_cli(capsys, argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_tsv(path) -> tuple[list[str], list[list[str]]]:
    header, *rows = [line.split("\t") for line in pathlib.Path(path).read_text().splitlines()]
    return header, rows


@pytest.fixture(scope="module")
def roberta_dir(tmp_path_factory, minilm_dir):
    """A random tiny RoBERTa folder over the MiniLM vocabulary (padding id 0, as that
    tokenizer pads), loaded by `config.model` like any pre-trained folder."""
    hf = TINY_HF["roberta"] | dict(vocab_size=30522, pad_token_id=0, max_position_embeddings=40)
    cfg = config_lib.EncoderConfig.from_hf(hf)
    params = linen.init_params(linen.Encoder(cfg), jax.random.key(7))
    return linen.export_pretrained(tmp_path_factory.mktemp("roberta") / "tiny", cfg, params)


TRAINED = {  # name: (model, method, task)
    "bert-isobn": ("tiny-bert", "isobn", "rte"),
    "roberta-batchnorm": ("roberta", "batchnorm", "mrpc"),
    # A held probe of the turn-5 audit (issue 50): the ZCA whitening folded into the classifier.
    "bert-whiten": ("tiny-bert", "whiten", "rte"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, glue_dir, minilm_dir, roberta_dir):
    """`{name: run folder}`: one epoch (2 steps) of each run of TRAINED."""
    out = {}
    for name, (model, method, task) in TRAINED.items():
        config = tiny_config(glue_dir, minilm_dir, **arm(method), task=task)
        if model == "roberta":
            config.model = str(roberta_dir)
        out[name] = tmp_path_factory.mktemp(name) / "run"
        loop.train_and_evaluate(config, out[name])
    return out


def untrained_run(workdir: pathlib.Path, config) -> pathlib.Path:
    """A run folder holding the initial train state as its step-0 checkpoint (no training)."""
    task = tasks.get_task(config.task)
    spec = specs.RunSpec.of(config)
    model, encoder_params, _, hidden = build.build_model(spec.model, task.num_labels)
    state = build.create_train_state(
        spec.state,
        model,
        encoder_params,
        optim.make_optimizer(spec.state.optim, 1),
        spec.state.objective.for_run(task.is_regression, 1),
        hidden,
        distributed.make_mesh(),
    )
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(config.to_json(indent=2))
    with checkpointing.Checkpointer(workdir / run_folder.LATEST_DIR) as ckpt:
        ckpt.save(0, state, Position().to_json() | run_folder.config_stamp(spec.fields))
    return workdir


@pytest.fixture(scope="module")
def untrained(tmp_path_factory, glue_dir, minilm_dir):
    """`{task: run folder}` of untrained tiny-bert runs (eval batches of 64) on the 4 tasks."""
    root = tmp_path_factory.mktemp("untrained")
    return {
        task: untrained_run(
            root / task, tiny_config(glue_dir, minilm_dir, task=task, eval_batch_size=64)
        )
        for task in TEST_ROWS
    }


# ---------------------------------------------------------------------------------------------
# Export: transformers serves the run's classifier.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TRAINED))
def test_exported_run_equals_predict_in_transformers(capsys, tmp_path, trained, name, glue_dir):
    """The exported folder (IsoBN / batch norm folded into the classifier) gives the logits of
    `predict` within 1e-4 on the dev rows, its labels map to the task's names, and the
    predictions file says the same; `predict --split dev` prints the run's own metrics."""
    run_dir, task = trained[name], tasks.get_task(TRAINED[name][2])
    code, out, err = run_cli(capsys, ["export", run_dir, tmp_path / "hf"])
    assert code == 0, err
    family = "Roberta" if name.startswith("roberta") else "Bert"
    assert f"as {family}ForSequenceClassification\n" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert f"dev: {cli.runs.format_metrics(task, results['dev'])}" in out

    code, out, err = run_cli(
        capsys, ["predict", run_dir, "--split", "dev", "--out", tmp_path / "p.tsv"]
    )
    assert code == 0, err
    assert f"dev: {cli.runs.format_metrics(task, results['dev'])}\n" in out
    pred = predict.predict(runs.restore(run_dir), "dev")
    assert pred.metrics == results["dev"]  # the same eval batches: exactly the run's numbers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", attn_implementation="eager"
    ).eval()
    assert model.config.id2label == dict(enumerate(task.label_names))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    examples = glue.load_tsv(glue_dir, task, "dev")[:16]
    inputs = tokenizer(
        [e.text_a for e in examples],
        [e.text_b for e in examples],
        truncation=True,
        max_length=32,
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**inputs).logits.numpy()
    np.testing.assert_allclose(pred.logits, logits, rtol=0, atol=1e-4)
    header, rows = read_tsv(tmp_path / "p.tsv")
    assert header == ["index", "prediction", *(f"probability_{n}" for n in task.label_names)]
    assert [int(r[0]) for r in rows] == [e.idx for e in examples]
    names = [model.config.id2label[int(k)] for k in logits.argmax(1)]
    assert [r[1] for r in rows] == names
    probs = torch.softmax(torch.tensor(logits), 1).numpy()
    np.testing.assert_allclose(np.array([r[2:] for r in rows], float), probs, atol=1e-4)
    card = (tmp_path / "hf" / "README.md").read_text()
    for text in (
        f"GLUE {task.folder}",
        f"`{TRAINED[name][1]}`",
        "| seed | 0 |",
        f"isojax {isojax.__version__}",
    ):
        assert text in card
    assert f"{results['dev']['sentence_ev3']:.4f}" in card


def test_layernorm_head_exports_its_encoder_and_says_so_in_one_line(
    capsys, tmp_path, glue_dir, minilm_dir
):
    config = tiny_config(glue_dir, minilm_dir, normalizer="layernorm")
    run_dir = untrained_run(tmp_path / "run", config)
    code, out, err = run_cli(capsys, ["export", run_dir, tmp_path / "hf"])
    assert code == 0, err
    said = [line for line in out.splitlines() if "encoder alone" in line]
    assert len(said) == 1 and "'layernorm' is not affine" in said[0], out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "BertModel"
    ]
    assert "AutoModel.from_pretrained" in (tmp_path / "hf" / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# GLUE submission files.
# ---------------------------------------------------------------------------------------------


def test_submission_files_for_the_four_local_tasks(
    capsys, tmp_path, untrained, glue_dir, monkeypatch
):
    """Each task's file: the test rows in the file's own order, the labels' names; STS-B's
    scores are the predictions the command computed (recorded, not a second restore and
    pass over the test rows), clipped to [0, 5]."""
    folder, made, real = tmp_path / "submission", {}, predict.predict

    def recording(restored, split, **kwargs):
        made[restored.task.name] = pred = real(restored, split, **kwargs)
        return pred

    monkeypatch.setattr(predict, "predict", recording)
    for run_dir in untrained.values():
        code, out, err = run_cli(
            capsys, ["predict", run_dir, "--split", "test", "--glue-submission", folder]
        )
        assert code == 0, err
        assert "dev:" not in out  # no labels, no metrics
    files = {"cola": "CoLA.tsv", "mrpc": "MRPC.tsv", "rte": "RTE.tsv", "stsb": "STS-B.tsv"}
    assert sorted(p.name for p in folder.iterdir()) == sorted(files.values())
    for task, name in files.items():
        header, rows = read_tsv(folder / name)
        assert header == ["index", "prediction"]
        assert len(rows) == TEST_ROWS[task]
        _, test_rows = read_tsv(glue_dir / tasks.get_task(task).folder / "test.tsv")
        assert [r[0] for r in rows] == [r[0] for r in test_rows]  # the file's own index
        values = [r[1] for r in rows]
        if task == "stsb":
            scores = made[task].scores
            assert made[task].split == "test" and len(scores) == TEST_ROWS[task]
            np.testing.assert_allclose(np.array(values, float), np.clip(scores, 0, 5), atol=5e-4)
            assert scores.min() < 0  # an untrained regressor: the clipping was exercised
        else:
            assert set(values) <= ALLOWED[task] and len(set(values)) >= 1


# ---------------------------------------------------------------------------------------------
# The best dev checkpoint.
# ---------------------------------------------------------------------------------------------


def test_best_restores_the_best_epochs_parameters(monkeypatch, tmp_path, glue_dir, minilm_dir):
    """Dev scores 0.2, 0.9, 0.5 over three epochs: `best_checkpoint` holds epoch 2's state
    (though `checkpoints/` keeps only the last), results.json records it, --best restores it."""
    scripted = iter([0.2, 0.9, 0.5])
    seen = {}
    real = evaluation.evaluate

    def evaluate(run, state, encoded):
        result = real(run, state, encoded)
        seen[int(state.step)] = jax.device_get(state.params)
        return result | {"score": next(scripted)}

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    config = tiny_config(glue_dir, minilm_dir, num_epochs=3, keep_checkpoints=1)
    results = loop.train_and_evaluate(config, tmp_path / "run")
    assert (results["step"], results["best"]["step"], results["best"]["epoch"]) == (6, 4, 2)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["best"]["dev"]["score"] == 0.9 and saved["dev"]["score"] == 0.5
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["6"]
    assert "\nbest: step 4  epoch 2  dev score 0.9000" in cli.finetune.format_results(results)

    best = runs.restore(tmp_path / "run", best=True)
    assert (best.step, best.checkpoint, best.evaluation["epoch"]) == (4, "best", 2)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(best.state.params), seen[4])
    latest = runs.restore(tmp_path / "run")
    assert latest.step == 6
    kernel = ("classifier", "kernel")
    assert not np.array_equal(
        np.asarray(best.state.params[kernel[0]][kernel[1]]), seen[6][kernel[0]][kernel[1]]
    )


def test_best_survives_a_resume_and_a_tie_keeps_the_earlier_epoch():
    """The best evaluation travels in the checkpointed Position (JSON), so a resumed run
    compares against it; an equal later score does not replace it."""
    position = Position()
    evals = [{"step": 2 * k, "epoch": k, "dev": {"score": s}} for k, s in ((1, 0.5), (2, 0.7))]
    assert position.note_eval(evals[0], "dev") and position.note_eval(evals[1], "dev")
    again = Position(**json.loads(json.dumps(position.to_json())))
    assert again.best == evals[1]
    assert not again.note_eval({"step": 6, "epoch": 3, "dev": {"score": 0.7}}, "dev")
    assert again.best == evals[1] and again.last_eval["step"] == 6
    assert again.note_eval({"step": 8, "epoch": 4, "dev": {"score": 0.71}}, "dev")


# ---------------------------------------------------------------------------------------------
# Bad input: one line on stderr, exit status 2.
# ---------------------------------------------------------------------------------------------


def test_bad_input_is_one_line_and_status_2(capsys, tmp_path, untrained, glue_dir):
    run_dir = untrained["rte"]
    no_checkpoints = tmp_path / "fresh"
    no_checkpoints.mkdir()
    (no_checkpoints / "config.json").write_text((run_dir / "config.json").read_text())
    no_test = tmp_path / "glue" / "RTE"
    no_test.mkdir(parents=True)
    (no_test / "dev.tsv").write_text((glue_dir / "RTE" / "dev.tsv").read_text())
    cases = [
        (["predict", no_checkpoints, "--split", "dev"], "no checkpoint in"),
        (["export", no_checkpoints, tmp_path / "hf"], "no checkpoint in"),
        (["predict", tmp_path, "--split", "dev"], "not a run folder (no config.json)"),
        (["predict", run_dir, "--split", "dev", "--step", "7"], "no checkpoint at step 7"),
        (["export", run_dir, tmp_path / "hf", "--best"], "no best dev checkpoint"),
        (["predict", run_dir, "--split", "test", "--metrics"], "split 'test' has no labels"),
        (["predict", run_dir, "--split", "test", "--data-dir", tmp_path / "glue"], "RTE/test.tsv"),
        (["predict", run_dir, "--split", "dev", "--glue-submission", tmp_path], "--split test"),
        (["predict", run_dir, "--split", "validation"], "no split 'validation'"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(capsys, argv)
        assert code == 2, (argv, err)
        assert message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "hf").exists()
