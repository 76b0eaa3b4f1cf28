"""Study `istar_zeta` (tier 2 only): I-STAR's shrinkage zeta swept at lambda = -1 on STS-B, seeds
1-3 (SPEC.md §9, [I-STAR]: the best zeta lies in [0.2, 0.8]; zeta = 0, plain IsoScore of the
batch as the penalty, hurts; zeta = 1 is slightly worse than the optimum). The shared recipe of
`study_recipe.py`.

    python -m experiments.study experiments/configs/study_istar_zeta.py --tier 2 --dry-run

zeta in {0, 0.2, 0.5, 0.8, 1} x seeds 1-3: 15 runs. lambda = -1: the strongest weight of the
`istar_lambda` grid that did not collapse MiniLM-L6 on STS-B (lambda = -5 did). zeta = 0.2 (the
reference code's default, and the `istar_lambda` grid's) is the baseline of the paired
differences. By SPEC.md §4, C_zeta = (1 - zeta) cov(X) + zeta C0 with C0 held fixed, so zeta = 1
gives the penalty no gradient: that arm trains as the un-penalised model does, and the paper's
"zeta = 1 is slightly worse" reads here as "the penalty at the best zeta helps". A new study: it
runs at the checkout's commit, not at the commit of the `istar_lambda` records, so its runs are
paired with each other only.
"""

import ml_collections

from experiments.configs import study_recipe

ZETAS = [0.0, 0.2, 0.5, 0.8, 1.0]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "istar_zeta"
    grid.base = study_recipe.set_fields(study_recipe.base_config(), {"istar.weight": -1.0})
    grid.tiers = ml_collections.ConfigDict(
        {"2": ({"seed": [1, 2, 3], "task": ["stsb"], "method": ["istar"], "istar.zeta": ZETAS},)}
    )
    grid.pretrained = False
    grid.baseline = (("istar.zeta", 0.2),)
    grid.sweep = "istar.zeta"
    return grid
