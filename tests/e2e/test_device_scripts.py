"""Tests for experiments/device/{prepare,run}.sh on a small fake weights package: the largest
file is split into as many carry folders as the transfer limit needs (`split.py`, with the
working tree's size given) and reassembled byte for byte, every file checked against the
SHA-256 manifest; a damaged part or a missing one is refused; the GLUE staging copy holds the
four study tasks' train and dev files, and the recorded commit is HEAD; the weightless
accelerator check runs in one call (`run.sh bench`)."""

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
    """A tree that leaves a call room for a bit over 60 kB next to the last call's cargo:
    the 200,001-byte file goes in 4 parts, 4 calls, each under the limit."""
    pkg, big = _fake_package(tmp_path)
    dev = tmp_path / "dev"
    env = {
        "DEVICE_DIR": str(dev),
        "WEIGHTS_PKG": str(pkg),
        "GLUE_DIR": str(glue_dir),
        "PYTHON": sys.executable,
        "SKIP_WHEELS": "1",
    }
    done = _sh("prepare.sh", env=env)  # measure the last call's cargo
    assert done.returncode == 0, done.stderr
    du = ["du", "-sb", *(str(dev / d) for d in ("rest", "data", "wheels", "meta"))]
    rest = sum(int(line.split()[0]) for line in subprocess.check_output(du, text=True).splitlines())
    tree = 63 * 2**20 - rest - 60_000  # room of 60,000 bytes in the last call (as prepare.sh)
    done = _sh("prepare.sh", env=env | {"TREE_BYTES": str(tree)})
    assert done.returncode == 0, done.stderr
    parts = sorted(p for p in dev.glob("w*/part*") if p.suffix != ".sha256")
    assert [p.relative_to(dev).as_posix() for p in parts] == [f"w{k}/part{k}" for k in (1, 2, 3, 4)]
    assert [p.stat().st_size for p in parts] == [50_001, 50_001, 50_001, 49_998]
    assert b"".join(p.read_bytes() for p in parts) == big
    assert (dev / "rest" / "parts.txt").read_text().strip() == "4"
    for k in (1, 2, 3):
        assert f'run.sh stage {k}", carry=[".device/w{k}"]' in done.stdout
    assert 'go 9.5",' in done.stdout and '".device/w4", ".device/rest"' in done.stdout
    bench = 'bench: run(command="bash experiments/device/run.sh bench", timeout_s=420)'
    assert bench in done.stdout
    sent = [float(x) for x in re.findall(r"call \d sends ([0-9.]+) MiB", done.stdout)]
    assert len(sent) == 4 and max(sent) < 64
    rest = dev / "rest"
    assert (rest / "big.txt").read_text().strip() == "fake_weights/model/weights.safetensors"
    staged = sorted(p.relative_to(rest / "package") for p in rest.glob("package/**/*.*"))
    assert [str(p) for p in staged] == [
        "fake_weights/__init__.py",
        "fake_weights/model/config.json",
        "fake_weights/model/sub/pooling.json",
    ]
    assert len((dev / "rest" / "weights.sha256").read_text().splitlines()) == 4
    for task in TASKS:
        for split in ("train", "dev"):
            assert filecmp.cmp(dev / "data/glue" / task / f"{split}.tsv",
                               glue_dir / task / f"{split}.tsv", shallow=False)  # fmt: skip
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    assert f"ISOJAX_GIT_COMMIT={head.stdout.strip()}\n" in (dev / "meta/git.env").read_text()

    # The calls' checks, then the reassembly: every file as it was, the cache left out.
    for k in (1, 2, 3, 4):
        assert _sh("run.sh", "stage", str(k), env=env).returncode == 0
    site = tmp_path / "site_there"
    done = _sh("run.sh", "unpack", str(site), env=env)
    assert done.returncode == 0, done.stderr
    for path in pkg.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            assert filecmp.cmp(path, site / path.relative_to(pkg.parent), shallow=False)
    assert not (site / "fake_weights" / "__pycache__").exists()

    # One flipped byte in a part: refused, naming the package.
    damaged = bytearray(parts[1].read_bytes())
    damaged[12_345] ^= 1
    parts[1].write_bytes(bytes(damaged))
    done = _sh("run.sh", "unpack", str(tmp_path / "site_again"), env=env)
    assert done.returncode != 0 and "does not match its SHA-256" in done.stderr

    # A part gone (a machine that went cold between the calls): stage says so.
    (dev / "w3" / "part3").unlink()
    done = _sh("run.sh", "stage", "3", env=env)
    assert done.returncode == 1 and ".device/w3 missing or damaged" in done.stderr


def test_prepare_on_a_fresh_clone_stages_into_the_ignored_device_folder(tmp_path, glue_dir):
    """A fresh clone has no .device/, which `/.device/` (a folder-only pattern) does not match
    yet: prepare.sh still sees it ignored, stages there, and nothing staged is untracked; a
    clone whose .gitignore lacks the rule is refused."""
    pkg, _ = _fake_package(tmp_path)
    clone = tmp_path / "clone"
    (clone / "experiments" / "device").mkdir(parents=True)
    for script in ("prepare.sh", "split.py"):
        shutil.copy(REPO / "experiments/device" / script, clone / "experiments/device")
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
    assert (clone / ".device/w1/part1").is_file() and (clone / ".device/rest/parts.txt").is_file()
    status = subprocess.run(["git", "-C", str(clone), "status", "--porcelain"],
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert status.stdout == ""

    (clone / ".gitignore").write_text("runs/\n")
    shutil.rmtree(clone / ".device")
    done = prepare()
    assert done.returncode == 1 and ".device/ is not git-ignored here" in done.stderr


# What `go` runs of the accelerator check and bench, in the test below: a python that writes
# each call's arguments to $STAND_IN_LOG, proves that the check's module imports in go's
# environment, and prints the check's last line; any other command runs the real python. The
# check itself ran whole through the same `accel` function in the `bench` call just before.
_STAND_IN = """#!/usr/bin/env bash
case "$*" in
experiments/device/accel_check.py*|*experiments?bench?accelerator*)
    echo "$*" >>"$STAND_IN_LOG"
    "$REAL_PYTHON" -c "import experiments.device.accel_check" || exit 1
    echo "accel_check: done (stand-in)"
    exit 0 ;;
esac
exec "$REAL_PYTHON" "$@"
"""


def _the_dry_check_measured_every_arm(out: pathlib.Path) -> None:
    """The accelerator check's dry run, as `bench` left it in $OUT: its device line first, each
    model's isojax arms with their figures and the attention each layer kind got, the equality
    of `auto` against `xla` (exact on the CPU), the profile of one step, the last line."""
    lines = [x for x in (out / "accel.log").read_text().splitlines() if x]
    said = [x for x in lines if re.match(r"((device|torch|profile|accel_check):|tiny-\w+) ", x)]
    assert said[0].startswith("device: cpu (cpu), jax ") and lines[-1] == said[-1]
    assert said[-1].startswith("accel_check: done in ")
    for model, kinds in (("tiny-bert", "global xla"), ("tiny-modernbert", "global xla, local xla")):
        for arm in ("xla", "auto"):
            (line,) = [x for x in said if x.startswith(f"{model} 4x32 bf16 isojax {arm}: ")]
            assert re.search(r"[0-9.]+ ms/step, [0-9,]+ tokens/s, [0-9,]+ real tokens/s", line)
            assert "model-FLOPs MFU unknown (no peak for this device)" in line
            assert "peak memory " in line and f"attention {kinds};" in line
        (line,) = [x for x in said if x.startswith(f"{model} 4x32 bf16 equality auto vs xla")]
        assert line.count("0.00e+00") == 3 and ": PASS (cuDNN not measured here" in line
    top = (out / "profile_top15.txt").read_text().splitlines()
    assert top[0].startswith("profile: one isojax step, the 15 most expensive ops")
    assert 2 <= len(top) <= 16 and (out / "profile_trace.json.gz").stat().st_size > 0


@pytest.mark.slow
def test_dry_bench_and_go_run_the_accelerator_check(tmp_path, glue_dir):
    """`bench` (no weights staged at all) runs the accelerator check's dry run in one call,
    its figure lines in the output and the whole log and the profile in $OUT (every arm's
    figures, the equality and the profile checked there: the check's own dry-run test); `go` with a
    part gone runs the check then the bench only (exit 3, no grid), and BENCH=0 skips both.
    The `go` calls run the two through `_STAND_IN` (their arguments checked): the check's
    dry run is the bench call's, once."""
    out = tmp_path / "out"
    env = {"DEVICE_DIR": str(tmp_path / "nothing"), "PYTHON": sys.executable, "OUT": str(out),
           "ISOJAX_DEVICE_DRY": "1"}  # fmt: skip
    done = _sh("run.sh", "bench", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    said = done.stdout
    assert "accel_check.py exit 0 " in said
    for arm in ("isojax xla", "isojax auto", "torch sdpa"):
        assert re.search(rf"^tiny-bert 4x32 bf16 {arm}: [0-9.]+ ms/step, .* real tokens/s, "
                         "model-FLOPs MFU .* peak memory", said, re.M)  # fmt: skip
    assert re.search(r"^tiny-modernbert 4x32 bf16 equality auto vs xla: .* PASS", said, re.M)
    assert "accel_check: done" in (out / "accel.log").read_text()
    _the_dry_check_measured_every_arm(out)

    pkg, _ = _fake_package(tmp_path)
    dev = tmp_path / "dev"
    env |= {"DEVICE_DIR": str(dev), "WEIGHTS_PKG": str(pkg), "GLUE_DIR": str(glue_dir),
            "SKIP_WHEELS": "1"}  # fmt: skip
    assert _sh("prepare.sh", env=env).returncode == 0
    (dev / "w1" / "part1").unlink()
    shutil.rmtree(out)
    stand_in, calls = tmp_path / "python", tmp_path / "calls.txt"
    stand_in.write_text(_STAND_IN)
    stand_in.chmod(0o755)
    env |= {"PYTHON": str(stand_in), "REAL_PYTHON": sys.executable, "STAND_IN_LOG": str(calls)}
    done = _sh("run.sh", "go", "3", env=env | {"BENCH": "1", "BENCH_S": "1"})
    assert done.returncode == 3, done.stdout + done.stderr
    assert done.stdout.index("== accelerator check") < done.stdout.index("== accelerator bench")
    assert "accel_check.py exit 0 " in done.stdout
    assert "accel_check: done (stand-in)" in (out / "accel.log").read_text()
    check, bench = calls.read_text().splitlines()
    assert check == f"experiments/device/accel_check.py --dry --out {out} --budget-s 330"
    assert "accelerator" in bench and bench.endswith("--rounds 3")
    shutil.rmtree(out)
    calls.unlink()
    done = _sh("run.sh", "go", "3", env=env | {"BENCH": "0"})
    assert done.returncode == 3 and "== accelerator check" not in done.stdout
    assert not (out / "accel.log").exists() and not calls.exists()
