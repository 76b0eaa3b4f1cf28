#!/usr/bin/env bash
# The README's main job: all-MiniLM-L6-v2 fine-tuned on STS-B for one epoch with three methods
# (none, IsoBN, I-STAR with lambda -0.5), then a side-by-side table of the dev score (Pearson /
# Spearman mean) and the isotropy of the dev sentence vectors, of the classifier's input and of
# all-layer tokens, with the pre-trained encoder as the first row
# (experiments/configs/main_job.py: the reproduction study's recipe, one epoch).
#
# GLUE: $ISOJAX_GLUE_DIR, default ../shared/data/glue beside the repository; where that folder
# does not exist, tensorflow-datasets' prepared glue/stsb. Runs go to $ISOJAX_RUNS (default
# runs/main_job); running again resumes unfinished runs and reprints the table.
# Extra arguments go to experiments/examples/compare.py (e.g. --methods none,isobn,batchnorm).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/experiments/env.sh"
export ISOJAX_GLUE_DIR="${ISOJAX_GLUE_DIR:-$root/../shared/data/glue}"
cd "$root"
python -m experiments.examples.compare --config experiments/configs/main_job.py \
    --methods none,isobn,istar --workdir "${ISOJAX_RUNS:-$root/runs/main_job}" "$@"
