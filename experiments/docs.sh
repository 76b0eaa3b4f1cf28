#!/usr/bin/env bash
# Build the documentation into docs/_build/html (git-ignored): the study findings page
# regenerated from experiments/results/*.jsonl, then Sphinx with every warning an error (a
# broken cross-reference, a docstring that does not parse, an API page that does not import).
#   bash experiments/docs.sh            # extra arguments go to sphinx-build
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! python -c "import sphinx, myst_parser, furo" 2>/dev/null; then
    source "$root/experiments/env.sh"   # the project's .venv, with the docs extra
fi
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
python -m experiments.report.findings > /dev/null
python -m sphinx -W --keep-going -q -b html "$@" docs docs/_build/html
echo "docs/_build/html/index.html"
