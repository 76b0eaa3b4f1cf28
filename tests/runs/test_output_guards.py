"""Audit findings on a run folder's neighbours: `predict --out`, `--glue-submission` and
`export` never write over a run's own files (finding 7), and refuse a destination under a file
in one line (finding 17); a checkpoint position with an unknown key (finding 17)."""

import json

import pytest

from isojax import cli, runs
from isojax.runs import export, predict
from isojax.training import position


@pytest.fixture
def run_dir(tmp_path):
    """A run folder's own files, as `train_and_evaluate` leaves them (no weights: every
    refusal here comes before the restore)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "4").mkdir(parents=True)
    (run / "best_checkpoint").mkdir()
    (run / "config.json").write_text(json.dumps({"task": "rte", "normalizer": "isobn"}))
    (run / "metrics.jsonl").write_text('{"step": 1, "epoch": 0, "split": "train"}\n')
    (run / "results.json").write_text("{}\n")
    return run


OWN = ("config.json", "metrics.jsonl", "results.json", "checkpoints/4/x.tsv", "best_checkpoint/a")


@pytest.mark.parametrize("name", OWN)
def test_predictions_never_replace_a_run_file(run_dir, name):
    """Finding 7: `check_file` (what `predict --out` and each written TSV pass) refuses a run
    folder's own files; a file beside them is taken."""
    before = (run_dir / "config.json").read_text()
    with pytest.raises(predict.OutputRefused, match="own files"):
        predict.check_file(run_dir / name)
    predict.check_file(run_dir / "predictions_dev.tsv")
    assert runs.run_owning(run_dir / "predictions_dev.tsv") is None
    assert (run_dir / "config.json").read_text() == before


def test_a_submission_folder_inside_the_checkpoints_is_refused(run_dir):
    """Finding 7: `--glue-submission RUN/checkpoints` would write RTE.tsv among them."""
    with pytest.raises(predict.OutputRefused, match="own files"):
        predict.check_folder(run_dir / "checkpoints")


@pytest.mark.parametrize(
    "argv, why",
    [
        (["predict", "{run}", "--split", "dev", "--out", "{run}/config.json"], "own files"),
        (["predict", "{run}", "--split", "dev", "--out", "{run}/metrics.jsonl"], "own files"),
        (["predict", "{run}", "--split", "test", "--glue-submission", "{run}/best_checkpoint"],
         "own files"),
        (["export", "{run}", "{run}/checkpoints/hf"], "own files"),
        (["export", "{run}", "{run}/config.json/hf"], "is a file, not a folder"),  # finding 17
    ],
)  # fmt: skip
def test_cli_refuses_in_one_line(run_dir, argv, why, capsys):
    """Findings 7 and 17: one line, exit status 2, before any restore; the run unchanged."""
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert cli.main([a.format(run=run_dir) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and why in err, err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_export_under_a_file_is_refused(tmp_path):
    """Finding 17: a destination under a file, refused by `check_destination` itself."""
    (tmp_path / "f").write_text("")
    with pytest.raises(export.DestinationRefused, match="is a file, not a folder"):
        export.check_destination(tmp_path / "f" / "hf")
    export.check_destination(tmp_path / "new" / "hf")


def test_position_with_an_unknown_key_is_refused():
    """Finding 17: a checkpoint's position JSON with a key `Position` has not: one-line
    `CheckpointMismatch` naming it, not a TypeError."""
    from isojax.training import checkpointing

    saved = position.Position().to_json() | {"surprise": 1}
    with pytest.raises(checkpointing.CheckpointMismatch, match="surprise"):
        position.Position.from_json(saved, "checkpoint step 4")
