"""`--set attention_backend=...` through the command: "cudnn" on CPU refused in one line before
any weights are read, leaving no run folder; a CPU run records the XLA backend it ran."""

import json

import pytest
from helpers import finetune_args

from isojax import cli
from isojax.training import build


def test_cudnn_on_cpu_exits_2_in_one_line_before_weights_and_no_run_folder(
    tmp_path, glue_dir, minilm_dir, capsys, monkeypatch
):
    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(build, "load_encoder", no_weights)
    workdir = tmp_path / "run"
    argv = finetune_args(glue_dir, minilm_dir, workdir, "attention_backend=cudnn")
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    (line,) = err.strip().splitlines()
    assert line.startswith("isojax finetune: error: config: attention_backend cudnn cannot run")
    assert "platform cpu: cuDNN runs on NVIDIA GPUs only" in line and out == ""
    assert not workdir.exists()
    assert cli.main(finetune_args(glue_dir, minilm_dir, workdir, "attention_backend=fused")) == 2
    assert "attention_backend 'fused' not in" in capsys.readouterr().err
    assert not workdir.exists()


@pytest.mark.e2e  # a whole (two-step) run
def test_a_cpu_run_records_the_xla_backend(tmp_path, glue_dir, minilm_dir, capsys):
    workdir = tmp_path / "run"
    argv = finetune_args(glue_dir, minilm_dir, workdir, "max_steps=2", "num_epochs=1")
    assert cli.main([*argv, "--set", "progress=True"]) == 0
    err = capsys.readouterr().err
    assert "isojax: train step attention: global xla (platform cpu" in err
    assert "isojax: eval step attention: global xla (platform cpu" in err
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["split"] == "train"]
    assert train and all(
        r["attention_backend_global"] == r["attention_backend_eval_global"] == "xla" for r in train
    )
