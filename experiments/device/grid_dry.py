"""Study `device_dry`: the tiny grid `run.sh go` runs instead of the study grids when
`ISOJAX_DEVICE_DRY=1`, to test the device procedure end to end on a CPU
(experiments/device/README.md).

A random 2-layer BERT ("tiny-bert") over the staged weights package's tokenizer (resolved by
name, so through the reassembled package on PYTHONPATH), 16 RTE rows of the staged GLUE folder
(`study_recipe.base_config()` reads `$ISOJAX_GLUE_DIR`), 2 epochs of 2 steps; TensorBoard on, so
the carried tensorboardX wheel is imported. Cells: the step-0 evaluation, none, isobn.
"""

import ml_collections

from experiments.configs import study_recipe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """The grid: name, base recipe, one tier of one block."""
    grid = ml_collections.ConfigDict()
    grid.name = "device_dry"
    base = study_recipe.set_fields(
        study_recipe.base_config(),
        {"model": "tiny-bert", "max_length": 32, "buckets": (), "batch_size": 8, "num_epochs": 2},
    )
    base.tokenizer = study_recipe.MODEL
    base.eval_batch_size = 8
    base.max_train_examples = base.max_eval_examples = 16
    base.progress = False
    grid.base = base
    grid.tiers = ml_collections.ConfigDict(
        {"1": ({"seed": [1], "task": ["rte"], "method": ["none", "isobn"]},)}
    )
    grid.pretrained = True
    grid.baseline = (("method", "none"),)
    grid.sweep = ""
    return grid
