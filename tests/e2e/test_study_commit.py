"""Records made at another commit (issue 26, item 1; issue 49, item 5): on a throwaway
repository whose first commit has an "old" runner in the flat layout (a script
experiments/study.py that writes down how it was called, and knows only some flags), whose
second commit has a runner in the package layout (experiments/study/__main__.py, the same
recorder) and whose third has today's `experiments/study/`, records of commit 1 (or 2) that
hash differently are refused in one line naming the commit and a command that runs (checked by
running it); `--at-recorded-commit DIR` creates the worktree at that commit and re-executes its
runner, in its layout, with this checkout's results file, runs folder, data folder and
PYTHONPATH; a flag the old runner lacks is refused. Then the real thing: worktrees of 369d7aa
(the last flat commit) and of this checkout's tree committed on top of it, each detected and
run (`--dry-run`) with the command line `experiments.study.commit` builds for it."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

from experiments.study import commit as study_commit

pytestmark = pytest.mark.e2e

OLD_RUNNER = '''"""An old runner: it knows "--tier", "--runs-dir", "--results", "--dry-run" and
"--budget-minutes" only, and writes down its call."""
import json, os, sys

import experiments

with open(os.environ["OLD_RUNNER_OUT"], "w") as out:
    json.dump({"argv": sys.argv, "cwd": os.getcwd(), "PYTHONPATH": os.environ.get("PYTHONPATH"),
               "ISOJAX_GLUE_DIR": os.environ.get("ISOJAX_GLUE_DIR"),
               "experiments": experiments.__file__}, out)
'''

FLAT_GRID = """
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
GRID = FLAT_GRID.replace("import study_recipe", "from experiments.configs import study_recipe")
LAST_FLAT = "369d7aa"  # main's last commit with the flat layout (experiments/study.py)


def _git(repo, *args) -> str:
    names = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")
    env = os.environ | dict.fromkeys(names, "t")
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _commit(repo, message) -> str:
    _git(repo, "add", "-A", ".")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD")


def _repo(tmp_path, recorded: str) -> tuple[pathlib.Path, dict]:
    """The throwaway repository: commits "flat" (the old runner, experiments/study.py),
    "package" (the old runner as experiments/study/__main__.py) and today's runner; the results
    file holds one record of commit `recorded` whose hash differs from today's."""
    repo = tmp_path / "checkout"
    (repo / "experiments" / "configs").mkdir(parents=True)
    _git(repo, "init", "-q")
    (repo / "experiments" / "__init__.py").write_text("")
    (repo / "experiments" / "study.py").write_text(OLD_RUNNER)
    shutil.copy(REPO / "experiments/configs/study_recipe.py", repo / "experiments/configs")
    (repo / "experiments/configs/study_g.py").write_text(FLAT_GRID)
    commits = {"flat": _commit(repo, "flat layout")}
    (repo / "experiments" / "study.py").unlink()
    (repo / "experiments" / "study").mkdir()
    (repo / "experiments" / "study" / "__init__.py").write_text("")
    (repo / "experiments" / "study" / "__main__.py").write_text(OLD_RUNNER)
    (repo / "experiments" / "configs" / "__init__.py").write_text("")
    (repo / "experiments/configs/study_g.py").write_text(GRID)
    commits["package"] = _commit(repo, "package layout")
    for path in (REPO / "experiments" / "study").glob("*.py"):  # today's runner
        shutil.copy(path, repo / "experiments" / "study" / path.name)
    commits["today"] = _commit(repo, "today's runner")
    results = repo / "experiments/results/g.jsonl"
    results.parent.mkdir()
    record = {"study": "g", "cell": "rte-none-s1", "kind": "run", "status": "ok",
              "fields": {"task": "rte", "method": "none"}, "seed": 1, "eval": [],
              "wall_minutes": 1.0, "config_hash": "0" * 16, "git_commit": commits[recorded],
              "git_dirty": False}  # fmt: skip
    results.write_text(json.dumps(record) + "\n")
    return repo, commits


def _study(repo, *args, env):
    argv = [sys.executable, "-m", "experiments.study",
            str(repo / "experiments/configs/study_g.py"), *args]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=repo)


def _runner(where: pathlib.Path, layout: str) -> list[str]:
    """What the recorded commit's runner sees as its argv[0] and `experiments` package."""
    if layout == "flat":
        return [str(where / "experiments/study.py"), str(where / "experiments/__init__.py")]
    return [str(where / "experiments/study/__main__.py"), str(where / "experiments/__init__.py")]


@pytest.mark.parametrize("layout", ["flat", "package"])
def test_records_of_another_commit_are_refused_and_continued_there(tmp_path, glue_dir, layout):
    repo, commits = _repo(tmp_path, layout)
    old = commits[layout]
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
    where = tmp_path / f"checkout-at-{old[:7]}"
    assert f"worktree add --detach {where} {old[:10]} && cd {where} && " in command
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    called = json.loads(out.read_text())
    assert called["PYTHONPATH"] == str(where) and called["cwd"] == str(where)
    assert [called["argv"][0], called["experiments"]] == _runner(where, layout)
    assert called["argv"][1:] == [
        str(where / "experiments/configs/study_g.py"), "--tier", "1", "--runs-dir",
        str(repo / "runs"), "--dry-run", "--results", str(results),
    ]  # fmt: skip
    out.unlink()

    # --at-recorded-commit DIR: the worktree made there, the old runner executed in this process.
    wt = tmp_path / "elsewhere" / "wt"
    done = _study(repo, "--at-recorded-commit", str(wt), "--budget-minutes", "5", env=env)
    assert done.returncode == 0, done.stderr
    assert _git(wt, "rev-parse", "HEAD") == old
    assert study_commit.layout(wt) == (study_commit.FLAT if layout == "flat" else "package")
    called = json.loads(out.read_text())
    assert [called["argv"][0], called["experiments"]] == _runner(wt, layout)
    assert called["argv"][1:] == [
        str(wt / "experiments/configs/study_g.py"), "--tier", "1", "--budget-minutes", "5.0",
        "--runs-dir", str(repo / "runs"), "--results", str(results),
    ]  # fmt: skip
    assert called["PYTHONPATH"] == str(wt) and called["ISOJAX_GLUE_DIR"] == str(glue_dir)
    assert called["cwd"] == str(wt)

    # Reused; a flag the old runner does not know is refused, not dropped; a folder that is not
    # a checkout of the commit is refused (the CLI prints these as one line, status 2).
    assert study_commit.ensure_worktree(repo, old, wt) == wt
    grid = str(repo / "experiments/configs/study_g.py")
    with pytest.raises(study_commit.CommitError, match=f"the runner at {wt} has no --retry-failed"):
        study_commit.runner_argv(repo, wt, grid, [("--tier", 1), ("--retry-failed", True)])
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(study_commit.CommitError, match="is not a checkout of"):
        study_commit.ensure_worktree(repo, old, tmp_path / "other")


def _clone(tmp_path) -> pathlib.Path:
    """A clone of this checkout's repository sharing its objects (its worktrees are its own)."""
    clone = tmp_path / "clone"
    done = subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(REPO),
                           str(clone)], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    if subprocess.run(["git", "-C", str(clone), "cat-file", "-e", f"{LAST_FLAT}^{{commit}}"],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip(f"{LAST_FLAT} is not in this clone (shallow?)")
    return clone


def _this_tree(clone: pathlib.Path, tmp_path) -> str:
    """A commit of this checkout's working tree (isojax/, experiments/ and pyproject.toml, as
    they are now, committed or not) on top of 369d7aa, in `clone`."""
    env = os.environ | {"GIT_INDEX_FILE": str(tmp_path / "index")}
    git = ["git", f"--git-dir={clone / '.git'}", f"--work-tree={REPO}"]
    names = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")
    env |= dict.fromkeys(names, "t")

    def run(*args) -> str:
        done = subprocess.run([*git, *args], capture_output=True, text=True, env=env, cwd=REPO)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    run("read-tree", LAST_FLAT)
    run("add", "-A", "--", "isojax", "experiments", "pyproject.toml")
    return run("commit-tree", run("write-tree"), "-p", LAST_FLAT, "-m", "this checkout's tree")


@pytest.mark.parametrize("tree", ["last flat commit", "this checkout"])
def test_a_real_worktree_of_either_layout_runs_its_own_runner(tmp_path, glue_dir, tree):
    """`git worktree` of 369d7aa (experiments/study.py) or of this checkout's tree: the layout
    detected, and the runner's command line (as `--at-recorded-commit` re-executes it) plans
    the pilot grid there with the worktree's own code."""
    clone = _clone(tmp_path)
    commit = _git(clone, "rev-parse", LAST_FLAT if tree == "last flat commit" else
                  _this_tree(clone, tmp_path))  # fmt: skip
    wt = study_commit.ensure_worktree(clone, commit, tmp_path / "wt")
    want = study_commit.FLAT if tree == "last flat commit" else study_commit.PACKAGE
    assert study_commit.layout(wt) == want
    assert study_commit.tree_layout(clone, commit) == want
    results, runs = tmp_path / "pilot.jsonl", tmp_path / "runs"
    options = [("--tier", 1), ("--runs-dir", str(runs)), ("--dry-run", True),
               ("--results", str(results))]  # fmt: skip
    grid = str(clone / "experiments/configs/study_pilot.py")
    argv = study_commit.runner_argv(clone, wt, grid, options)
    runner = (
        ["-m", "experiments.study"] if want == "package" else [str(wt / "experiments/study.py")]
    )
    assert argv[1:-8] == runner and argv[-8] == str(wt / "experiments/configs/study_pilot.py")
    env = study_commit.runner_env(wt, str(glue_dir)) | {"JAX_PLATFORMS": "cpu"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=wt, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("study pilot (tiers 1-1): "), done.stdout
    assert f"-> {results}" in done.stdout.splitlines()[0]
