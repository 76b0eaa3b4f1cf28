"""experiments/examples/compare.py, the main job (issue 25, item 17): it prints progress and
the table, the JSON stays in the run folders."""

import json

from helpers import REPO

from experiments.examples import compare


def test_compare_prints_progress_and_the_table_not_json(monkeypatch, tmp_path, capsys):
    row = {key: 0.5 for key in compare.ISOTROPY_KEYS}
    monkeypatch.setattr(compare, "pretrained_row", lambda config: dict(row))

    def train_and_evaluate(config, workdir):  # what the real one leaves: a folder and results
        workdir.mkdir(parents=True)
        return {"dev": row | {"score": 0.8}}

    monkeypatch.setattr(compare.loop, "train_and_evaluate", train_and_evaluate)
    argv = ["--config", str(REPO / "experiments" / "configs" / "main_job.py")]
    assert compare.main([*argv, "--methods", "none,isobn", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "{" not in out, out
    assert "none: dev score 0.8000 after" in out and "| isobn | 0.8000 |" in out
    assert json.loads((tmp_path / "pretrained.json").read_text())["sentence_ev1"] == 0.5
