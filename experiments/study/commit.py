"""Continuing a study at the commit its records were made at (issue 26, item 1).

A study's records carry `config_hash`; a checkout whose grid hashes a recorded cell
differently (a library default or a recipe changed since) must not add runs of another recipe
to the same JSONL, and the runner refuses. What continues the study is the code of the commit
the records name: a `git worktree` detached at that commit, whose own runner runs the grid
with `PYTHONPATH` at the worktree (the venv's editable install would otherwise import this
checkout's `isojax`), writing to this checkout's results file and runs folder.

`continue_command` spells that out for the one-line refusal; `reexec` (the runner's
`--at-recorded-commit [DIR]`) creates or reuses the worktree and replaces this process with the
worktree's runner, passing only options that runner knows (an older runner lacks the newer
ones: they are refused, not dropped), every path absolute, and `$ISOJAX_GLUE_DIR` set to this
checkout's data folder (a worktree elsewhere has no `../shared` beside it; `data_dir` is not
part of the config hash).

The recorded commit's tree has one of two layouts (`layout`): up to 369d7aa the runner is the
script `experiments/study.py` (run as `python WORKTREE/experiments/study.py GRID ...`); since,
the package `experiments/study/` (run as `python -m experiments.study GRID ...` from the
worktree, so that `-m` imports the worktree's package, not this checkout's).
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import sys


class CommitError(Exception):
    """The recorded commit cannot be used: one line for the user."""


def recorded_commit(records: list[dict], cells: set[str]) -> str | None:
    """The one commit the records of `cells` were made at; None if several, unknown or dirty."""
    rows = [r for r in records if r["cell"] in cells]
    commits = {r.get("git_commit") for r in rows}
    if len(commits) != 1 or any(r.get("git_dirty", True) for r in rows):
        return None
    commit = commits.pop()
    return commit if commit and commit != "unknown" else None


def default_worktree(repo: pathlib.Path, commit: str) -> pathlib.Path:
    """`<checkout>-at-<commit7>` beside the checkout (e.g. ../isojax-at-2e6b4fd)."""
    return repo.parent / f"{repo.name}-at-{commit[:7]}"


def _git(repo: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def ensure_worktree(repo: pathlib.Path, commit: str, where: pathlib.Path) -> pathlib.Path:
    """A clean checkout of `commit` at `where`: reused if it is one, else created with
    `git worktree add --detach`. Anything else at `where` is refused."""
    where = where.resolve()
    if where.exists() and any(where.iterdir()):
        head = _git(where, "rev-parse", "HEAD")
        if head.returncode != 0 or head.stdout.strip() != commit:
            found = head.stdout.strip()[:10] or "no git checkout"
            raise CommitError(f"{where} exists and is not a checkout of {commit[:10]} ({found})")
        # As `study.git_state` counts a record dirty: tracked changes outside the results.
        changed = _git(where, "status", "--porcelain", "--untracked-files=no", "--", ".",
                       ":!experiments/results")  # fmt: skip
        if changed.stdout.strip():
            raise CommitError(f"{where} has changes to tracked files: its records would be dirty")
        return where
    done = _git(repo, "worktree", "add", "--detach", str(where), commit)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise CommitError(f"git worktree add --detach {where} {commit[:10]} failed: {last}")
    return where


def _in_worktree(repo: pathlib.Path, path: pathlib.Path, worktree: pathlib.Path) -> pathlib.Path:
    """`path` (a file of this checkout) at the same place in `worktree`."""
    try:
        relative = path.resolve().relative_to(repo)
    except ValueError:
        raise CommitError(
            f"{path} is outside this checkout: the recorded commit's copy of it is unknown"
        ) from None
    return worktree / relative


FLAT = "flat"  # before the packages: the runner is the script experiments/study.py
PACKAGE = "package"  # experiments/study/: the runner is `python -m experiments.study`


def layout(tree: pathlib.Path) -> str:
    """Which runner a checkout has: `PACKAGE` (experiments/study/__main__.py) or `FLAT`
    (experiments/study.py, the layout up to 369d7aa). A checkout with neither is refused."""
    if (tree / "experiments" / "study" / "__main__.py").is_file():
        return PACKAGE
    if (tree / "experiments" / "study.py").is_file():
        return FLAT
    raise CommitError(f"{tree} has no study runner (experiments/study/ nor experiments/study.py)")


def runner_source(tree: pathlib.Path) -> str:
    """The text of a checkout's runner, searched for the flags it declares: experiments/study.py,
    or every module of experiments/study/."""
    if layout(tree) == FLAT:
        return (tree / "experiments" / "study.py").read_text()
    return "".join(f.read_text() for f in sorted((tree / "experiments" / "study").glob("*.py")))


def runner_argv(
    repo: pathlib.Path,
    worktree: pathlib.Path,
    grid_spec: str,
    options: list[tuple[str, object]],
    *,
    check: bool = True,
    kind: str | None = None,
) -> list[str]:
    """The worktree runner's command line: its interpreter (this one), its runner in the
    worktree's `layout` (or `kind`): `WORKTREE/experiments/study.py` (flat) or `-m
    experiments.study` (package; run from the worktree, as `reexec` does), the grid file's copy
    in the worktree, then `options` ((flag, value); value True: a bare flag; None or False: left
    out). With `check`, a flag the worktree's runner does not know is refused (its source is
    searched for the quoted flag, as argparse declares it)."""
    path, sep, arg = grid_spec.partition(":")
    grid = str(_in_worktree(repo, pathlib.Path(path), worktree)) + sep + arg
    kind = kind or layout(worktree)
    runner = (
        ["-m", "experiments.study"] if kind == PACKAGE else [str(worktree / "experiments/study.py")]
    )
    source = runner_source(worktree) if check else ""
    argv = [sys.executable, *runner, grid]
    for flag, value in options:
        if value is None or value is False:
            continue
        if check and f'"{flag}"' not in source:
            raise CommitError(f"the runner at {worktree} has no {flag}: run it without {flag}")
        argv += [flag] if value is True else [flag, str(value)]
    return argv


def tree_layout(repo: pathlib.Path, commit: str) -> str:
    """`layout` of `commit` read from git, without a worktree (for the refusal's command)."""
    found = _git(repo, "cat-file", "-e", f"{commit}:experiments/study/__main__.py")
    return PACKAGE if found.returncode == 0 else FLAT


def continue_command(
    repo: pathlib.Path, commit: str, grid_spec: str, options: list[tuple[str, object]]
) -> str:
    """The shell command that continues the study at `commit` (for the refusal's line): the
    worktree, then its runner in the layout `commit` has, run from the worktree."""
    where = default_worktree(repo, commit)
    kind = tree_layout(repo, commit)
    argv = [str(a) for a in runner_argv(repo, where, grid_spec, options, check=False, kind=kind)]
    argv[0] = "python"
    run = " ".join(shlex.quote(a) for a in argv)
    quoted = shlex.quote(str(where))
    return (
        f"git -C {shlex.quote(str(repo))} worktree add --detach {quoted} "
        f"{commit[:10]} && cd {quoted} && PYTHONPATH={quoted} {run}"
    )


def runner_env(worktree: pathlib.Path, glue_dir: str | None) -> dict[str, str]:
    """The environment of the worktree's runner: `PYTHONPATH` the worktree (its `isojax` and
    `experiments`, not this checkout's) and `$ISOJAX_GLUE_DIR` this checkout's data folder."""
    env = dict(os.environ, PYTHONPATH=str(worktree))
    if glue_dir and not env.get("ISOJAX_GLUE_DIR"):
        env["ISOJAX_GLUE_DIR"] = glue_dir
    return env


def reexec(argv: list[str], worktree: pathlib.Path, glue_dir: str | None) -> None:
    """Replaces this process with `argv` run in `worktree` against its code (never returns):
    from the worktree, so that `python -m experiments.study` finds the worktree's package
    first (`-m` puts the working directory before `PYTHONPATH`); every path in `argv` is
    absolute."""
    env = runner_env(worktree, glue_dir)
    print(f"study: continuing at {worktree} (PYTHONPATH={worktree}): {shlex.join(argv[1:])}",
          flush=True)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    os.chdir(worktree)
    os.execve(argv[0], argv, env)
