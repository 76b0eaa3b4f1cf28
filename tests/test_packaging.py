"""What `pip install isojax` gives (issue 37): the core dependencies are jax, flax, optax and
numpy; the maths and both front ends import and run without any extra; what needs an extra
says which in one line; the version is the same in the package, pyproject.toml and the
changelog; the wheel ships `py.typed`."""

from __future__ import annotations

import email.parser
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib
import zipfile

import pytest
from children import XLA_CODEGEN

import isojax

REPO = pathlib.Path(__file__).resolve().parents[1]
CORE = {"jax", "flax", "optax", "numpy"}

# Every optional module isojax imports, made unimportable (`sys.modules[name] = None` makes
# `import name` raise ModuleNotFoundError, as an absent package does).
OPTIONAL = (
    "transformers",
    "tokenizers",
    "safetensors",
    "orbax",
    "orbax.checkpoint",
    "ml_collections",
    "matplotlib",
    "tensorboardX",
    "tensorflow",
    "tensorflow_datasets",
    "chex",
    "torch",
)
CACHE_VARIABLES = ("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE")
PRELUDE = f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"


def _run_without_extras(code: str, tmp_path) -> subprocess.CompletedProcess:
    """`code` after `PRELUDE` in a child that sees this checkout and nothing else installed
    on top, with the session's compilation cache and XLA:CPU codegen (tests/conftest.py; the
    child compiles what it runs once, not in every session; tests/site skips the cache's
    eviction scans, as in every child of the tests)."""
    cache = {k: v for k, v in os.environ.items() if k.startswith(CACHE_VARIABLES)}
    path = os.pathsep.join([str(REPO), str(REPO / "tests" / "site")])
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            "PYTHONPATH": path,
            "JAX_PLATFORMS": "cpu",
            "PATH": "/usr/bin:/bin",
            "XLA_FLAGS": XLA_CODEGEN,
            **cache,
        },  # fmt: skip
        timeout=300,
    )


CORE_RUN = f"""
import jax, jax.numpy as jnp
from flax import nnx
import isojax, isojax.linen, isojax.nnx, isojax.models, isojax.data
x = jax.random.normal(jax.random.key(0), (32, 8))
score = isojax.isoscore_star(x, c0=jnp.eye(8), zeta=0.2)
variables = isojax.linen.IsoBN().init(jax.random.key(1), x, use_running_average=True)
y, _ = isojax.linen.IsoBN().apply(variables, x, use_running_average=False,
                                   mutable=["batch_stats"])
norm = isojax.nnx.IsoBN(8, rngs=nnx.Rngs(0))
z = norm(x, use_running_average=False)
loaded = [m for m in {OPTIONAL!r} if sys.modules.get(m) is not None]
print("ok", float(score), y.shape, z.shape, loaded)
"""

# Each command in the same child (one interpreter start, not three), its exit status and what
# it wrote to file descriptor 2 (Python's and any library's) captured apart.
MISSING_EXTRA = [
    (["finetune", "--task", "rte", "--workdir", "runs/x"], "train"),
    (["export", "runs/x", "runs/hf"], "train"),
    (["analyze", "--task", "rte", "--out", "runs/a"], "train"),
]
CALLS = """
import json, os, tempfile
from isojax import cli
out = []
for argv in ARGV:
    with tempfile.TemporaryFile("w+") as err:
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(err.fileno(), 2)
        try:
            code = cli.main(argv)
        except SystemExit as stop:
            code = stop.code
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        out.append([code, err.read()])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory) -> tuple[list[str], str]:
    """One child without the extras (one interpreter start and JAX import, not two): the
    maths and both front ends run (`CORE_RUN`, its line first), then the commands of
    `MISSING_EXTRA` (`CALLS`, one JSON line). Its stdout lines and its stderr."""
    argvs = [argv for argv, _ in MISSING_EXTRA]
    code = CORE_RUN + f"ARGV = {argvs!r}\n" + CALLS
    done = _run_without_extras(code, tmp_path_factory.mktemp("no_extras"))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), done.stderr


def test_core_install_runs_the_maths_and_both_front_ends(without_extras):
    core = without_extras[0][0]
    assert core.startswith("ok ") and core.rstrip().endswith("[]"), core


def test_a_missing_extra_is_one_line_naming_it(without_extras):
    lines, stderr = without_extras
    assert not stderr, stderr
    results = json.loads(lines[1])
    for (argv, extra), (code, err) in zip(MISSING_EXTRA, results, strict=True):
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1, (argv, err)
        assert f"pip install 'isojax[{extra}]'" in lines[0], lines
        assert lines[0].startswith("isojax "), lines


def test_require_names_the_extra_of_a_module():
    from isojax import errors

    with pytest.raises(errors.ExtraMissing, match=r"pip install 'isojax\[plots\]'") as info:
        try:
            sys.modules["matplotlib"], saved = None, sys.modules.get("matplotlib")
            errors.require("matplotlib")
        finally:
            if saved is None:
                del sys.modules["matplotlib"]
            else:
                sys.modules["matplotlib"] = saved
    assert isinstance(info.value, errors.InputError) and info.value.extra == "plots"
    assert set(errors.EXTRAS.values()) <= _pyproject()["project"]["optional-dependencies"].keys()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()


def test_core_dependencies_are_jax_flax_optax_numpy():
    assert {_name(r) for r in _pyproject()["project"]["dependencies"]} == CORE


def test_version_agrees_in_package_pyproject_and_changelog():
    changelog = (REPO / "CHANGELOG.md").read_text()
    top = re.search(r"^## \[(?P<version>[^\]]+)\]", changelog, re.MULTILINE)
    assert top and top["version"] != "Unreleased", "the changelog's top entry is a release"
    assert isojax.__version__ == _pyproject()["project"]["version"] == top["version"]


@pytest.mark.e2e
def test_wheel_requires_only_the_core_and_ships_py_typed(tmp_path):
    src = tmp_path / "src"  # the files the wheel is built from, without build/ leftovers
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((REPO / name).read_bytes())
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src], check=True
    )
    wheel = next(dist.glob("isojax-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(metadata).decode())
    requires = meta.get_all("Requires-Dist") or []
    core = {_name(r) for r in requires if "extra ==" not in r}
    assert core == CORE, requires
    extras = set(meta.get_all("Provides-Extra") or [])
    assert {"hf", "train", "plots", "tfds", "test", "docs"} <= extras
    assert "isojax/py.typed" in names
    assert meta["Version"] == isojax.__version__
