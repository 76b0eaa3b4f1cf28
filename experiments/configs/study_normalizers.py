"""Study `normalizers`: none vs the sentence-vector normalisers on MiniLM-L6 (SPEC.md §9, [IsoBN]
and [EmbNorm] claims), the shared recipe of `study_recipe.py`.

    python -m experiments.study experiments/configs/study_normalizers.py --dry-run
    python -m experiments.study experiments/configs/study_normalizers.py --tier 2 \
        --budget-minutes 600

Tier 1: none, batchnorm, isobn x seeds 1-3 x CoLA, MRPC, STS-B, RTE (36 runs).
Tier 2: seeds 4-5 for none and isobn (the reference's 5 seeds), recenter and layernorm with
seeds 1-5 (56 runs): every normaliser arm but batchnorm at n = 5.
Tier 3: seeds 6-10 for none and isobn (40 runs): IsoBN, the first paper's headline claim, at
n = 10 (issue 48). Seeds vary slowest, so a grid stopped by its budget holds whole seeds.

The records were made at 2e6b4fd, whose runner and recipe a later tier continues with
(`--at-recorded-commit`); this file only lists cells, so the worktree runs it beside that
commit's own `study_recipe.py`.
"""

import ml_collections

from experiments.configs import study_recipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "normalizers"
    grid.base = study_recipe.base_config()
    tasks = list(study_recipe.TASKS)
    grid.tiers = ml_collections.ConfigDict(
        {
            "1": ({"seed": [1, 2, 3], "task": tasks, "method": ["none", "batchnorm", "isobn"]},),
            "2": (
                {"seed": [4, 5], "task": tasks, "method": ["none", "isobn"]},
                {"seed": [1, 2, 3], "task": tasks, "method": ["recenter", "layernorm"]},
                {"seed": [4, 5], "task": tasks, "method": ["recenter", "layernorm"]},
            ),
            "3": ({"seed": [6, 7, 8, 9, 10], "task": tasks, "method": ["none", "isobn"]},),
        }
    )
    grid.pretrained = True  # one step-0 evaluation per task: the pre-trained isotropy
    grid.baseline = (("method", "none"),)  # paired differences against this arm
    grid.sweep = ""  # no scalar axis to correlate with isotropy
    return grid
