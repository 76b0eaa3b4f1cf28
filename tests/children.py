"""Child processes of the end-to-end tests: an environment that imports this checkout, a
bounded wait that never leaves a child behind, and `isojax finetune` in a child with faults
injected from inside (`CHILD`, `start_child`) on the small run of `finetune_argv`."""

import importlib.abc
import importlib.machinery
import json
import os
import pathlib
import signal
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


# `isojax finetune` in a child process, with faults injected from inside (the audit's probes):
# CHILD_HOOKS (JSON) names them (`install_hooks`); the rest of argv is the command's.
#   signal_after_step [step, "SIGTERM"]   from the log hook, right after that training step
#   exit_after_step   step                os._exit(137) there (what a SIGKILL leaves)
#   signal_in_eval    "SIGINT"            during the first dev evaluation of this process
#   signal_in_c0      "SIGTERM"           during the first C0 pass of this process
#   signal_in_save    [step, "SIGTERM"]   while the first save of that step in checkpoints/ runs
#   signal_in_setup   "SIGTERM"           at the start of the build (data, model)
#   rank              "1"                 only the process of that JAX_PROCESS_ID is hooked
def install_hooks(hooks: dict, patch=setattr) -> None:
    """The fault `hooks` above on the isojax run of this process (each signal is sent to this
    process): `CHILD`'s, and the in-process stops of tests/e2e/test_preemption.py, which pass
    `monkeypatch.setattr` as `patch` so that the library's functions are put back after."""
    from isojax.training import checkpointing, evaluation, loop, reporting

    def send(name):
        os.kill(os.getpid(), getattr(signal, name))

    def once(name, call):
        def wrapper(*args, **kwargs):
            if not wrapper.done:
                wrapper.done = True
                send(name)
            return call(*args, **kwargs)

        wrapper.done = False
        return wrapper

    log_train = reporting.RunLog.train

    def train(self, step, epoch, means):
        log_train(self, step, epoch, means)
        if step == hooks.get("signal_after_step", [None])[0]:
            send(hooks["signal_after_step"][1])
        if step == hooks.get("exit_after_step"):
            os._exit(137)

    patch(reporting.RunLog, "train", train)
    for name, module, attr in (
        ("signal_in_eval", evaluation, "evaluate_all"),
        ("signal_in_c0", loop, "c0_pass"),
        ("signal_in_setup", loop, "build_run"),
    ):
        if name in hooks:
            patch(module, attr, once(hooks[name], getattr(module, attr)))
    if "signal_in_save" in hooks:
        save, (at, name) = checkpointing.Checkpointer.save, hooks["signal_in_save"]

        def signal_in_save(self, step, *args, **kwargs):
            if step == at and self.directory.name == "checkpoints" and not signal_in_save.done:
                signal_in_save.done = True
                send(name)
            save(self, step, *args, **kwargs)

        signal_in_save.done = False
        patch(checkpointing.Checkpointer, "save", signal_in_save)


CHILD = """
import json, os, sys
from isojax import cli
from tests.children import install_hooks

hooks = json.loads(os.environ.get("CHILD_HOOKS", "{}"))
if os.environ.get("JAX_PROCESS_ID", "0") == hooks.get("rank", "0"):
    install_hooks(hooks)
sys.exit(cli.main(sys.argv[1:]))
"""


def finetune_argv(workdir, glue_dir, tokenizer, *sets: str, normalizer: str = "isobn") -> list:
    """`isojax finetune` on tiny-bert over `sets` (`key=value`) on top of the small RTE run of
    the preemption tests: 48 rows, batches of 8 (6 steps an epoch), 2 epochs, no dropout."""
    base = (
        f"tokenizer={tokenizer}", "max_train_examples=48", "max_eval_examples=8",
        "batch_size=8", "eval_batch_size=8", "max_length=32", "buckets=()", "num_epochs=2",
        "log_every=1", "progress=False", "tensorboard=False", "dropout_rate=0.0",
        "optimizer.learning_rate=1e-3",
    )  # fmt: skip
    argv = ["finetune", "--task", "rte", "--normalizer", normalizer, "--model", "tiny-bert"]
    argv += ["--data-dir", str(glue_dir), "--workdir", str(workdir)]
    for item in (*base, *sets):
        argv += ["--set", item]
    return argv


def start_child(tmp_path, argv: list, hooks: dict | None = None, **env) -> subprocess.Popen:
    """`CHILD` (written into `tmp_path`) running `isojax` with `argv` and the fault `hooks`,
    one CPU device unless `env` says otherwise (`children.child_env`), the session's
    compilation cache (a per-test one made every test's first child compile all it ran);
    stdout and stderr piped (`children.finish` waits)."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {"devices": 1, **env}
    devices = env.pop("devices")
    return subprocess.Popen(
        [sys.executable, str(script), *map(str, argv)],
        env=child_env(devices=devices, CHILD_HOOKS=json.dumps(hooks or {}), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
