"""isojax.cli: one-line usage errors with exit status 2, config precedence, end-to-end runs."""

import json

import pytest
from helpers import REPO

from isojax import cli

FINETUNE_CONFIG = str(REPO / "experiments" / "configs" / "finetune.py")


def run(capsys, argv):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "flags, bad",
    [
        (["--task", "sst9"], "'sst9'"),
        (["--normalizer", "isobnx"], "'isobnx'"),
        (["--set", "istar.zeta=1.5"], "istar.zeta: zeta must lie in [0, 1], got 1.5"),
        (["--set", "istar.zeta=-0.1"], "got -0.1"),
        (["--set", "isobn.momentum=1.0"], "isobn: momentum 1.0 not in (0, 1)"),
        (["--set", "istar.stabilizer.momentum=0"], "istar.stabilizer: momentum 0.0 not in"),
        (["--set", "istar.zetta=0.5"], "'istar.zetta'"),
        (["--set", "batch_size=big"], "batch_size='big'"),
        (["--seed", "high"], "'high'"),
        (["--config", "bert"], "--config: unknown preset 'bert' and no config file of that name"),
        # Old spellings name the new one.
        (["--istar-zeta", "0.4"], "--istar-zeta was removed: use --set istar.zeta=VALUE"),
        (["--preset", "istar"], "--preset was removed: use --config isobn or --config istar"),
        (["--max-steps", "2"], "--max-steps was removed: use --set max_steps=N"),
        (["--set", "preset=istar"], "'preset' was renamed: use --config isobn|istar"),
        (["--set", "istar.stabilizer_window=5"], "use istar.stabilizer.window"),
        # `--set` garbage (issue 25: held).
        (["--set", "batch_size"], "--set 'batch_size': expected key.path=value"),
        (["--set", "=3"], "unknown config field ''"),
        (["--set", "buckets=(32,"], "buckets='(32,'"),
        (["--set", "optimizer=0.1"], "optimizer=0.1"),
        # Issue 25 item 11: a negative seed, None where a value is needed, an unknown key of
        # the normaliser (refused by normalizers.check_hparams before anything is built).
        (["--seed", "-1"], "config: seed must be an integer in [0, 2**32 - 1], got -1"),
        (["--set", "seed=4294967296"], "seed must be an integer in [0, 2**32 - 1]"),
        (["--set", "log_every=None"], "config: log_every must be set (its default is 50)"),
        (["--set", "batch_size=none"], "config: batch_size must be set"),
        (
            ["--normalizer", "layernorm", "--set", "normalizer_kwargs.epsilonn=1e-5"],
            "config: normalizer_kwargs: normalizer 'layernorm' has no hyper-parameter(s) "
            "['epsilonn']",
        ),
        (
            ["--normalizer", "isobn", "--set", "normalizer_kwargs.epsilon=-1.0"],
            "config: normalizer_kwargs: epsilon must be > 0",
        ),
        (["--set", "normalizer_kwargs.beta=0.5"], "normalizer 'none' has no hyper-parameter"),
        (["--set", "normalizer_kwargs.a.b=1"], "unknown config field 'normalizer_kwargs.a'"),
        (
            ["--normalizer", "layernorm", "--set", "normalizer_kwargs.dtype=float16"],
            "normalizer_kwargs: ['dtype'] are set by the classifier head",
        ),
    ],
)
def test_finetune_rejects_bad_values_with_one_line_and_status_2(capsys, tmp_path, flags, bad):
    code, out, err = run(capsys, ["finetune", "--workdir", str(tmp_path), *flags])
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("isojax") and "error" in err and bad in err, err
    assert not any(tmp_path.iterdir())  # nothing was started


def test_analyze_rejects_unknown_names_and_bench_is_no_command(capsys):
    code, _, err = run(capsys, ["analyze", "--task", "glue9"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "'glue9'" in err
    code, _, err = run(capsys, ["analyze", "--zeta", "2"])
    assert code == 2 and "--zeta 2.0 not in [0, 1]" in err
    # The benchmarks are `python -m experiments.bench.NAME` in a checkout (0.6.0).
    code, _, err = run(capsys, ["bench", "data_speed"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "invalid choice: 'bench' (choose from 'finetune', 'analyze', 'export', 'predict')" in err


def test_a_config_file_that_cannot_load_is_one_line(capsys, tmp_path):
    """`--config FILE` that Python cannot read, or whose get_config fails or returns something
    else, is one line naming the file (its line for a syntax error), status 2, nothing run."""
    config_file = tmp_path / "bad_config.py"
    for source, bad in [
        ("def get_config(arg):\n    return (\n", f"config file {config_file}:2: "),
        ("import not_a_module_anywhere\n", "ModuleNotFoundError: No module named"),
        ("x = 1\n", f"config file {config_file} has no get_config(arg)"),
        ("def get_config(arg):\n    return 1 / 0\n", "get_config raised ZeroDivisionError"),
        ("def get_config(arg):\n    return {}\n", "returned a dict, not a ConfigDict"),
    ]:
        config_file.write_text(source)
        argv = ["finetune", "--workdir", str(tmp_path / "run"), "--config", str(config_file)]
        code, out, err = run(capsys, argv)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("isojax finetune: error: --config: ") and bad in err, err
        assert not (tmp_path / "run").exists()


def test_config_precedence_file_then_flags_then_set(capsys, tmp_path):
    config_file = tmp_path / "my_config.py"
    config_file.write_text(
        "import ml_collections\n"
        "def get_config(arg):\n"
        "    c = ml_collections.ConfigDict()\n"
        "    c.task = arg\n"
        "    c.max_length = 96\n"
        "    c.istar = dict(zeta=0.3, weight=0.5)\n"
        "    return c\n"
    )
    argv = ["finetune", "--workdir", str(tmp_path / "run"), "--print-config"]
    argv += ["--config", f"{config_file}:mrpc", "--task", "rte", "--seed", "7"]
    argv += ["--set", "istar.weight=-2", "--set", "buckets=(16, 48)", "--set", "fsdp=true"]
    argv += ["--set", "max_steps=None", "--set", "optimizer.clip_norm=none"]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    config = json.loads(out)
    assert config["max_length"] == 96 and config["istar"]["zeta"] == 0.3  # from the file
    assert config["num_epochs"] == 3  # a field the file leaves out keeps its default
    assert (config["task"], config["seed"]) == ("rte", 7)  # the flags override the file
    assert config["istar"]["weight"] == -2  # --set overrides everything
    assert config["buckets"] == [16, 48] and config["fsdp"] is True
    assert config["max_steps"] is None and config["optimizer"]["clip_norm"] is None


def test_set_into_normalizer_kwargs_as_documented(capsys, tmp_path):
    """ARCHITECTURE.md's `--set normalizer_kwargs.epsilon=1e-5` (a key of a field that is an
    empty dict by default) works, from a --config file too, and reaches the normaliser's
    check (issue 25 item 14)."""
    argv = ["finetune", "--workdir", str(tmp_path / "run"), "--print-config"]
    code, out, err = run(
        capsys, [*argv, "--normalizer", "layernorm", "--set", "normalizer_kwargs.epsilon=1e-5"]
    )
    assert code == 0, err
    assert json.loads(out)["normalizer_kwargs"] == {"epsilon": 1e-5}
    config_file = tmp_path / "kwargs_config.py"
    config_file.write_text(
        "import ml_collections\n"
        "def get_config(arg):\n"
        "    return ml_collections.ConfigDict(\n"
        "        dict(normalizer='isobn', normalizer_kwargs=dict(epsilon=1e-4, debias=True)))\n"
    )
    code, out, err = run(capsys, [*argv, "--config", str(config_file)])
    assert code == 0, err
    assert json.loads(out)["normalizer_kwargs"] == {"epsilon": 1e-4, "debias": True}


def test_packaged_presets_are_configs(capsys, tmp_path):
    argv = ["finetune", "--workdir", str(tmp_path), "--print-config", "--config", "istar"]
    code, out, err = run(capsys, [*argv, "--task", "mrpc", "--set", "istar.zeta=0.4"])
    assert code == 0, err
    config = json.loads(out)
    assert (config["penalty"], config["task"], config["istar"]["weight"]) == ("istar", "mrpc", -5)
    assert config["istar"]["zeta"] == 0.4 and config["optimizer"]["learning_rate"] == 1e-5


@pytest.mark.e2e  # a whole run
def test_finetune_tiny_model_end_to_end(capsys, tmp_path, glue_dir):
    workdir = tmp_path / "run"
    argv = ["finetune", "--config", f"{FINETUNE_CONFIG}:rte,isobn,tiny", "--workdir", str(workdir)]
    argv += ["--data-dir", str(glue_dir), "--set", "max_steps=1"]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    results = json.loads((workdir / "results.json").read_text())
    assert results["step"] == 1
    dev = results["dev"]
    assert 0.0 <= dev["accuracy"] <= 1.0 and 0.0 < dev["sentence_ev3"] <= 1.0
    assert f"accuracy {dev['accuracy']:.4f}" in out
    config = json.loads((workdir / "config.json").read_text())
    assert (config["model"], config["normalizer"]) == ("tiny-bert", "isobn")


@pytest.mark.e2e  # a whole run
def test_analyze_tiny_model_writes_report(capsys, tmp_path, glue_dir, minilm_dir):
    argv = ["analyze", "--model", "tiny-bert", "--tokenizer", str(minilm_dir), "--task", "rte"]
    argv += ["--data-dir", str(glue_dir), "--max-examples", "16", "--max-length", "32"]
    argv += ["--out", str(tmp_path)]
    code, out, err = run(capsys, argv)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cls"]["count"] == 16
    assert f"{summary['cls']['EV_3']:.4f}" in out
    for name in ("ev_curve", "std_histogram", "abs_correlation", "layer_isoscore"):
        assert (tmp_path / f"{name}.png").stat().st_size > 2000


def test_one_loader_reads_presets_files_and_grid_files(tmp_path):
    """`configs.load("NAME[:ARG]" | "path.py[:ARG]")`: the ARG after the colon, else the
    argument; the study's grid files come through the same loader."""
    from experiments.study import grid as study_grid
    from isojax.training import configs

    config_file = tmp_path / "task_config.py"
    config_file.write_text(
        "import ml_collections\n"
        "def get_config(arg):\n"
        "    return ml_collections.ConfigDict(dict(task=arg))\n"
    )
    assert configs.load(f"{config_file}:mrpc").task == "mrpc"
    assert configs.load(str(config_file), "cola").task == "cola"
    assert configs.load(f"{config_file}:mrpc", "cola").task == "mrpc"  # the spec's own wins
    assert configs.load(str(config_file)).task is None
    assert configs.load("istar:unused").to_dict() == configs.load("istar").to_dict()
    assert configs.load("istar").penalty == "istar"
    grid_file = str(REPO / "experiments" / "configs" / "study_pilot.py")
    grid, _ = study_grid.load_grid(grid_file)
    assert grid.to_dict() == configs.load(grid_file, what="grid file").to_dict()
