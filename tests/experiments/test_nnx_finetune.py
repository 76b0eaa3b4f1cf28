"""`experiments/examples/nnx_finetune.py`, the short example of the library loop with the NNX
front end: a preset with `front_end` "nnx", a valid config, handed to `train_and_evaluate` (the runs
themselves are tested in tests/training/test_front_ends.py)."""

from experiments.examples import nnx_finetune as example
from isojax.training import config as config_lib


def test_the_example_runs_the_main_job_through_the_library_loop(tmp_path, monkeypatch, capsys):
    calls = []

    def train_and_evaluate(config, workdir):
        config_lib.validate_config(config)
        calls.append((config, workdir))
        return {"dev": {"pearson": 0.5}}

    monkeypatch.setattr(example.loop, "train_and_evaluate", train_and_evaluate)
    example.main(["--config", "istar", "--task", "stsb", "--workdir", str(tmp_path)])
    [(config, workdir)] = calls
    assert (config.front_end, config.penalty, config.task) == ("nnx", "istar", "stsb")
    assert workdir == tmp_path
    assert capsys.readouterr().out == "{'pearson': 0.5}\n"
