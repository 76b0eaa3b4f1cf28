"""Child processes of the end-to-end tests: an environment that imports this checkout, and a
bounded wait that never leaves a child behind."""

import os
import pathlib
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[1]


def child_env(*, devices: int = 4, cache: os.PathLike | None = None, **extra: str) -> dict:
    """`os.environ` with this checkout first on PYTHONPATH, `devices` simulated CPU devices and
    the suite's unoptimised XLA:CPU codegen; with `cache`, a persistent compilation cache there
    (children given the same folder reuse each other's executables: the same programs give
    bit-identical results); `extra` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    )
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
