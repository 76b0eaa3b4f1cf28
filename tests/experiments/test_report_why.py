"""`python -m experiments.report.why`: one line per finished run of a study's runs folder.

A tiny run (random 2-layer BERT, hidden 32, 16 RTE rows, 2 epochs of 2 steps) is trained into
`RUNS/whitening_why/rte-isobn-s1/`; beside it, copies of it that are unfinished (no
`results.json`), that have a corrupt `config.json`, and that have no best checkpoint. The
written line is checked against float64 NumPy recomputed from the run's own head inputs
(`run_analysis.head_inputs`, the rows the analysis reads), not against the analysis itself.
"""

import contextlib
import io
import json
import shutil

import numpy as np
import pytest
from helpers import tiny_config

from experiments.report import why
from isojax import runs
from isojax.analysis import run as run_analysis
from isojax.runs import predict
from isojax.training import loop

GOOD = "rte-isobn-s1"
BROKEN = {"rte-badconfig-s1": "config.json", "rte-nockpt-s1": "no best dev checkpoint"}
UNFINISHED = "rte-unfinished-s1"
TRAIN_ROWS = 64  # --max-train-examples: of the 2490 RTE train rows, so the cap shows


def call_main(argv) -> tuple[int, str]:
    """`why.main(argv)`'s status and what it logged and printed on stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = why.main([str(a) for a in argv])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def study(tmp_path_factory, glue_dir, minilm_dir):
    """`(RUNS, good run folder, records JSONL)`: the tiny run and its broken twins."""
    root = tmp_path_factory.mktemp("why")
    folder = root / "runs" / "whitening_why"
    config = tiny_config(glue_dir, minilm_dir, normalizer="isobn", num_epochs=2, seed=1)
    loop.train_and_evaluate(config, folder / GOOD)
    for name in (*BROKEN, UNFINISHED):
        shutil.copytree(folder / GOOD, folder / name)
    (folder / UNFINISHED / "results.json").unlink()
    (folder / "rte-badconfig-s1" / "config.json").write_text('{"task": "rte", ')
    shutil.rmtree(folder / "rte-nockpt-s1" / "best_checkpoint")
    (folder / "rte-pretrained").mkdir()  # a pre-trained cell's folder: no run
    return root / "runs", folder / GOOD


@pytest.fixture(scope="module")
def written(study, tmp_path_factory):
    """`(status, stderr, the line, out, figure)` of one call over the study."""
    runs_dir, _ = study
    out_dir = tmp_path_factory.mktemp("why_out")
    out, png = out_dir / "runs.jsonl", out_dir / "mechanism.png"
    argv = [runs_dir, "--out", out, "--figure", png, "--max-train-examples", TRAIN_ROWS]
    code, err = call_main(argv)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 1, err
    return code, err, lines[0], out, png


@pytest.fixture(scope="module")
def reference(study):
    """The good run's head inputs on dev (clean, noisy), on the first `TRAIN_ROWS` train rows,
    and the labels, float64."""
    _, good = study
    restored = runs.restore(good, best=True)
    dev = predict.load_split(restored, "dev", labelled=True)
    train = predict.load_split(restored, "train", labelled=True)[:TRAIN_ROWS]
    clean, noisy = run_analysis.head_inputs(restored, dev)
    train_clean, _ = run_analysis.head_inputs(restored, train)
    labels = np.array([e.label for e in dev]), np.array([e.label for e in train])
    return clean, noisy, train_clean, labels


def entropy_rank(sigma: np.ndarray, epsilon: float = 0.0) -> float:
    p = sigma / sigma.sum() + epsilon
    return float(np.exp(-np.sum(p * np.log(p))))


@pytest.mark.e2e  # a whole run
def test_bad_folders_are_named_and_the_good_one_is_written(study, written):
    code, err, line, _, png = written
    runs_dir, good = study
    assert code == 1
    for name, why_bad in BROKEN.items():
        (bad,) = [row for row in err.splitlines() if row.startswith("bad run folder")
                  and name in row]  # fmt: skip
        assert bad.startswith(f"bad run folder {runs_dir / 'whitening_why' / name}")
        assert why_bad in bad, err
    assert f"{good.parent / UNFINISHED}: not finished (no results.json yet): skipped" in err
    assert f"{good.parent / 'rte-pretrained'}: no run in it: skipped" in err
    assert (line["cell"], line["task"], line["arm"], line["seed"]) == (GOOD, "rte", "isobn", 1)
    assert (line["study"], line["sentence"], line["train_rows"]) == (
        "whitening_why",
        "pooled",
        TRAIN_ROWS,
    )
    assert png.stat().st_size > 10_000


@pytest.mark.e2e
def test_the_dev_score_is_the_runs_best_epoch(study, written):
    _, good = study
    line = written[2]
    rows = [json.loads(r) for r in (good / "metrics.jsonl").read_text().splitlines()]
    scores = {r["step"]: r["score"] for r in rows if r["split"] == "dev"}
    assert len(scores) == 2
    assert line["dev_score"] == max(scores.values())
    assert line["dev_score_from"] == "run folder"
    best = json.loads((good / "results.json").read_text())["best"]
    assert line["checkpoint"] == {"step": best["step"], "epoch": best["epoch"]}


@pytest.mark.e2e
def test_head_input_geometry_is_numpys_on_the_head_inputs(written, reference):
    line = written[2]
    clean, *_ = reference
    head = line["pre_logits"]
    assert line["dev_rows"] == len(clean) == 16
    centred = clean - clean.mean(0)
    sigma = np.linalg.svd(centred, compute_uv=False)
    np.testing.assert_allclose(head["erank"], entropy_rank(sigma), rtol=1e-4)
    np.testing.assert_allclose(
        head["rankme"], entropy_rank(np.linalg.svd(clean, compute_uv=False), 1e-7), rtol=1e-4
    )
    variances = clean.var(0)
    assert head["principal_outlier"] == int(np.argmax(variances))
    np.testing.assert_allclose(
        head["principal_outlier_share"], variances.max() / variances.sum(), rtol=1e-4
    )
    assert head["outliers"] == int(np.sum(variances >= 5 * variances.mean()))
    assert isinstance(head["outliers"], int) and isinstance(head["principal_outlier"], int)


@pytest.mark.e2e
def test_noise_to_spread_is_numpys_on_the_head_inputs(written, reference):
    line = written[2]
    clean, noisy, *_ = reference
    moved = np.sqrt(np.mean(np.sum((noisy - clean) ** 2, axis=1)))
    spread = np.sqrt(np.sum(clean.var(0, ddof=1)))
    assert moved > 0
    np.testing.assert_allclose(line["noise_to_spread"], moved / spread, rtol=1e-9)
    np.testing.assert_allclose(line["head_input_dropout"]["between_sentences"], spread, rtol=1e-9)


@pytest.mark.e2e
def test_the_1d_score_is_a_brute_force_threshold_on_the_capped_train_rows(written, reference):
    line = written[2]
    clean, _, train, (y_dev, y_train) = reference
    assert len(train) == TRAIN_ROWS
    dim = int(np.argmax(train.var(0)))
    got = line["pre_logits"]["outlier_score"]
    assert got["dimension"] == dim
    assert got["rule"]["threshold"] is not None  # a cut between two rows, not one class
    x, best = train[:, dim], (-1.0, None)
    values = np.unique(x)
    for cut in [-np.inf, *((values[:-1] + values[1:]) / 2), np.inf]:
        for below, above in ((0, 1), (1, 0)):
            accuracy = np.mean(np.where(x <= cut, below, above) == y_train)
            if accuracy > best[0]:
                dev = np.where(clean[:, dim] <= cut, below, above)
                best = (accuracy, np.mean(dev == y_dev))
    np.testing.assert_allclose(got["rule"]["train_accuracy"], best[0], rtol=1e-6)
    np.testing.assert_allclose(got["score"], best[1], rtol=1e-6)
    assert line["pooled"]["outlier_score"]["score"] is not None


@pytest.mark.e2e
def test_a_rerun_skips_written_cells_and_a_results_record_gives_arm_and_score(study, written):
    runs_dir, good = study
    _, _, line, out, png = written
    before = out.read_text()
    code, err = call_main([runs_dir, "--out", out, "--figure", png])
    assert code == 1
    assert out.read_text() == before
    assert f"{good}: in {out} already: skipped" in err
    # A results record names the arm and the best epoch's score; the rest is measured again.
    results = out.parent / "results.jsonl"
    record = {"cell": GOOD, "kind": "run", "status": "ok", "seed": 1, "study": "whitening_why"}
    record["fields"] = {"task": "rte", "method": "isobn+x"}
    record["eval"] = [{"split": "dev", "epoch": e, "score": s} for e, s in ((1, 0.25), (2, 0.5))]
    results.write_text(json.dumps(record) + "\n")
    again = out.parent / "again.jsonl"
    argv = [runs_dir, "--out", again, "--figure", png, "--results", results]
    argv += ["--max-train-examples", TRAIN_ROWS]
    code, err = call_main(argv)
    (second,) = [json.loads(text) for text in again.read_text().splitlines()]
    assert f"{GOOD}: the results record's best dev score 0.500000 differs" in err
    assert (second["arm"], second["dev_score"], second["dev_score_from"]) == (
        "isobn+x",
        0.5,
        "results",
    )
    same = {key: v for key, v in line.items() if key not in ("arm", "dev_score", "dev_score_from")}
    assert same == {key: second[key] for key in same}


def test_lines_are_appended_whole_with_non_finite_numbers_as_null(tmp_path):
    out = tmp_path / "sub" / "runs.jsonl"
    why.append_line(out, {"cell": "a", "x": float("nan"), "y": [np.float32(2.5), -np.inf]})
    why.append_line(out, {"cell": "b", "x": 1})
    lines = out.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"cell": "a", "x": None, "y": [2.5, None]},
        {"cell": "b", "x": 1},
    ]
    assert why.done_cells(out) == {"a", "b"}
    out.write_text(out.read_text() + "[1]\n")
    with pytest.raises(ValueError, match=r"runs.jsonl:3: not a line of this script"):
        why.done_cells(out)


def test_the_figure_draws_one_point_per_drawable_run(tmp_path):
    """Three tasks, two arms; a collapsed run (no noise-to-spread) is left out of that panel."""
    cells = [(task, arm) for task in ("cola", "mrpc", "stsb") for arm in ("none", "whiten")]
    lines = [
        {
            "task": task,
            "arm": arm,
            "dev_score": 0.5,
            "noise_to_spread": None if k == 5 else 0.3 * (k + 1),
            "pre_logits": {"EV_1": 0.1 * k, "outlier_score": {"score": 0.1 * k}},
        }
        for k, (task, arm) in enumerate(cells)
    ]
    assert why.panel_x(lines[5], "noise_to_spread") is None
    assert why.panel_x(lines[4], "outlier_score") == pytest.approx(0.4)
    assert why.panel_x(lines[3], "EV_1") == pytest.approx(0.3)
    assert [key for key, _ in why.PANELS] == ["noise_to_spread", "EV_1", "outlier_score"]
    assert why.arm_colours(lines + [{"arm": "aaa"}]) == {"none": "C0", "whiten": "C1", "aaa": "C2"}
    png = why.draw(lines, tmp_path / "f.png")
    assert png.stat().st_size > 10_000
