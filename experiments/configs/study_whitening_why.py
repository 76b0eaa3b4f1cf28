"""Study `whitening_why`: why running whitening (`whiten`, SPEC.md §10.1) breaks fine-tuning,
and whether whitening as the literature trains it (`iternorm`, §10.3) does (issue 47). The
shared recipe of `study_recipe.py`; each arm changes one thing (`study_recipe.VARIANTS`):

    python -m experiments.study experiments/configs/study_whitening_why.py --dry-run
    python -m experiments.study experiments/configs/study_whitening_why.py --tier 2
    python -m experiments.study experiments/configs/study_whitening_why.py --tier 3

| arm | what it isolates |
|---|---|
| none | the baseline, at this commit |
| whiten | the running ZCA, its defaults |
| iternorm | batch statistics, the gradient through them, full d, T = 5 |
| iternorm-sg | the same with the statistics detached: the gradient path alone |
| iternorm-g16 | groups of 16: dimension against batch size |
| whiten-nodrop | whiten with the head's dropout off: noise amplification |
| whiten-a05 | whiten with shrinkage α = 0.5 |

Tasks CoLA, MRPC, STS-B (RTE is at chance for every arm of the `whitening` study and decides
nothing). Tier 1: seeds 1-3 (63 runs); tier 2: seeds 4-5 (42 runs). Tier 3 (issue 62): `none`
and `iternorm` only, at honest power: seeds 6-10 on CoLA, MRPC, STS-B and RTE, seed-major so
that each finished seed is a whole cluster of the seed-clustered test, then seeds 1-5 on RTE
(50 runs; RTE's step-0 evaluation with them). The verdict families (Holm
within each, pooled over the three tasks): iternorm − iternorm-sg (the gradient path),
iternorm-g16 − iternorm (groups), whiten-nodrop − whiten (dropout noise), whiten-a05 − whiten
(shrinkage), iternorm − none ("equivalent within ±0.010" when the whole interval lies inside).
A new study: it runs at the commit it was started from, from a worktree pinned there.
"""

import ml_collections

from experiments.configs import study_recipe

ARMS = ["none", "whiten", "iternorm", "iternorm-sg", "iternorm-g16", "whiten-nodrop", "whiten-a05"]
TASKS = ["cola", "mrpc", "stsb"]
TIER3_ARMS = ["none", "iternorm"]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "whitening_why"
    grid.base = study_recipe.base_config()
    grid.tiers = ml_collections.ConfigDict(
        {
            "1": ({"seed": [1, 2, 3], "task": TASKS, "method": ARMS},),
            "2": ({"seed": [4, 5], "task": TASKS, "method": ARMS},),
            "3": (
                {"seed": [6, 7, 8, 9, 10], "task": [*TASKS, "rte"], "method": TIER3_ARMS},
                {"seed": [1, 2, 3, 4, 5], "task": ["rte"], "method": TIER3_ARMS},
            ),
        }
    )
    grid.pretrained = True  # one step-0 evaluation per task: the pre-trained geometry
    grid.baseline = (("method", "none"),)
    grid.sweep = ""
    return grid
