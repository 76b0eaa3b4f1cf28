"""An NNX run folder written by isojax 0.4.0 (db1b38c), whose checkpoints hold linen's tree (its
NNX front end ran in linen's clothes), read by this code, whose NNX checkpoints hold NNX's own
tree: it restores (converted by `linen_path`, `front_ends.NnxApply.older_layouts`), predicts
its own dev results, exports the same weights as 0.4.0's `isojax export`, and resumes.

The folder is written at test time by 0.4.0's own code, from a `git worktree add --detach` of
that commit (`experiments.study.commit.ensure_worktree`) run with `PYTHONPATH` at the worktree.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from helpers import REPO

from experiments.study import commit as study_commit
from isojax import runs
from isojax.runs import export, predict
from isojax.runs import folder as run_folder
from isojax.training import loop

pytestmark = pytest.mark.e2e

V040 = "db1b38c"  # isojax 0.4.0


@pytest.fixture
def worktree(tmp_path):
    """A worktree of 0.4.0 (unregistered afterwards), or a skip when this checkout has no
    history to make it from."""
    known = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{V040}^{{commit}}"], capture_output=True
    )
    if known.returncode != 0:
        pytest.skip(f"this checkout has no git history holding isojax 0.4.0 ({V040})")
    tree = study_commit.ensure_worktree(REPO, V040, tmp_path / "v040")
    yield tree
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])


# 0.4.0's `isojax` commands in turn in one interpreter (one start-up and import of 0.4.0's code,
# not one per command), each as `isojax.cli.main`; the first non-zero status ends it.
_COMMANDS = """
import json, pathlib, sys
from isojax import cli
assert pathlib.Path(cli.__file__).is_relative_to(sys.argv[2]), cli.__file__  # 0.4.0's code
for argv in json.loads(sys.argv[1]):
    if code := cli.main(argv):
        sys.exit(code)
"""


def _run_040(tree, *commands, cwd):
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argvs = [[str(a) for a in argv] for argv in commands]
    done = subprocess.run(
        [sys.executable, "-c", _COMMANDS, json.dumps(argvs), str(tree)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_nnx_run_folder_of_040_restores_predicts_exports_and_resumes(
    tmp_path, glue_dir, minilm_dir, worktree
):
    tree = worktree
    run = tmp_path / "run"
    sets = {"tokenizer": minilm_dir, "max_train_examples": 16, "max_eval_examples": 16,
            "batch_size": 8, "eval_batch_size": 8, "max_length": 32, "num_epochs": 2,
            "progress": "false", "tensorboard": "false",
            "istar.stabilizer.tokens": 256}  # fmt: skip
    args = ["finetune", "--task", "rte", "--model", "tiny-bert", "--front-end", "nnx"]
    args += ["--normalizer", "isobn", "--penalty", "istar", "--data-dir", glue_dir]
    args += ["--workdir", run] + [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    _run_040(tree, args, ["export", run, tmp_path / "hf-040"], cwd=tree)
    results = json.loads((run / "results.json").read_text())

    restored = runs.restore(run)  # the newest checkpoint, step 4, in linen's tree on disk
    assert restored.step == 4 and isinstance(restored.state.params, nnx.State)
    assert "layers" in restored.state.params["encoder"]  # NNX's paths, converted
    assert predict.predict(restored, "dev").metrics == results["dev"]
    folder = export.export_run(restored, tmp_path / "hf").folder
    ours = safetensors.numpy.load_file(folder / "model.safetensors")
    theirs = safetensors.numpy.load_file(tmp_path / "hf-040" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)

    # Killed after epoch 1: its last checkpoint and results gone; this code resumes it.
    shutil.rmtree(run / "checkpoints" / "4")
    (run / "results.json").unlink()
    resumed = loop.train_and_evaluate(run_folder.load_config(run), run)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4 and max(steps) == 4
    assert np.isfinite(resumed["dev"]["score"])
    assert runs.restore(run).step == 4  # its new checkpoint: NNX's tree
