"""The fine-tuning loop on GLUE, for both front ends: config, build, steps, checkpoints, stops.

    from isojax import training
    config = training.configs.load("isobn")       # or training.default_config()
    config.task, config.data_dir = "rte", "glue_data"
    results = training.train_and_evaluate(config, "runs/rte-isobn")   # resumes if interrupted

The curated names: :func:`train_and_evaluate` and :func:`setup` (:mod:`~isojax.training.loop`),
:func:`default_config` and :func:`validate_config` (:mod:`~isojax.training.config`), the papers'
recipes :mod:`~isojax.training.configs`. The config is validated once, at that boundary; below
it every builder takes the part of its :class:`~isojax.training.specs.RunSpec` it reads
(:mod:`~isojax.training.specs`), not the config. The modules behind them stay importable
(``from isojax.training import steps``). ``import isojax`` does not import this package, and
this package imports the loop (orbax, tensorboardX) only when one of its names is first read,
so ``isojax.training.config`` alone stays light.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what `__getattr__` imports on first use, for type checkers and IDEs
    from isojax.training import configs
    from isojax.training.config import default_config, validate_config
    from isojax.training.loop import setup, train_and_evaluate

__all__ = ["configs", "default_config", "setup", "train_and_evaluate", "validate_config"]

_HOMES = {
    "configs": None,
    "default_config": "config",
    "validate_config": "config",
    "setup": "loop",
    "train_and_evaluate": "loop",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'isojax.training' has no attribute {name!r}")
    if _HOMES[name] is None:
        return importlib.import_module(f"{__name__}.{name}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
