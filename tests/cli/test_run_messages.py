"""What a newcomer reads from a run and from the `isojax` command (issue 26 items 3 and 8): the
another-config refusal is one line with status 2, the first line names the data source, the
progress line counts epochs as the summary does."""

import json

import pytest

from isojax import cli
from isojax.training import config as config_lib
from isojax.training import loop, reporting


def test_finetune_into_a_run_of_another_config_is_one_line_with_status_2(capsys, tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    before = config_lib.default_config()
    before.task = "rte"
    (workdir / "config.json").write_text(before.to_json(indent=2) + "\n")
    (workdir / "checkpoints").mkdir()
    saved = (workdir / "config.json").read_text()

    code = cli.main(
        ["finetune", "--task", "rte", "--normalizer", "isobn", "--workdir", str(workdir)]
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("isojax finetune: error: ")
    assert "another config (normalizer differs)" in err
    assert (workdir / "config.json").read_text() == saved  # nothing overwritten
    assert sorted(p.name for p in workdir.iterdir()) == ["checkpoints", "config.json"]


class _Stop(Exception):
    pass


def _first_stderr_line(capsys, monkeypatch, config, workdir) -> str:
    def stop(*args, **kwargs):
        raise _Stop

    # The line comes once the data have loaded (`build_run`), before any checkpoint is read.
    monkeypatch.setattr(loop, "build_run", lambda *args, **kwargs: None)
    monkeypatch.setattr(loop.Loop, "open", stop)
    with pytest.raises(_Stop):
        loop.train_and_evaluate(config, workdir)
    return capsys.readouterr().err.splitlines()[0]


def test_first_line_names_the_data_source(capsys, monkeypatch, tmp_path):
    config = config_lib.default_config()
    config.task, config.data_dir = "mrpc", "../shared/data/glue"
    line = _first_stderr_line(capsys, monkeypatch, config, tmp_path / "a")
    assert line == f"isojax: {tmp_path / 'a'}: mrpc from the TSVs in ../shared/data/glue"

    config.data_dir = None  # what `--config isobn` without --data-dir gives
    line = _first_stderr_line(capsys, monkeypatch, config, tmp_path / "b")
    assert "mrpc from tensorflow-datasets glue/mrpc in its default data dir" in line, line
    assert "no data_dir was given (--data-dir DIR" in line
    config.tfds_data_dir = "/data/tfds"
    line = _first_stderr_line(capsys, monkeypatch, config, tmp_path / "c")
    assert "glue/mrpc in /data/tfds" in line

    config.progress = False  # no progress display: stderr keeps a refusal's one line alone
    monkeypatch.setattr(loop, "build_run", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    with pytest.raises(_Stop):
        loop.train_and_evaluate(config, tmp_path / "d")
    assert capsys.readouterr().err == ""


def test_progress_line_counts_epochs_from_1_as_the_summary(capsys, tmp_path):
    log = reporting.RunLog(
        tmp_path,
        total_steps=4,
        every=1,
        enabled=True,
        progress=True,
        tensorboard=False,
        learning_rate=lambda step: 1e-4,
    )
    for step in (1, 2):  # the first call only starts the clock
        log.train(step, 0, {"loss": 0.5})
    log.close()
    err = capsys.readouterr().err
    assert err.startswith("step 2/4 epoch 1 loss 0.5000"), err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [0, 0]  # the records keep the loop's index


def test_the_terminal_handler_shows_each_line_once_beside_a_root_handler(capsys):
    """Importing orbax gives the root logger a handler (absl calls `logging.basicConfig()`):
    with the command's handler installed, a record shows once, not again through the root."""
    import io
    import logging

    from isojax.logs import install_log_handler

    root_stream = io.StringIO()
    root_handler = logging.StreamHandler(root_stream)
    logging.getLogger().addHandler(root_handler)
    try:
        install_log_handler()
        logging.getLogger("isojax.training.loop").info("isojax: one line")
    finally:
        logging.getLogger().removeHandler(root_handler)
    assert capsys.readouterr().err.count("isojax: one line") == 1
    assert root_stream.getvalue() == ""
