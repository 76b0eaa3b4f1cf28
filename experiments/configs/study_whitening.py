"""Study `whitening`: none vs IsoBN vs running ZCA whitening (`whiten`, SPEC.md §10.1) in the
head of MiniLM-L6, the shared recipe of `study_recipe.py`.

    python -m experiments.study experiments/configs/study_whitening.py --dry-run
    python -m experiments.study experiments/configs/study_whitening.py --tier 2

Tier 1: none, isobn, whiten x seeds 1-3 x CoLA, MRPC, STS-B, RTE (36 runs). Tier 2: seeds 4-5
(24 runs). The hypotheses (issue 38), each under the study's rule with Holm over its family and
+0.010 as the effect size of interest, as for IsoBN: whiten lowers the head input's EV_3 more
than IsoBN; below none's; whiten improves fine-tuning over none; whiten vs IsoBN. IsoBN's gain
is diagonal and cannot undo a collapse that is not aligned with the axes; whitening can rotate.
A new study: it runs at the commit it was started from, from a worktree pinned there.
"""

import ml_collections

from experiments.configs import study_recipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "whitening"
    grid.base = study_recipe.base_config()
    tasks = list(study_recipe.TASKS)
    arms = ["none", "isobn", "whiten"]
    grid.tiers = ml_collections.ConfigDict(
        {
            "1": ({"seed": [1, 2, 3], "task": tasks, "method": arms},),
            "2": ({"seed": [4, 5], "task": tasks, "method": arms},),
        }
    )
    grid.pretrained = True  # one step-0 evaluation per task: the pre-trained isotropy
    grid.baseline = (("method", "none"),)
    grid.sweep = ""
    return grid
