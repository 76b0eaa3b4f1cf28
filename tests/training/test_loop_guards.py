"""The audit's findings on the fine-tuning loop, in process (/work/shared/AUDIT.md numbering):
1 (micro-batches below a normaliser's minimum), 5 and 15 (a run folder is one run's; a best
save is never a silent no-op; `config.json` written once the restore accepted the config),
6 (a same-step checkpoint of another position is replaced) and 16 (the profiler window closed
on an error)."""

import json
import pathlib

import jax.numpy as jnp
import pytest
from children import finetune_argv
from helpers import one_device_mesh, tiny_config

from isojax import cli
from isojax.core import normalizers
from isojax.training import checkpointing, reporting, run_folder, specs, stops
from isojax.training import config as config_lib
from isojax.training import loop as loop_lib


def _config(glue_dir, minilm_dir, **over):
    """`helpers.tiny_config` with 8 dev rows, no dropout and the default logging interval."""
    return tiny_config(
        glue_dir, minilm_dir, max_eval_examples=8, log_every=50, dropout_rate=0.0, **over
    )


def _one_device():
    return one_device_mesh()


# ---------------------------------------------------------------------------------------------
# Finding 1: a micro-batch below the normaliser's minimum is refused; a normaliser that skips
# every batch of an epoch stops the run.
# ---------------------------------------------------------------------------------------------


def test_every_normalizer_declares_its_minimum_rows():
    assert set(normalizers.MIN_ROWS) == set(normalizers.NORMALIZERS)
    assert {n: normalizers.MIN_ROWS[n] for n in ("isobn", "batchnorm", "recenter")} == {
        "isobn": 2,
        "batchnorm": 2,
        "recenter": 2,
    }


@pytest.mark.parametrize("normalizer", ["isobn", "batchnorm", "recenter"])
def test_micro_batch_below_the_normalizers_minimum_is_refused(glue_dir, minilm_dir, normalizer):
    config = _config(glue_dir, minilm_dir, normalizer=normalizer, grad_accum_steps=8)
    with pytest.raises(config_lib.ConfigError, match=r"batch_size / grad_accum_steps = 8 / 8 = 1"):
        config_lib.validate_config(config)
    config_lib.validate_config(
        _config(glue_dir, minilm_dir, normalizer=normalizer, grad_accum_steps=4)
    )
    config_lib.validate_config(_config(glue_dir, minilm_dir, normalizer="none", grad_accum_steps=8))


@pytest.mark.e2e  # a whole run
def test_a_normalizer_that_skipped_every_batch_of_an_epoch_stops_the_run(
    monkeypatch, tmp_path, glue_dir, minilm_dir
):
    """The config check bypassed: IsoBN on one-row micro-batches skips all 16 of the epoch;
    the run stops at the epoch's end with `NormalizerStalled`, no results.json."""
    monkeypatch.setattr(config_lib, "validate_config", lambda config: None)
    config = _config(glue_dir, minilm_dir, normalizer="isobn", grad_accum_steps=8)
    with pytest.raises(stops.NormalizerStalled, match="skipped all 16 training batches"):
        loop_lib.train_and_evaluate(config, tmp_path / "run", mesh=_one_device())
    assert not (tmp_path / "run" / "results.json").exists()


def test_running_counters_read_every_running_module():
    stats = {"head": {"norm": {"count": jnp.int32(3), "skipped": jnp.int32(1), "cov": jnp.ones(2)}}}
    assert stops.running_counters(stats) == {"head/norm": (3, 1)}
    stops.check_running({"head/norm": (2, 1)}, stats, 0, 4)  # moved: fine
    with pytest.raises(stops.NormalizerStalled):
        stops.check_running({"head/norm": (3, 0)}, stats, 0, 4)


# ---------------------------------------------------------------------------------------------
# Findings 5, 6, 15: checkpoints replaced, never silently kept; a run folder is one run's.
# ---------------------------------------------------------------------------------------------


def _tree(value: float) -> dict:
    return {"w": jnp.full((3,), value, jnp.float32)}


def _restored(ckpt, step=None):
    state, position = ckpt.restore(_tree(0.0), step=step)
    return float(state["w"][0]), position


def test_a_save_replaces_a_later_step_and_a_same_step_of_another_position(tmp_path):
    """What orbax skips silently (a step below its newest one; a step saved already) is
    written; the same step with the same position is not written again."""
    ckpt = checkpointing.Checkpointer(tmp_path / "best", max_to_keep=1)
    ckpt.save(4, _tree(4.0), {"run": "old"})
    ckpt.save(2, _tree(2.0), {"run": "new"})
    assert ckpt.all_steps() == [2] and _restored(ckpt) == (2.0, {"run": "new"})
    ckpt.save(2, _tree(5.0), {"run": "evaluated"})
    assert _restored(ckpt) == (5.0, {"run": "evaluated"})
    ckpt.save(2, _tree(9.0), {"run": "evaluated"})  # same position: kept
    assert _restored(ckpt) == (5.0, {"run": "evaluated"})
    assert sorted(p.name for p in (tmp_path / "best").iterdir()) == ["2"]
    ckpt.close()


def test_a_replacement_cut_short_is_put_back(tmp_path):
    """A kill between setting the old step aside and committing the new one: the next
    checkpointer of the folder puts the old one back."""
    ckpt = checkpointing.Checkpointer(tmp_path / "c", max_to_keep=2)
    ckpt.save(6, _tree(6.0), {"evaluated": False})
    ckpt.close()
    (tmp_path / "c" / "6").rename(tmp_path / "c" / "6.replaced")
    again = checkpointing.Checkpointer(tmp_path / "c", max_to_keep=2)
    assert again.all_steps() == [6] and _restored(again) == (6.0, {"evaluated": False})
    again.close()


def _write_run(workdir: pathlib.Path, config, *artefacts: str) -> None:
    workdir.mkdir(parents=True)
    (workdir / "config.json").write_text(config.to_json())
    for name in artefacts:
        if name.endswith("/"):
            (workdir / name / "4").mkdir(parents=True)
        else:
            (workdir / name).write_text('{"step": 4}\n')


@pytest.mark.parametrize("artefact", ["best_checkpoint/", "metrics.jsonl", "results.json"])
def test_a_folder_holding_any_run_artefact_refuses_another_config(
    tmp_path, glue_dir, minilm_dir, artefact
):
    config = _config(glue_dir, minilm_dir)
    _write_run(tmp_path / "run", config, artefact)
    same = specs.RunSpec.of(config).fields
    run_folder.check_same_run(same, tmp_path / "run")  # the same run: accepted
    other = _config(glue_dir, minilm_dir, seed=5)
    with pytest.raises(run_folder.ConfigChanged, match=rf"holds a run \({artefact}\).*seed differ"):
        run_folder.check_same_run(specs.RunSpec.of(other).fields, tmp_path / "run")
    (tmp_path / "run" / "config.json").unlink()
    with pytest.raises(run_folder.ConfigChanged, match="no config.json"):
        run_folder.check_same_run(same, tmp_path / "run")


@pytest.mark.e2e  # a whole run
def test_config_json_is_written_only_once_the_restore_accepted_the_config(
    tmp_path, glue_dir, minilm_dir, capsys
):
    """Finding 15: a run whose config.json went missing, resumed with another seed, is refused
    by the checkpoint's stamp and config.json is not written, so the rerun with the run's own
    config resumes. Finding 5: with checkpoints/ deleted, another config is refused."""
    workdir = tmp_path / "p15"
    argv = finetune_argv(workdir, glue_dir, minilm_dir, "max_steps=2", "num_epochs=1")
    assert cli.main(argv) == 0
    (workdir / "config.json").unlink()
    capsys.readouterr()
    assert cli.main([*argv, "--set", "seed=7"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "seed: 0 -> 7" in line
    assert not (workdir / "config.json").exists()
    assert cli.main(argv) == 0
    assert json.loads((workdir / "config.json").read_text())["seed"] == 0
    for path in (workdir / "checkpoints").iterdir():
        checkpointing.shutil.rmtree(path)
    capsys.readouterr()
    assert cli.main([*argv, "--set", "seed=5"]) == 2
    assert "with another config (seed differs)" in capsys.readouterr().err
    best = json.loads((workdir / "results.json").read_text())["best"]
    assert [int(p.name) for p in (workdir / "best_checkpoint").iterdir()] == [best["step"]]


# ---------------------------------------------------------------------------------------------
# Finding 16: the profiler window is closed on every exit path.
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e  # a whole run
def test_an_error_inside_the_profile_window_still_writes_the_trace(
    monkeypatch, tmp_path, glue_dir, minilm_dir
):
    train = reporting.RunLog.train

    def fail_at_step_2(self, step, epoch, means):
        train(self, step, epoch, means)
        if step == 2:
            raise RuntimeError("injected")

    monkeypatch.setattr(reporting.RunLog, "train", fail_at_step_2)
    config = _config(glue_dir, minilm_dir, profile_steps=(1, 4), max_train_examples=48)
    with pytest.raises(RuntimeError, match="injected"):
        loop_lib.train_and_evaluate(config, tmp_path / "run")
    assert list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
