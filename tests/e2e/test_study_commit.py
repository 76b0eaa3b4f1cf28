"""Records made at another commit (issue 26, item 1): on a throwaway repository whose first
commit has an "old" runner (a script that writes down how it was called, and knows only some
flags) and whose second commit has today's `study.py`, records of commit 1 that hash
differently are refused in one line naming commit 1 and a command that runs (checked by running
it); `--at-recorded-commit DIR` creates the worktree at commit 1 and re-executes its runner with
this checkout's results file, runs folder, data folder and PYTHONPATH; a flag the old runner
lacks is refused."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e

OLD_RUNNER = '''"""An old study.py: it knows "--tier", "--runs-dir", "--results", "--dry-run" and
"--budget-minutes" only, and writes down its call."""
import json, os, sys

with open(os.environ["OLD_RUNNER_OUT"], "w") as out:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "PYTHONPATH": os.environ.get("PYTHONPATH"),
               "ISOJAX_GLUE_DIR": os.environ.get("ISOJAX_GLUE_DIR")}, out)
'''

GRID = """
import ml_collections
import study_recipe


def get_config(arg=None):
    grid = ml_collections.ConfigDict()
    grid.name = "g"
    grid.base = study_recipe.base_config()
    grid.tiers = ml_collections.ConfigDict({"1": ({"seed": [1], "task": ["rte"],
                                                   "method": ["none"]},)})
    grid.pretrained = False
    return grid
"""


def _git(repo, *args) -> str:
    names = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")
    env = os.environ | dict.fromkeys(names, "t")
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _repo(tmp_path) -> tuple[pathlib.Path, str]:
    repo = tmp_path / "checkout"
    (repo / "experiments" / "configs").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "experiments" / "study.py").write_text(OLD_RUNNER)
    shutil.copy(REPO / "experiments/configs/study_recipe.py", repo / "experiments/configs")
    (repo / "experiments/configs/study_g.py").write_text(GRID)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "old runner")
    old = _git(repo, "rev-parse", "HEAD")
    for path in (REPO / "experiments").glob("study*.py"):  # the runner and its modules
        shutil.copy(path, repo / "experiments" / path.name)
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "new runner")
    results = repo / "experiments/results/g.jsonl"
    results.parent.mkdir()
    record = {"cell": "rte-none-s1", "status": "ok", "config_hash": "0" * 16,
              "git_commit": old, "git_dirty": False}  # fmt: skip
    results.write_text(json.dumps(record) + "\n")
    return repo, old


def _study(repo, *args, env):
    argv = [sys.executable, str(repo / "experiments/study.py"),
            str(repo / "experiments/configs/study_g.py"), *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=repo)


def test_records_of_another_commit_are_refused_and_continued_there(tmp_path, glue_dir):
    repo, old = _repo(tmp_path)
    out = tmp_path / "called.json"
    env = os.environ | {
        "OLD_RUNNER_OUT": str(out),
        "ISOJAX_GLUE_DIR": str(glue_dir),
        "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    results = repo / "experiments/results/g.jsonl"

    # The refusal: one line, status 2, naming the commit and the command continuing there.
    done = _study(repo, "--dry-run", env=env)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    line = done.stderr
    assert (
        f"made at commit {old[:10]}" in line and "a changed recipe needs a new study name" in line
    )
    command = line.split("to continue it there: ")[1].split(" (or add --at-recorded-commit)")[0]
    assert f"worktree add --detach {tmp_path / 'checkout-at-'}{old[:7]} {old[:10]}" in command
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    where = tmp_path / f"checkout-at-{old[:7]}"
    called = json.loads(out.read_text())
    assert called["PYTHONPATH"] == str(where)
    assert called["argv"] == [
        str(where / "experiments/study.py"), str(where / "experiments/configs/study_g.py"),
        "--tier", "1", "--runs-dir", str(repo / "runs"), "--dry-run", "--results", str(results),
    ]  # fmt: skip
    out.unlink()

    # --at-recorded-commit DIR: the worktree made there, the old runner executed in this process.
    wt = tmp_path / "elsewhere" / "wt"
    done = _study(repo, "--at-recorded-commit", str(wt), "--budget-minutes", "5", env=env)
    assert done.returncode == 0, done.stderr
    assert _git(wt, "rev-parse", "HEAD") == old
    called = json.loads(out.read_text())
    assert called["argv"] == [
        str(wt / "experiments/study.py"), str(wt / "experiments/configs/study_g.py"),
        "--tier", "1", "--budget-minutes", "5.0", "--runs-dir", str(repo / "runs"),
        "--results", str(results),
    ]  # fmt: skip
    assert called["PYTHONPATH"] == str(wt) and called["ISOJAX_GLUE_DIR"] == str(glue_dir)

    # Reused; a flag the old runner does not know is refused, not dropped; a folder that is not
    # a checkout of the commit is refused (the CLI prints these as one line, status 2).
    sys.path.insert(0, str(REPO / "experiments"))
    import study_commit

    assert study_commit.ensure_worktree(repo, old, wt) == wt
    grid = str(repo / "experiments/configs/study_g.py")
    with pytest.raises(study_commit.CommitError, match=f"the runner at {wt} has no --retry-failed"):
        study_commit.old_argv(repo, wt, grid, [("--tier", 1), ("--retry-failed", True)])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(study_commit.CommitError, match="is not a checkout of"):
        study_commit.ensure_worktree(repo, old, tmp_path / "other")
