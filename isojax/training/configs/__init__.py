"""The papers' reference recipes as `get_config(arg)` files (big_vision's `configs/` layout), and
`load`, the one loader of a `get_config` file: the `isojax` command's `--config`, the
experiments' examples and the study's grid files read configs through it.

    isojax finetune --config isobn --task rte --workdir runs/rte-isobn
    config = isojax.training.configs.load("istar")        # the same from Python
    config = isojax.training.configs.load("experiments/configs/finetune.py:rte,istar")

Each preset module's `get_config(arg=None)` returns a complete
`isojax.training.config.default_config()` with the recipe's values; `arg` is unused by the
presets here. Installed with the package, so a wheel has them. Experiments' own recipes (shrunk
to fit a machine) live in the repository's `experiments/configs/`.
"""

import importlib
import importlib.util
import pathlib
import types

import ml_collections

from isojax.training.config import ConfigError

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


def load(
    spec: str, arg: str | None = None, *, what: str = "config file"
) -> ml_collections.ConfigDict:
    """`get_config(ARG)` of `spec`, `NAME[:ARG]` (a preset of `PRESETS`) or `path.py[:ARG]` (a
    Python file, loaded by path); without `:ARG`, `arg` (None: absent). Bad input is one line
    (`ConfigError`, an `isojax.errors.InputError`) naming the preset or file, and its line for a
    syntax error; `what` names a file in it ("grid file")."""
    name, sep, spec_arg = spec.partition(":")
    if sep:
        arg = spec_arg or None
    return get_config(find(name, what=what), arg, what=what)


def find(name: str, *, what: str = "config file") -> types.ModuleType:
    """The preset module `name`, or the Python file at path `name` loaded as a module (its
    imports run: a file importing `experiments.configs` needs the checkout's root importable)."""
    if name in PRESETS:
        return importlib.import_module(f"{__name__}.{name}")
    path = pathlib.Path(name)
    if not path.is_file():
        raise ConfigError(
            f"unknown preset {name!r} and no {what} of that name (presets: {', '.join(PRESETS)})"
        )
    module_spec = importlib.util.spec_from_file_location(f"_isojax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as err:  # the file's own line, not a traceback through importlib
        raise ConfigError(f"{what} {name}:{err.lineno}: {err.msg}") from None
    except Exception as err:  # an import or a name the file lacks: one line, naming the file
        raise ConfigError(f"{what} {name}: {type(err).__name__}: {err}") from None
    return module


def get_config(
    module: types.ModuleType, arg: str | None, *, what: str = "config file"
) -> ml_collections.ConfigDict:
    """`module.get_config(arg)`, checked: a ConfigDict; what goes wrong is one `ConfigError`."""
    where = f"{what} {getattr(module, '__file__', module.__name__)}"
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"{where} has no get_config(arg)")
    try:
        config = module.get_config(arg)
    except Exception as err:
        raise ConfigError(f"{where}: get_config raised {type(err).__name__}: {err}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"{where}: get_config() returned a {type(config).__name__}, not a ConfigDict"
        )
    return config
