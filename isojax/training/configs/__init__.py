"""The papers' reference recipes as `get_config(arg)` files (big_vision's `configs/` layout).

    isojax finetune --config isobn --task rte --workdir runs/rte-isobn
    config = isojax.training.configs.load("istar")        # the same from Python

Each module's `get_config(arg=None)` returns a complete `isojax.training.config.default_config()`
with the
recipe's values; `arg` is unused by the presets here. Installed with the package, so a wheel has
them. Experiments' own recipes (shrunk to fit a machine) live in the repository's
`experiments/configs/`.
"""

import importlib

import ml_collections

PRESETS = ("isobn", "istar")


def reference_optimizer(
    config: ml_collections.ConfigDict, learning_rate: float, schedule: str, warmup_fraction: float
) -> None:
    """The papers' transformers AdamW in `config.optimizer`: eps 1e-6, no weight decay, no
    gradient clipping, with the given rate and schedule."""
    config.optimizer.update(
        dict(
            learning_rate=learning_rate,
            schedule=schedule,
            warmup_fraction=warmup_fraction,
            weight_decay=0.0,
            adam_eps=1e-6,
            clip_norm=None,
        )
    )


def load(name: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """`isojax.training.configs.<name>.get_config(arg)`; ValueError for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return importlib.import_module(f"isojax.training.configs.{name}").get_config(arg)
