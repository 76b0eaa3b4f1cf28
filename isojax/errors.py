"""The base of the errors that bad input raises (a file, a `config.json`, a config field): the
message is one line naming the file and line, the key or the shape, and `isojax` prints it as
such with exit status 2, never a traceback. Imports nothing, so the command can catch it
without loading JAX.

    isojax.training.config.ConfigError      a field out of range; max_length above the
                                            model's positions; a batch larger than the data
    isojax.models.config.ModelNotLoadable   a model folder without config.json or weights, a
                                            size out of bounds, weights that do not fit
    isojax.data.tasks.GlueDataInvalid       a malformed GLUE TSV (file:line)
    isojax.errors.ExtraMissing              an optional dependency that is not installed

The core install (`pip install isojax`) is jax, flax, optax and numpy: the maths and both
front ends. The rest comes with the extras (`EXTRAS`); what needs one imports it inside its
functions, and `require` turns a missing one into one line naming the extra.
"""

from __future__ import annotations

import importlib.util

# The optional modules isojax imports, by the extra of pyproject.toml that installs them.
EXTRAS = {
    "transformers": "hf",
    "tokenizers": "hf",
    "safetensors": "hf",
    "orbax": "train",
    "ml_collections": "train",
    "tensorboardX": "train",
    "matplotlib": "plots",
    "tensorflow": "tfds",
    "tensorflow_datasets": "tfds",
}


class InputError(ValueError):
    """Bad input named in one line; `isojax` prints it with exit status 2."""


class ExtraMissing(InputError):
    """An optional dependency is not installed: one line naming the extra that installs it."""

    def __init__(self, module: str, extra: str):
        self.module, self.extra = module, extra
        super().__init__(
            f"{module} is not installed; it comes with the {extra!r} extra: "
            f"pip install 'isojax[{extra}]'"
        )


def require(*modules: str) -> None:
    """Raises `ExtraMissing` for the first of `modules` (under the top-level names of `EXTRAS`)
    that is not installed. It finds them without importing them: a module that a run turns
    off (tensorboardX, which imports torch where it is installed) costs nothing."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # its parent package is missing
            found = False
        if not found:
            raise ExtraMissing(module, EXTRAS[module.split(".")[0]])


def extra_missing(err: ImportError) -> ExtraMissing | None:
    """The `ExtraMissing` that an import error of an optional module stands for, else None."""
    name = (getattr(err, "name", None) or "").split(".")[0]
    return ExtraMissing(name, EXTRAS[name]) if name in EXTRAS else None
