"""Tests for experiments/device/{prepare,run}.sh on a small fake weights package: the largest
file is split in two carry folders and reassembled byte for byte, every file checked against
the SHA-256 manifest; a damaged half or a missing first half is refused; the GLUE staging copy
holds the four study tasks' train and dev files, and the recorded commit is HEAD."""

import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e

TASKS = ("CoLA", "MRPC", "RTE", "STS-B")


def _sh(script: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "experiments" / "device" / script), *args],
        env=os.environ | env,
        capture_output=True,
        text=True,
    )


def _fake_package(tmp_path) -> tuple[pathlib.Path, bytes]:
    """A small weights package: a few files and a 200 kB "weights" file (the one split)."""
    pkg = tmp_path / "site_here" / "fake_weights"
    (pkg / "model" / "sub").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    (pkg / "__init__.py").write_text('"""A fake weights package."""\n')
    (pkg / "model" / "config.json").write_text('{"hidden_size": 8}\n')
    (pkg / "model" / "sub" / "pooling.json").write_text("{}\n")
    (pkg / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"\0" * 64)
    big = np.random.default_rng(0).integers(0, 256, 200_001, dtype=np.uint8).tobytes()
    (pkg / "model" / "weights.safetensors").write_bytes(big)
    return pkg, big


def test_prepare_splits_and_run_reassembles_and_verifies(tmp_path, glue_dir):
    pkg, big = _fake_package(tmp_path)
    dev = tmp_path / "dev"
    env = {
        "DEVICE_DIR": str(dev),
        "WEIGHTS_PKG": str(pkg),
        "GLUE_DIR": str(glue_dir),
        "PYTHON": sys.executable,
        "SKIP_WHEELS": "1",
    }

    done = _sh("prepare.sh", env=env)
    assert done.returncode == 0, done.stderr
    assert "call 1: run(command=" in done.stdout and "call 2: run(command=" in done.stdout
    part1, part2 = (dev / "w1" / "part1").read_bytes(), (dev / "w2" / "part2").read_bytes()
    assert (len(part1), len(part2)) == (100_001, 100_000) and part1 + part2 == big
    assert (dev / "w2" / "big.txt").read_text().strip() == "fake_weights/model/weights.safetensors"
    staged = sorted(p.relative_to(dev / "w2" / "package") for p in dev.glob("w2/package/**/*.*"))
    assert [str(p) for p in staged] == [
        "fake_weights/__init__.py",
        "fake_weights/model/config.json",
        "fake_weights/model/sub/pooling.json",
    ]
    assert len((dev / "w2" / "weights.sha256").read_text().splitlines()) == 4
    for task in TASKS:
        for split in ("train", "dev"):
            assert filecmp.cmp(dev / "data/glue" / task / f"{split}.tsv",
                               glue_dir / task / f"{split}.tsv", shallow=False)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert f"ISOJAX_GIT_COMMIT={head.stdout.strip()}\n" in (dev / "meta/git.env").read_text()

    # Call 1's check, then the reassembly: every file as it was, the cache left out.
    assert _sh("run.sh", "stage", env=env).returncode == 0
    site = tmp_path / "site_there"
    done = _sh("run.sh", "unpack", str(site), env=env)
    assert done.returncode == 0, done.stderr
    for path in pkg.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert filecmp.cmp(path, site / path.relative_to(pkg.parent), shallow=False)
    assert not (site / "fake_weights" / "__pycache__").exists()

    # One flipped byte in the second half: refused, naming the package.
    damaged = bytearray(part2)
    damaged[12_345] ^= 1
    (dev / "w2" / "part2").write_bytes(bytes(damaged))
    done = _sh("run.sh", "unpack", str(tmp_path / "site_again"), env=env)
    assert done.returncode != 0 and "does not match its SHA-256" in done.stderr

    # The first half gone (a machine that went cold between the calls): stage says so.
    (dev / "w1" / "part1").unlink()
    done = _sh("run.sh", "stage", env=env)
    assert done.returncode == 1 and ".device/w1 missing or damaged" in done.stderr


def test_prepare_on_a_fresh_clone_stages_into_the_ignored_device_folder(tmp_path, glue_dir):
    """A fresh clone has no .device/, which `/.device/` (a folder-only pattern) does not match
    yet: prepare.sh still sees it ignored, stages there, and nothing staged is untracked; a
    clone whose .gitignore lacks the rule is refused."""
    pkg, _ = _fake_package(tmp_path)
    clone = tmp_path / "clone"
    (clone / "experiments" / "device").mkdir(parents=True)
    shutil.copy(REPO / "experiments/device/prepare.sh", clone / "experiments/device")
    shutil.copy(REPO / ".gitignore", clone / ".gitignore")
    names = ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL")
    git_env = os.environ | dict.fromkeys(names, "t")
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "fresh"]):
        subprocess.run(["git", "-C", str(clone), *args], check=True, env=git_env)
    assert not (clone / ".device").exists()
    env = {"WEIGHTS_PKG": str(pkg), "GLUE_DIR": str(glue_dir), "PYTHON": sys.executable,
           "SKIP_WHEELS": "1"}  # fmt: skip
    env = {**env, "DEVICE_DIR": ""}
    script = clone / "experiments/device/prepare.sh"

    def prepare():
        return subprocess.run(["bash", str(script)], env=os.environ | env, capture_output=True,
                              text=True)  # fmt: skip

    done = prepare()
    assert done.returncode == 0, done.stderr
    assert (clone / ".device/w1/part1").is_file() and (clone / ".device/w2/part2").is_file()
    status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert status.stdout == ""

    (clone / ".gitignore").write_text("runs/\n")
    shutil.rmtree(clone / ".device")
    done = prepare()
    assert done.returncode == 1 and ".device/ is not git-ignored here" in done.stderr


def test_dry_go_runs_the_attention_check_after_the_bench(tmp_path, glue_dir):
    """`go` in the dry run, the first half gone (the bench-only path, exit 3, no grid): after
    the accelerator bench (cut at BENCH_S) the attention check runs at its dry size and its
    figure lines reach the output, the whole log in $OUT/attention.log; BENCH=0 skips both."""
    pkg, _ = _fake_package(tmp_path)
    dev, out = tmp_path / "dev", tmp_path / "out"
    env = {"DEVICE_DIR": str(dev), "WEIGHTS_PKG": str(pkg), "GLUE_DIR": str(glue_dir),
           "PYTHON": sys.executable, "SKIP_WHEELS": "1"}  # fmt: skip
    assert _sh("prepare.sh", env=env).returncode == 0
    (dev / "w1" / "part1").unlink()
    env |= {"OUT": str(out), "ISOJAX_DEVICE_DRY": "1", "BENCH": "1", "BENCH_S": "1"}

    done = _sh("run.sh", "go", "3", env=env)
    assert done.returncode == 3, done.stdout + done.stderr
    said = done.stdout
    assert said.index("== accelerator bench") < said.index("== attention speed")
    assert "attention_speed.py exit 0 " in said
    where = "tiny 4x32 bfloat16 on cpu"
    for arm in ("fused", "einsum"):
        assert re.search(rf"^{where} {arm}: [0-9.]+ ms/step, .* real tokens/s, MFU", said, re.M)
    assert re.search(rf"^{where} fused/einsum: median [0-9.]+ over 1 rounds", said, re.M)
    figures = [x for x in said.splitlines() if x.startswith(where)]
    assert len(figures) == 3 and figures == (out / "attention.log").read_text().splitlines()[-3:]

    shutil.rmtree(out)
    done = _sh("run.sh", "go", "3", env=env | {"BENCH": "0"})
    assert done.returncode == 3 and "== attention speed" not in done.stdout
    assert not (out / "attention.log").exists()
