#!/usr/bin/env bash
# The test command: build or refresh .venv from the project's own files, lint, run the suite.
#   bash experiments/test.sh [--fast] [pytest args...]
# --fast leaves out the whole runs in subprocesses (tests/e2e/, marked e2e): -m "not e2e".
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/experiments/env.sh"
cd "$root"
ruff check isojax experiments tests
ruff format --check isojax experiments tests
args=()
for arg in "$@"; do
    if [[ "$arg" == "--fast" ]]; then
        args+=(-m "not e2e")
    else
        args+=("$arg")
    fi
done
# XLA's compiled programs persist in .cache/jax-tests (tests/conftest.py): a rerun skips the
# backend compile of every program that did not change. A clean clone (CI) starts empty; the
# folder is emptied once it passes 1 GiB.
export ISOJAX_TEST_JAX_CACHE="${ISOJAX_TEST_JAX_CACHE:-$root/.cache/jax-tests}"
if [[ -d "$ISOJAX_TEST_JAX_CACHE" ]] && (( $(du -sm "$ISOJAX_TEST_JAX_CACHE" | cut -f1) > 1024 )); then
    rm -rf "$ISOJAX_TEST_JAX_CACHE"
fi
mkdir -p "$ISOJAX_TEST_JAX_CACHE"
# Python's bytecode, and pytest's assert-rewritten test modules, are written (to the ignored
# __pycache__ folders) even where the shell sets PYTHONDONTWRITEBYTECODE: without them every
# worker, and every child a test starts, compiles isojax and rewrites ~120 test files again.
unset PYTHONDONTWRITEBYTECODE
# One pytest process per core, at most 4 (ISOJAX_TEST_WORKERS to choose; 0 runs in this process);
# each test file stays in one process, so a file's module-scoped fixtures are built once. The
# files go to the workers in the collection's order, which tests/conftest.py makes the longest
# first (by the seconds of the last session, in .pytest_cache), not xdist's most-tests first.
workers="${ISOJAX_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder ${args[@]+"${args[@]}"}
