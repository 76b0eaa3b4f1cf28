#!/usr/bin/env bash
# The test command: build or refresh .venv from the project's own files, lint, run the suite.
#   bash experiments/test.sh [pytest args...]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/experiments/env.sh"
cd "$root"
ruff check isojax experiments tests
ruff format --check isojax experiments tests
python -m pytest "$@"
