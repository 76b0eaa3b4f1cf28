"""A normaliser and a penalty in one run: `isojax finetune --normalizer isobn --penalty istar`.

The run's checkpoint holds IsoBN's running statistics (the head's `batch_stats`) and I-STAR's
C0 (the train state's stabiliser), and its logged loss is the cross-entropy plus λ times the
I-STAR penalty, recomputed here from the saved state with the pure `isojax.istar_penalty` and
the task loss of the classifier's own forward pass; for tiny-bert and for a tiny ModernBERT
folder (whose I-STAR reads all of its layers' tokens too).
"""

import json

import jax
import numpy as np
import pytest
from helpers import tiny_bert_without_dropout, tiny_modernbert_folder

import isojax
from isojax import cli, runs
from isojax.models import transformer
from isojax.training import distributed, feeds, loop, steps

pytestmark = pytest.mark.e2e  # whole runs: the e2e lane

WEIGHT = 0.5


@pytest.mark.parametrize("model", ["tiny-bert", "modernbert"])
def test_isobn_with_istar_logs_the_sum_of_its_two_losses(
    model, tmp_path, glue_dir, minilm_dir, monkeypatch
):
    tiny_bert_without_dropout(monkeypatch)  # the forward pass is recomputed exactly
    extra = {"tokenizer": minilm_dir}  # ModernBERT's folder has its tokenizer (and no dropout)
    if model == "modernbert":
        model, extra = str(tiny_modernbert_folder(tmp_path / "tiny-modernbert", glue_dir)), {}
    workdir = tmp_path / "run"
    sets = {
        **extra, "max_train_examples": 16, "max_eval_examples": 8,
        "batch_size": 8, "eval_batch_size": 8, "max_length": 32, "buckets": "()",
        "max_steps": 1, "log_every": 1, "dropout_rate": 0.0, "istar.weight": WEIGHT,
        "istar.stabilizer.tokens": 200, "tensorboard": False, "progress": False,
    }  # fmt: skip
    argv = ["finetune", "--task", "rte", "--model", model, "--data-dir", str(glue_dir)]
    argv += ["--normalizer", "isobn", "--penalty", "istar", "--workdir", str(workdir)]
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    built, build_run = [], loop.build_run

    def recording(*args, **kwargs):  # the command's own build: its data and step 0's state
        run = build_run(*args, **kwargs)
        built.append((run, jax.device_get(run.state)))  # a host copy: the step donates it
        return run

    monkeypatch.setattr(loop, "build_run", recording)
    assert cli.main(argv) == 0

    restored = runs.restore(workdir)
    saved_norm = jax.device_get(restored.state.batch_stats["norm"])
    c0 = np.asarray(restored.state.stabilizer["c0"])
    assert int(saved_norm["count"]) == 1 and np.abs(saved_norm["cov"]).sum() > 0
    assert c0.shape == (32, 32) and not np.allclose(c0, np.eye(32))  # the pass's C0

    ((run, initial),) = built
    batch = next(iter(feeds.update_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh)))
    batch = distributed.global_batch(batch, run.mesh)

    @jax.jit  # one program (op by op, every operation compiled alone)
    def recomputed(state, batch, c0):
        (logits, out), updates = state.apply_fn(
            {"params": state.params, "batch_stats": state.batch_stats},  # step 0's
            **transformer.model_inputs(batch),
            deterministic=True,
            use_running_average=False,
            example_mask=batch["example_mask"],
            mutable=["batch_stats"],
        )
        task = steps.task_loss(logits, batch["labels"], batch["example_mask"], regression=False)
        mask = steps.penalty_mask(batch, include_padding=False)
        penalty = isojax.istar_penalty(out["encoder"].hidden_states, mask, c0=c0, zeta=0.2)
        return task, penalty, updates

    task, penalty, updates = recomputed(initial, batch, c0)

    (line,) = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["split"] == "train"]  # fmt: skip
    np.testing.assert_allclose(line["task_loss"], float(task), rtol=1e-5)
    np.testing.assert_allclose(line["penalty"], float(penalty), rtol=1e-5)
    np.testing.assert_allclose(line["loss"], float(task + WEIGHT * penalty), rtol=1e-5)
    np.testing.assert_allclose(
        saved_norm["cov"], np.asarray(updates["batch_stats"]["norm"]["cov"]), rtol=1e-5, atol=1e-7
    )
