"""Tests for the study runner (experiments/study/): a tiny grid (random 2-layer BERT, 16 real
RTE rows, 2 epochs of 2 steps) is run, killed mid-cell, resumed, skipped when finished, and
recorded once per cell with every field of issue 14."""

import json
import os

import jax
import numpy as np
import pytest
from helpers import REPO, study_grid

from experiments.configs import study_recipe
from experiments.study import analyze as study_analyze
from experiments.study import cell as study_cell
from experiments.study import runner
from experiments.study.cell import git_state, read_run, run_cell
from experiments.study.eta import epoch_minutes
from experiments.study.grid import cell_config, grid_axes, grid_cells, load_grid, plan
from experiments.study.records import read_records, write_record
from isojax import analysis
from isojax.training import checkpointing, loop, stops

RECORD_KEYS = {
    "study", "cell", "tier", "kind", "status", "error", "fields", "seed", "config_hash", "config",
    "git_commit", "git_dirty", "device", "host", "jax_version", "sweep", "baseline", "metric",
    "eval", "train_loss", "train_loss_epoch", "steps", "wall_minutes", "finished",
}  # fmt: skip
ISOTROPY_KEYS = {
    "sentence_ev1", "sentence_ev3", "sentence_isoscore", "sentence_mean_cosine",
    "pre_logits_ev1", "pre_logits_ev3", "pre_logits_isoscore", "pre_logits_mean_cosine",
    "tokens_isoscore", "last_tokens_mean_cosine", "last_tokens_max_abs_mean",
    *(f"{v}_{k}" for v in ("sentence", "pre_logits") for k in (
        "erank", "rankme", "outliers", "principal_outlier", "principal_outlier_share")),
}  # fmt: skip


class SimulatedKill(BaseException):
    """What a SIGKILL leaves: nothing after the raise runs, nothing is recorded."""


def _grid_file(tmp_path, glue_dir, minilm_dir) -> str:
    return study_grid(tmp_path, glue_dir, minilm_dir)


def test_cells_names_and_tiers(tmp_path, glue_dir, minilm_dir):
    grid, _ = load_grid(_grid_file(tmp_path, glue_dir, minilm_dir))
    assert [c.name for c in grid_cells(grid, 1)] == ["rte-none-s1", "rte-isobn-s1"]
    assert [c.name for c in plan(grid, None, 2)] == [
        "rte-pretrained",
        "rte-none-s1",
        "rte-isobn-s1",
        "rte-none-lr=-1-s1",
    ]
    assert grid_axes(grid) == ["task", "method", "seed", "lr"]


def test_grid_files_load_count_and_validate():
    from isojax.training import config as config_lib

    counts = {}
    names = ("normalizers", "istar_lambda", "cosreg", "istar_zeta", "pilot", "whitening")
    for name in (*names, "whitening_why"):
        grid, recipe = load_grid(str(REPO / "experiments/configs" / f"study_{name}.py"))
        counts[name] = tuple(len(grid_cells(grid, tier)) for tier in (1, 2, 3))
        config = cell_config(grid, recipe, grid_cells(grid, 2)[0].values)
        assert (recipe.get_field(config, "batch_size"), config.max_length) == (32, 128)
        for cell in grid_cells(grid, 3):  # every cell's config is one train accepts
            config_lib.validate_config(cell_config(grid, recipe, cell.values))
    counts = {name: n[:2] if n[1] == n[2] else n for name, n in counts.items()}
    assert counts == {
        "normalizers": (36, 92, 132),  # tier 3: none and isobn seeds 6-10 (issue 48)
        "whitening_why": (63, 105, 155),  # issue 47's causal grid; tier 3: issue 62, item 5
        "istar_lambda": (27, 108),
        "cosreg": (0, 9),
        "istar_zeta": (0, 15),
        "pilot": (8, 8),
        "whitening": (36, 60),
    }
    grid, recipe = load_grid(str(REPO / "experiments/configs/study_istar_zeta.py"))
    zetas = [c.values["istar.zeta"] for c in grid_cells(grid, 2)]
    assert zetas == [0.0, 0.2, 0.5, 0.8, 1.0] * 3
    config = cell_config(grid, recipe, grid_cells(grid, 2)[0].values)
    assert (config.penalty, config.task, config.istar.weight) == ("istar", "stsb", -1.0)


def test_the_schema_is_read_once_and_each_default_config_is_fresh():
    """`schema.declarations` reads each spec's type hints once (the grid test above validates
    ~500 cell configs, each `validate_config` building `default_config` three times): the
    cached declarations are those read afresh, and each `default_config` is a new tree that a
    caller's change does not reach."""
    from isojax.training import config as config_lib
    from isojax.training import schema, specs

    cached = schema.declarations(specs.RunSpec)
    schema._declarations.cache_clear()
    assert schema.declarations(specs.RunSpec) == cached and cached  # the same, read afresh
    first = config_lib.default_config()
    want = first.to_dict()
    first.optimizer.learning_rate, first.istar.stabilizer.tokens = 7.0, 3
    second = config_lib.default_config()
    assert second is not first and second.to_dict() == want


@pytest.mark.e2e  # a whole run
def test_runner_resumes_a_killed_cell_skips_finished_ones_and_records_failures(
    tmp_path, glue_dir, minilm_dir, monkeypatch, capsys
):
    grid = _grid_file(tmp_path, glue_dir, minilm_dir)
    results, runs = tmp_path / "tiny.jsonl", tmp_path / "runs"
    kw = dict(tier=2, runs_dir=runs, results=results)

    # A zero budget stops before the first cell; a dry run writes nothing.
    assert runner.run_grid(grid, budget_minutes=0, **kw)["ran"] == 0
    assert runner.run_grid(grid, dry_run=True, **kw) == {
        "cells": 4, "done": 0, "failed": 0, "ran": 0, "held": 0, "left": 4,
    }  # fmt: skip
    assert not results.exists()

    # Kill the first trained cell right after its epoch-1 checkpoint (step 2 of 4).
    save = checkpointing.Checkpointer.save

    def save_then_die(self, step, state, position):
        save(self, step, state, position)
        if step == 2 and self.directory.name == "checkpoints":  # the latest, after the best
            raise SimulatedKill

    monkeypatch.setattr(checkpointing.Checkpointer, "save", save_then_die)
    with pytest.raises(SimulatedKill):
        runner.run_grid(grid, **kw)
    lines = results.read_text().splitlines()
    assert [json.loads(line)["cell"] for line in lines] == ["rte-pretrained"]
    killed = runs / "tiny" / "rte-none-s1"
    assert (killed / "checkpoints").is_dir() and not (killed / "results.json").exists()

    # The next call resumes it from step 2, runs the rest, records the bad cell as failed.
    monkeypatch.setattr(checkpointing.Checkpointer, "save", save)
    capsys.readouterr()
    counts = runner.run_grid(grid, **kw)
    assert counts == {"cells": 4, "done": 4, "failed": 1, "ran": 3, "held": 0, "left": 0}
    assert f"isojax: resumed {killed} at step 2" in capsys.readouterr().err
    records = {r["cell"]: r for r in read_records(results)}
    assert list(records) == ["rte-pretrained", "rte-none-s1", "rte-isobn-s1", "rte-none-lr=-1-s1"]
    assert json.loads((killed / "study_wall.json").read_text())["attempts"] == 2

    for record in records.values():
        assert set(record) == RECORD_KEYS
        assert record["study"] == "tiny" and record["seed"] == 1
        assert record["baseline"] == {"method": "none"} and len(record["git_commit"]) == 40
        assert record["jax_version"] == jax.__version__
        assert record["host"]["cores"] == os.cpu_count() and record["host"]["cpu"]
        assert set(record["fields"]) == {"task", "method", "seed", "lr"}
    for name in ("rte-none-s1", "rte-isobn-s1"):
        record = records[name]
        assert record["status"] == "ok" and record["error"] is None
        assert record["fields"] == {"task": "rte", "method": name.split("-")[1], "seed": 1,
                                    "lr": 1e-4}  # fmt: skip
        assert [(e["epoch"], e["step"], e["split"]) for e in record["eval"]] == [
            (1, 2, "dev"),
            (2, 4, "dev"),
        ]
        for row in record["eval"]:
            assert ISOTROPY_KEYS | {"score", "accuracy"} <= set(row)
        text = (runs / "tiny" / name / "metrics.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines()]
        losses = [row["loss"] for row in rows if row["split"] == "train"]
        assert len(losses) == 4  # one line per step (log_every 1)
        epoch_means = [(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2]
        assert record["train_loss_epoch"] == [
            {"epoch": 1, "loss": pytest.approx(epoch_means[0])},
            {"epoch": 2, "loss": pytest.approx(epoch_means[1])},
        ]
        assert record["train_loss"] == [
            [2, 0, pytest.approx(epoch_means[0])],
            [4, 1, pytest.approx(epoch_means[1])],
        ]
        assert record["steps"] == 4 and record["wall_minutes"] > 0
        # The final eval is the run's own results.json.
        final = json.loads((runs / "tiny" / name / "results.json").read_text())["dev"]
        assert record["eval"][-1]["score"] == final["score"]
    assert records["rte-none-s1"]["config_hash"] != records["rte-isobn-s1"]["config_hash"]
    pre = records["rte-pretrained"]
    assert pre["fields"] == {"task": "rte", "method": "pretrained", "seed": 1, "lr": None}
    assert pre["kind"] == "pretrained" and pre["steps"] == 0 and pre["eval"][0]["epoch"] == 0
    assert ISOTROPY_KEYS <= set(pre["eval"][0])
    failed = records["rte-none-lr=-1-s1"]
    assert failed["status"] == "failed" and "learning_rate must be > 0" in failed["error"]

    # Finished and failed cells are skipped: nothing runs, the file is unchanged.
    before = results.read_text()
    assert runner.run_grid(grid, **kw)["ran"] == 0
    assert results.read_text() == before
    # --retry-failed reruns the failed cell and replaces its line (still one line per cell).
    assert runner.run_grid(grid, retry_failed=True, **kw)["ran"] == 1
    cells = [r["cell"] for r in read_records(results)]
    assert sorted(cells) == sorted(records) and len(cells) == 4

    # study_analyze: `analyze --run` of each seed-1 run equals the run's last dev evaluation.
    # Its figures are drawn by `analysis.write_figures`, tested on both kinds of report in
    # tests/analysis (test_encoder, test_run): here each analysis hands its report to it once.
    drawn = []
    monkeypatch.setattr(
        study_analyze.analysis, "write_figures", lambda rep, out: drawn.append((rep, out))
    )
    assert study_analyze.main([str(results), "--runs-dir", str(runs), "--seed", "1"]) == 0
    names = ["rte-pretrained", "rte-none-s1", "rte-isobn-s1"]
    assert [out for _, out in drawn] == [tmp_path / "tiny_analysis" / n for n in names]
    assert all(isinstance(rep, analysis.Report) for rep, _ in drawn)
    table = (tmp_path / "tiny_analysis.md").read_text()
    for name in ("rte-none-s1", "rte-isobn-s1"):
        summary = json.loads((tmp_path / "tiny_analysis" / name / "summary.json").read_text())
        last = records[name]["eval"][-1]
        np.testing.assert_allclose(summary["pooled"]["EV_3"], last["sentence_ev3"], rtol=1e-4)
        np.testing.assert_allclose(summary["pre_logits"]["EV_3"], last["pre_logits_ev3"], rtol=1e-4)
        assert f"tiny_analysis/{name}" in table
    assert (tmp_path / "tiny_analysis" / "rte-pretrained" / "summary.json").exists()


def test_read_run_gives_exact_epoch_losses_and_a_chunked_curve(tmp_path):
    """25 steps (epochs of 12 and 13), one train line per step: epoch means are the NumPy
    means; the curve has means of 10 steps that never cross an epoch end."""
    loss = 1.0 / (1.0 + 0.1 * np.arange(25))
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 26):
            epoch = 0 if step <= 12 else 1
            f.write(json.dumps({"step": step, "epoch": epoch, "split": "train",
                                "loss": loss[step - 1]}) + "\n")  # fmt: skip
            if step in (12, 25):
                f.write(json.dumps({"step": step, "epoch": epoch + 1, "split": "dev",
                                    "score": 0.5}) + "\n")  # fmt: skip
    run = read_run(tmp_path)
    assert run["steps"] == 25 and [e["epoch"] for e in run["eval"]] == [1, 2]
    assert run["train_loss_epoch"] == [
        {"epoch": 1, "loss": pytest.approx(loss[:12].mean(), abs=1e-12)},
        {"epoch": 2, "loss": pytest.approx(loss[12:].mean(), abs=1e-12)},
    ]
    assert [row[:2] for row in run["train_loss"]] == [[10, 0], [12, 0], [22, 1], [25, 1]]
    for (step, _, value), lo in zip(run["train_loss"], (0, 10, 12, 22), strict=True):
        assert value == pytest.approx(loss[lo:step].mean(), abs=1e-12)


def test_estimates_use_measured_minutes_per_epoch_on_the_same_device():
    def rec(task, method, minutes, device, epochs=3):
        evals = [{"epoch": e + 1} for e in range(epochs)]
        return {"fields": {"task": task, "method": method}, "status": "ok", "kind": "run",
                "wall_minutes": minutes, "eval": evals, "device": device}  # fmt: skip

    records = [rec("rte", "none", 9.0, "cpu"), rec("rte", "none", 12.0, "cpu"),
               rec("rte", "isobn", 15.0, "cpu"), rec("rte", "none", 0.3, "gpu")]  # fmt: skip
    assert epoch_minutes(records, "rte", "none", study_recipe, "cpu") == 3.5
    assert epoch_minutes(records, "rte", "isobn", study_recipe, "cpu") == 5.0
    assert epoch_minutes(records, "rte", "istar", study_recipe, "cpu") == 4.0
    assert epoch_minutes(records, "rte", "istar", study_recipe, "gpu") == pytest.approx(0.1)
    prior = study_recipe.EPOCH_MINUTES_PRIOR["cola"]
    assert epoch_minutes(records, "cola", "none", study_recipe, "cpu") == prior


def test_write_record_refuses_duplicates_and_torn_lines(tmp_path):
    path = tmp_path / "s.jsonl"
    write_record(path, {"cell": "a", "status": "ok"})
    with pytest.raises(ValueError, match="cell a is recorded already"):
        write_record(path, {"cell": "a", "status": "ok"})
    path.write_text(path.read_text() + '{"cell": "b"')
    with pytest.raises(ValueError, match="the last line is unfinished"):
        read_records(path)
    path.write_text('{"cell": "a", "status": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=r"s.jsonl:2: not JSON"):
        read_records(path)


def test_a_changed_recipe_is_refused(tmp_path, glue_dir, minilm_dir):
    grid = _grid_file(tmp_path, glue_dir, minilm_dir)
    results = tmp_path / "tiny.jsonl"
    record = {"study": "tiny", "cell": "rte-none-s1", "kind": "run", "status": "ok", "seed": 1,
              "fields": {"task": "rte", "method": "none"}, "config_hash": "0" * 16,
              "eval": [], "wall_minutes": 1.0}  # fmt: skip
    results.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match="a changed recipe needs a new study name"):
        runner.run_grid(grid, runs_dir=tmp_path / "runs", results=results, dry_run=True)


def test_git_state_outside_a_repository_reads_the_recorded_commit(tmp_path, monkeypatch):
    """A copy of the tree without `.git` (the device machine's): the commit and state that
    experiments/device/prepare.sh recorded, else "unknown" and dirty."""
    monkeypatch.setattr(study_cell, "REPO", tmp_path)
    monkeypatch.delenv("ISOJAX_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert git_state() == ("unknown", True)
    monkeypatch.setenv("ISOJAX_GIT_COMMIT", "c" * 40)
    monkeypatch.setenv("ISOJAX_GIT_DIRTY", "0")
    assert git_state() == ("c" * 40, False)
    monkeypatch.setenv("ISOJAX_GIT_DIRTY", "1")
    assert git_state() == ("c" * 40, True)


def test_study_analyze_without_the_run_folders_says_so_in_one_line(tmp_path, capsys):
    """Run folders are not committed: a results file alone gets one line naming where the runs
    were looked for, not a traceback; a missing results file too."""
    results = tmp_path / "s.jsonl"
    record = {"study": "s", "cell": "rte-none-s1", "kind": "run", "status": "ok", "seed": 1,
              "fields": {"task": "rte", "method": "none", "seed": 1}, "config_hash": "0",
              "eval": [{"epoch": 1, "score": 0.5}], "wall_minutes": 1.0}  # fmt: skip
    results.write_text(json.dumps(record) + "\n")
    assert study_analyze.main([str(results), "--runs-dir", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "1 of the 1 runs to analyse are not in" in err
    assert f"{tmp_path / 'runs' / 's' / 'rte-none-s1'}" in err and "not committed" in err
    assert study_analyze.main([str(tmp_path / "none.jsonl")]) == 2
    assert "no such results file" in capsys.readouterr().err


def test_the_study_reruns_a_stopped_cell_and_records_its_failure(monkeypatch, tmp_path):
    """Issue 25: a cell whose run stopped on a non-finite loss is trained again, not skipped."""
    (tmp_path / "results.json").write_text(json.dumps({"stopped": stops.STOPPED}))
    calls = []

    def stopped_again(config, workdir):
        calls.append(workdir)
        raise stops.NonFiniteLoss("training loss non-finite")

    monkeypatch.setattr(loop, "train_and_evaluate", stopped_again)
    with pytest.raises(stops.NonFiniteLoss):  # the grid's loop records it as failed
        run_cell(None, tmp_path, "run")
    assert calls == [tmp_path]
