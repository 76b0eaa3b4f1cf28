"""Study `pilot`: the recipe check before the grids (issue 14 item 4): does `none` clearly learn
each task with the shared recipe (`study_recipe.py`: batch 32, max length 128, buckets
(32, 64, 96), AdamW, 10 % warm-up then linear decay, 3 epochs), at lr 1e-4 or 5e-5? One seed,
CoLA, MRPC, STS-B, RTE: 8 runs; dev is evaluated after epochs 1, 2 and 3 (the epoch-2 figures
are of a 3-epoch schedule, not of a 2-epoch run).

    python -m experiments.study experiments/configs/study_pilot.py --dry-run
"""

import ml_collections

from experiments.configs import study_recipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, tiers of axis blocks (each block a Cartesian product)."""
    grid = ml_collections.ConfigDict()
    grid.name = "pilot"
    grid.base = study_recipe.base_config()
    grid.tiers = ml_collections.ConfigDict(
        {
            "1": (
                {
                    "seed": [1],
                    "lr": [1e-4, 5e-5],
                    "task": list(study_recipe.TASKS),
                    "method": ["none"],
                },
            )
        }
    )
    grid.pretrained = True
    grid.baseline = (("lr", 5e-5),)  # paired differences: lr 1e-4 against 5e-5, per task
    grid.sweep = ""
    return grid
