#!/usr/bin/env bash
# The README's main job: all-MiniLM-L6-v2 fine-tuned on RTE with and without IsoBN (one seed
# each, 2 epochs, max length 96), then a side-by-side table of the dev accuracy and the
# isotropy (EV_1, EV_3, IsoScore, mean cosine) of the dev sentence vectors, with the
# pre-trained encoder's numbers as the first row. About 12 minutes on 2 CPU cores (12 min 4 s
# measured, README).
#
# GLUE: $ISOJAX_GLUE_DIR, default ../shared/data/glue beside the repository; where that folder
# does not exist, tensorflow-datasets' prepared glue/rte. Runs go to $ISOJAX_RUNS (default
# runs/rte_isobn); running again resumes unfinished runs and reprints the table.
# Extra arguments go to experiments/compare.py (e.g. --methods none,isobn,batchnorm).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/experiments/env.sh"
export ISOJAX_GLUE_DIR="${ISOJAX_GLUE_DIR:-$root/../shared/data/glue}"
cd "$root"
python experiments/compare.py --config experiments/configs/rte_isobn.py --methods none,isobn \
    --workdir "${ISOJAX_RUNS:-$root/runs/rte_isobn}" "$@"
