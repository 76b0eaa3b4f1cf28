"""Child processes of the end-to-end tests: an environment that imports this checkout, and a
bounded wait that never leaves a child behind."""

import os
import pathlib
import socket
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]

# XLA:CPU code generation for the tests and their children. The tests compile thousands of
# small programs and run each a few times, so compile time is most of the suite's time:
# unoptimised code, and the classic (not the MLIR fusion) emitters, each cut XLA's compile
# time by about 40 %. Neither uses fast math; results may differ from a production compile
# in the last bits, and every check compares with a tolerance or between two programs
# compiled alike.
XLA_CODEGEN = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def child_env(*, devices: int = 4, cache: os.PathLike | None = None, **extra: str) -> dict:
    """`os.environ` with this checkout first on PYTHONPATH, `devices` simulated CPU devices and
    the suite's XLA:CPU codegen (`XLA_CODEGEN`); the session's persistent compilation cache
    (tests/conftest.py, inherited: children reuse each other's and the tests' executables, the
    same programs giving bit-identical results), or with `cache` one there; `extra` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
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
