#!/usr/bin/env bash
# The test command: build or refresh .venv from the project's own files, lint, run the suite.
#   bash experiments/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/experiments/env.sh"
cd "$root"
ruff check isojax experiments tests
ruff format --check isojax experiments tests
# One pytest process per core, at most 4 (ISOJAX_TEST_WORKERS to choose; 0 runs in this process);
# each test file stays in one process, so a file's module-scoped fixtures are built once.
workers="${ISOJAX_TEST_WORKERS:-$(python -c 'import os; print(min(4, len(os.sched_getaffinity(0))))')}"
python -m pytest -n "$workers" --dist loadfile "$@"
