"""A run trained with `attention_backend` "cudnn" restores anywhere: "auto" (on CPU, XLA)."""

import json

import pytest

from isojax.runs import folder
from isojax.training import build


class _Built(Exception):
    pass


@pytest.mark.parametrize(("saved", "built"), [("cudnn", "auto"), ("xla", "xla"), (None, "auto")])
def test_restore_builds_the_model_with_a_backend_that_runs_here(
    tmp_path, monkeypatch, minilm_dir, saved, built
):
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    config = {"task": "rte", "model": "tiny-bert", "tokenizer": str(minilm_dir)}
    if saved is not None:  # None: a run folder of an isojax before the field
        config["attention_backend"] = saved
    (run / "config.json").write_text(json.dumps(config))
    seen = []

    def build_model(spec, num_labels, **kwargs):
        seen.append(spec.attention_backend)
        raise _Built

    monkeypatch.setattr(build, "build_model", build_model)
    with pytest.raises(_Built):
        folder.restore(run)
    assert seen == [built]
