"""Study `istar_lambda`: I-STAR's weight lambda swept on MiniLM-L6 (SPEC.md §9, [I-STAR]: isotropy
is negatively correlated with the task metric; lambda < 0 helps), the shared recipe of
`study_recipe.py` with zeta 0.2.

    python -m experiments.study experiments/configs/study_istar_lambda.py --dry-run

lambda in {-5, -1, -0.5, -0.1, 0, 0.1, 0.5, 1, 5} x seeds 1-3: 27 runs per task, against the
papers' 7 x 5 = 35 per correlation. lambda = -5 collapsed MiniLM-L6 on STS-B at lr 1e-4 in a
pilot (issue 14), hence the values between the collapse and 0. Tier 1: STS-B (the paper's
strongest correlation). Tier 2: RTE, MRPC, CoLA. lambda = 0 (I-STAR's C0 pass, no penalty) is
the baseline of the paired differences.
"""

import ml_collections

from experiments.configs import study_recipe

WEIGHTS = [-5.0, -1.0, -0.5, -0.1, 0.0, 0.1, 0.5, 1.0, 5.0]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "istar_lambda"
    grid.base = study_recipe.set_fields(study_recipe.base_config(), {"istar.zeta": 0.2})

    def block(task: str) -> dict:
        return {"seed": [1, 2, 3], "task": [task], "method": ["istar"], "istar.weight": WEIGHTS}

    grid.tiers = ml_collections.ConfigDict(
        {"1": (block("stsb"),), "2": (block("rte"), block("mrpc"), block("cola"))}
    )
    grid.pretrained = True
    grid.baseline = (("istar.weight", 0.0),)
    grid.sweep = "istar.weight"
    return grid
