"""Audit findings on experiments/: the study runner over a torn `metrics.jsonl` (finding 3),
the report on records missing nested keys (finding 17) and the committed reports' verdict lines
recomputed with SciPy (held probe 1)."""

import json
import pathlib

import pytest
from helpers import logged_warning

from experiments.report import page
from experiments.study import cell, runner

REPO = pathlib.Path(__file__).resolve().parents[2]


GRID = """
import ml_collections

from experiments.configs import study_recipe


def get_config(arg=None):
    grid = ml_collections.ConfigDict()
    grid.name = "torn"
    base = study_recipe.base_config()
    study_recipe.set_fields(base, {{"model": "tiny-bert", "data_dir": {glue!r}, "num_epochs": 2}})
    base.tokenizer = {tokenizer!r}
    grid.base = base
    grid.tiers = ml_collections.ConfigDict(
        {{"1": ({{"seed": [1], "task": ["rte"], "method": ["none"]}},)}}
    )
    grid.pretrained = False
    grid.baseline = (("method", "none"),)
    grid.sweep = ""
    return grid
"""
TORN = '{"step": 1, "epoch": 0, "split": "train", "loss": 0.7}\n{"step": 2, "ep'


def test_read_run_drops_a_torn_last_line(caplog, tmp_path):
    """Finding 3: `read_run` reads `metrics.jsonl` as the loop does, a torn last line dropped."""
    (tmp_path / "metrics.jsonl").write_text(TORN)
    with logged_warning(caplog, "torn last line"):
        run = cell.read_run(tmp_path)
    assert run["steps"] == 1 and run["eval"] == []


@pytest.mark.e2e  # a whole run
def test_dry_run_over_a_torn_cell_prints_its_estimate(tmp_path, glue_dir, minilm_dir, caplog):
    """Finding 3: `python -m experiments.study --dry-run` over a pending cell with a torn last
    line and over one with a bad middle line prints the plan and an estimate, never a traceback."""
    grid = tmp_path / "study_torn.py"
    grid.write_text(GRID.format(glue=str(glue_dir), tokenizer=str(minilm_dir)))
    cell = tmp_path / "runs" / "torn" / "rte-none-s1"
    cell.mkdir(parents=True)
    (cell / "metrics.jsonl").write_text(TORN)
    lines = []
    runner.run_grid(str(grid), runs_dir=tmp_path / "runs", results=tmp_path / "r.jsonl",
                   dry_run=True, log=lines.append)  # fmt: skip
    assert "estimate" in lines[0] and "rte-none-s1: time unknown" in lines[1]
    assert "no estimate" not in caplog.text  # the torn line dropped, the folder read
    (cell / "metrics.jsonl").write_text("not json\n" + TORN + "\n")
    lines.clear()
    runner.run_grid(str(grid), runs_dir=tmp_path / "runs", results=tmp_path / "r.jsonl",
                   dry_run=True, log=lines.append)  # fmt: skip
    assert "estimate" in lines[0] and "rte-none-s1: time unknown" in lines[1]
    assert "rte-none-s1: no estimate" in caplog.text and "not a metrics record" in caplog.text


@pytest.mark.parametrize("damage", ["score", "task", "eval"])
def test_report_refuses_a_record_missing_nested_keys(tmp_path, damage, capsys):
    """Finding 17: a record whose eval row lacks `score`, whose fields lack `task`, or whose
    eval is not a list: one line naming the file and line, exit status 2."""
    lines = (REPO / "experiments/results/cosreg.jsonl").read_text().splitlines()[:2]
    record = json.loads(lines[1])
    if damage == "score":
        del record["eval"][0]["score"]
    elif damage == "task":
        del record["fields"]["task"]
    else:
        record["eval"] = {"oops": 1}
    path = tmp_path / "damaged.jsonl"
    path.write_text(lines[0] + "\n" + json.dumps(record) + "\n")
    assert page.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}:2: not a study record" in err, err
