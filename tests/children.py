"""Child processes of the end-to-end tests: an environment that imports this checkout, and a
bounded wait that never leaves a child behind."""

import importlib.abc
import importlib.machinery
import os
import pathlib
import socket
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# XLA:CPU code generation for the tests and their children. The tests compile thousands of
# small programs and run each a few times, so compile time is most of the suite's time:
# unoptimised code, and the classic (not the MLIR fusion) emitters, each cut XLA's compile
# time by about 40 %. Neither uses fast math; results may differ from a production compile
# in the last bits, and every check compares with a tolerance or between two programs
# compiled alike.
XLA_CODEGEN = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def skip_eviction_scans() -> None:
    """The suite's cache (a temporary folder, or .cache/jax-tests that experiments/test.sh
    empties past 1 GiB) has a 16 GiB limit that it never nears (about 85 MB after a whole
    session), yet jax's LRU cache lists, stats and reads the access time of every entry before
    each write, holding the lock that the other processes wait on: 0.38 s a write at the 3,000
    entries of a full session, a fifth of the suite's time. The test
    processes (tests/conftest.py) and their children (tests/site/sitecustomize.py) skip the
    scan; the lock around each read and write stays."""
    from jax._src import lru_cache

    _no_scans(lru_cache)


def _no_scans(lru_cache) -> None:
    if hasattr(lru_cache.LRUCache, "_evict_if_needed"):
        lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None


class SkipEvictionScansOnImport(importlib.abc.MetaPathFinder):
    """Runs `skip_eviction_scans` as soon as jax's cache module is imported, in a child that
    may never import jax (so its start-up does not pay for jax)."""

    def find_spec(self, name, path, target=None):
        if name != "jax._src.lru_cache":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _no_scans(module)

        spec.loader.exec_module = exec_module
        return spec


def child_env(*, devices: int = 4, cache: os.PathLike | None = None, **extra: str) -> dict:
    """`os.environ` with this checkout first on PYTHONPATH, `devices` simulated CPU devices and
    the suite's XLA:CPU codegen (`XLA_CODEGEN`); the session's persistent compilation cache
    (tests/conftest.py, inherited: children reuse each other's and the tests' executables, the
    same programs giving bit-identical results), or with `cache` one there; `extra` on top."""
    env = dict(os.environ)
    site = str(REPO / "tests" / "site")  # sitecustomize: skip_eviction_scans
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), site, env.get("PYTHONPATH", "")])
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {XLA_CODEGEN}"
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env | extra


def finish(child: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    """Waits for `child` at most `timeout` seconds (then kills it) and returns what it did."""
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        stdout, stderr = child.communicate()
    return subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the coordinator of a two-process run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
