"""The child processes' environment (tests/children.py): the suite's XLA codegen, and the
compilation cache without jax's eviction scans, installed only once a child imports jax."""

import subprocess
import sys

import pytest
from children import XLA_CODEGEN, child_env

pytestmark = pytest.mark.e2e

_PROBE = """
import os, sys
print("jax" in sys.modules)
from jax._src import lru_cache
print(lru_cache.LRUCache._evict_if_needed.__name__)
print(os.environ["XLA_FLAGS"])
"""


def _probe(env: dict) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_child_skips_the_eviction_scans_once_it_imports_jax():
    env = child_env(devices=2)
    assert _probe(env) == [
        "False",
        "<lambda>",
        f"--xla_force_host_platform_device_count=2 {XLA_CODEGEN}",
    ]
    # Without tests/site on the path (the sitecustomize), jax's own scan is in place.
    env["PYTHONPATH"] = env["PYTHONPATH"].replace("tests/site", "tests/no-site")
    assert _probe(env)[:2] == ["False", "_evict_if_needed"]
