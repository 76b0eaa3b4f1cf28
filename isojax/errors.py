"""The base of the errors that bad input raises (a file, a `config.json`, a config field): the
message is one line naming the file and line, the key or the shape, and `isojax` prints it as
such with exit status 2, never a traceback. Imports nothing, so the command can catch it
without loading JAX.

    isojax.training.config.ConfigError               a field out of range; max_length above the
    model's
                                            positions; a batch larger than the data
    isojax.models.config.ModelNotLoadable   a model folder without config.json or weights, a
                                            size out of bounds, weights that do not fit
    isojax.data.tasks.GlueDataInvalid       a malformed GLUE TSV (file:line)
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input named in one line; `isojax` prints it with exit status 2."""
