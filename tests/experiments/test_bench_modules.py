"""The benchmarks are modules of `experiments.bench`, run as `python -m experiments.bench.NAME`
(0.6.0: `isojax bench` is gone): one that builds on another imports it, none sets its
environment between imports, and a CPU benchmark puts JAX on the CPU when it starts."""

import ast
import os
import subprocess
import sys

import pytest
from helpers import REPO

BENCH = REPO / "experiments" / "bench"
NAMES = sorted(path.stem for path in BENCH.glob("[!_]*.py"))


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_is_a_module_with_a_main(name):
    source = (BENCH / f"{name}.py").read_text()
    tree = ast.parse(source)
    assert "main" in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "noqa: E402" not in source and "spec_from_file_location" not in source
    first_code = next(
        node for node in tree.body[1:] if not isinstance(node, (ast.Import, ast.ImportFrom))
    )
    imports_after = [
        node.lineno
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno > first_code.lineno
    ]
    assert imports_after == [], f"{name}.py: imports after code at line {first_code.lineno}"


def test_the_benchmarks_that_build_on_train_speed_import_it():
    """`whiten_step` and `iternorm_cost` share `train_speed`'s one module object (a load by path
    made a second copy, `train_speed`, beside `experiments.bench.train_speed`)."""
    from experiments.bench import iternorm_cost, train_speed, whiten_step

    assert iternorm_cost.train_speed is train_speed is whiten_step.train_speed
    assert train_speed.__name__ == "experiments.bench.train_speed"


@pytest.mark.parametrize("told, platforms", [(None, "cpu"), ("cuda", "cuda")])
def test_a_cpu_benchmark_starts_on_the_cpu_unless_told(told, platforms):
    """`cpu_offline()`, after `import jax` and before any computation: JAX's platforms are
    `JAX_PLATFORMS`, else the CPU; the hub is offline."""
    code = (
        "import jax, os; from experiments.bench import cpu_offline; cpu_offline(); "
        "print(jax.config.jax_platforms, os.environ['HF_HUB_OFFLINE'])"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "HF_HUB_OFFLINE")}
    env |= {"JAX_PLATFORMS": told} if told else {}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.split() == [platforms, "1"], out.stderr


@pytest.mark.e2e  # a whole benchmark
def test_python_m_runs_one_benchmark_with_its_arguments(glue_dir):
    """`python -m experiments.bench.data_speed ARGS` from the checkout's root (a tiny setting)."""
    argv = ["--glue_dir", str(glue_dir), "--batch_size", "8", "--max_length", "32"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench.data_speed", *argv, "--repeats", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    table = out.stdout[out.stdout.index("task   max_len") :].splitlines()[1:]  # padding table
    rows = [line.split() for line in table if line.strip()]
    assert [(row[0], row[1]) for row in rows] == [
        ("mrpc", "128"), ("mrpc", "256"), ("cola", "128"), ("cola", "256")
    ], out.stdout  # fmt: skip
    assert all(0.0 < float(row[2]) < 1.0 for row in rows)  # padding fractions
