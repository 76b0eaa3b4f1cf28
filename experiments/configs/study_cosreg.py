"""Study `cosreg` (tier 2 only): CosReg with lambda = -1, 0, +1 on STS-B, seeds 1-3 (SPEC.md §9:
CosReg leaves isotropy alone but moves the mean of one outlier dimension, swinging the mean
cosine between about 0.003 and 0.998). The shared recipe of `study_recipe.py`; lambda = 0 is
the baseline (the plain task loss).

    python -m experiments.study experiments/configs/study_cosreg.py --tier 2 --dry-run
"""

import ml_collections

from experiments.configs import study_recipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "cosreg"
    grid.base = study_recipe.base_config()
    grid.tiers = ml_collections.ConfigDict(
        {
            "2": (
                {
                    "seed": [1, 2, 3],
                    "task": ["stsb"],
                    "method": ["cosreg"],
                    "cosreg.weight": [-1.0, 0.0, 1.0],
                },
            )
        }
    )
    grid.pretrained = True
    grid.baseline = (("cosreg.weight", 0.0),)
    grid.sweep = "cosreg.weight"
    return grid
