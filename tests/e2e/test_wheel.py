"""The installed package: a wheel built from the repository and installed away from it."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e


def test_wheel_without_the_source_tree_runs_a_packaged_preset(tmp_path):
    """A wheel built from the repository, installed away from it, carries the presets: `isojax
    finetune --config isobn --print-config` works; `isojax bench` (gone: 0.6.0) is refused."""
    src = tmp_path / "src"  # the files the wheel is built from, without build/ leftovers
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "isojax", src / "isojax", ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    dist, site = tmp_path / "dist", tmp_path / "site"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], check=True
    )
    wheel = next(dist.glob("isojax-*.whl"))
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", site, wheel], check=True
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def run_installed(*argv):
        return subprocess.run(argv, cwd=elsewhere, env=env, capture_output=True, text=True)

    where = run_installed(sys.executable, "-c", "import isojax; print(isojax.__file__)")
    assert where.stdout.strip().startswith(str(site)), where
    script = str(site / "bin" / "isojax")
    out = run_installed(
        script, "finetune", "--config", "isobn", "--workdir", "run", "--print-config"
    )
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert (config["normalizer"], config["optimizer"]["learning_rate"]) == ("isobn", 5e-5)
    bench = run_installed(script, "bench")
    assert bench.returncode == 2 and len(bench.stderr.strip().splitlines()) == 1, bench.stderr
    assert "invalid choice: 'bench'" in bench.stderr
