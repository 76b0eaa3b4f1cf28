"""The one place the loop asks "linen or NNX?": each front end builds its classifier, initialises
it, runs it in the jitted steps and gives its linen twin for export.

    front_end = front_ends.get(spec.state.front_end)        # LINEN or NNX
    model = front_end.build(encoder_config, num_labels, spec=spec.model, dropout_rate=0.1)
    params, batch_stats, rng = front_end.init(model, init_key, run_key, encoder_params, impl)
    apply = front_end.apply(model, policy, impl)             # `TrainState.apply_fn`

`LINEN` is `model.init` and `model.apply`, exactly as isojax always ran them. `NNX` runs NNX's
own code, as flax's `examples/gemma/train.py` does: its constructors and initialisers under an
`nnx.Rngs(params=init_key, dropout=run_key)`, pre-trained encoder weights put into its own tree
(by `isojax.nnx.pretrained.linen_path`, the rule the Hugging Face tables are written in); the
model is split once (`nnx.split`: a graph definition, held static in the train state, and
`nnx.State`s of `nnx.Param`, `nnx.BatchStat` and the dropout streams' `nnx.RngState`, in
NNX's own paths), and each step merges it (`nnx.merge`) inside the jitted function. Its dropout
draws from its own streams: their keys (stored as raw key data) and counters are train state,
so a run is a function of its seed and resumes bit for bit.

Both front ends' `Apply` take linen's calling convention (`apply(variables, *inputs,
deterministic=..., use_running_average=..., rngs=..., mutable=...)`) for evaluation and tools,
and the train step calls `train`, `step_rngs` and `micro_rngs`. A checkpoint of an NNX run
holds NNX's tree; one written by isojax 0.4.0 (its NNX runs were linen-shaped) is read through
`Apply.older_layouts` and converted by `linen_path`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from isojax import linen
from isojax import nnx as ijx
from isojax.linen import encoder as linen_encoder
from isojax.models import config as models_config
from isojax.nnx import export as nnx_export
from isojax.nnx import pretrained as nnx_pretrained
from isojax.training import precision

_STATES = (nnx.Param, nnx.BatchStat, nnx.RngState)


# ----------------------------------------------------------------------------------------------
# Linen: `model.init` and `model.apply`.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinenApply:
    """Linen's `module.apply` as the steps call it, its outputs cast by `policy`
    (`precision.OutputCast`; None: as the module returns them). Compares by value."""

    module: linen.SequenceClassifier
    policy: precision.Policy | None = None

    def __call__(self, variables, *args, **kwargs):
        if self.policy is None:
            return self.module.apply(variables, *args, **kwargs)
        return precision.OutputCast(self.module.apply, self.policy)(variables, *args, **kwargs)

    def step_rngs(self, rng: jax.Array, step: jax.Array, impl: str) -> dict:
        """`{'dropout': fold_in(run key, step)}` (the run key stored as raw key data)."""
        return {"dropout": jax.random.fold_in(jax.random.wrap_key_data(rng, impl=impl), step)}

    def micro_rngs(self, rngs: dict, i: jax.Array) -> dict:
        """Micro-batch `i`'s key: `fold_in(step key, i)`."""
        return {"dropout": jax.random.fold_in(rngs["dropout"], i)}

    def carry_rngs(self, rngs: dict, after) -> dict:
        """The step's key, whatever a micro-batch drew from it."""
        return rngs

    def next_rng(self, rng: jax.Array, rngs: dict) -> jax.Array:
        """`TrainState.rng` after the step: the run key, unchanged."""
        return rng

    def train(self, variables, rngs, *args, **kwargs):
        """`(output, new batch_stats, None)` in train mode (the run key is not state)."""
        out, updates = self(
            variables,
            *args,
            deterministic=False,
            use_running_average=False,
            rngs=rngs,
            mutable=["batch_stats"],
            **kwargs,
        )
        return out, updates.get("batch_stats", {}), None

    def to_linen(self, variables: Mapping) -> tuple[linen.SequenceClassifier, dict]:
        return self.module, dict(variables)

    def older_layouts(self, state) -> tuple:
        return ()


@dataclasses.dataclass(frozen=True)
class Linen:
    """The linen front end (`isojax.linen`)."""

    name: str = "linen"
    fresh_params: Callable = linen_encoder.fresh_params

    def build(self, enc: models_config.EncoderConfig, num_labels: int, *, spec, dropout_rate):
        policy = spec.policy
        return linen.SequenceClassifier(
            encoder=linen.Encoder(
                enc, dtype=policy.compute_dtype, param_dtype=policy.param_dtype, remat=spec.remat
            ),
            num_labels=num_labels,
            sentence=spec.sentence,
            normalizer=spec.normalizer,
            normalizer_kwargs=dict(spec.normalizer_kwargs),
            dropout_rate=float(dropout_rate),
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
        )

    def init(self, model, init_rng, run_rng, encoder_params, rng_impl: str):
        variables = linen.init_variables(model, init_rng, encoder_params)
        return variables["params"], variables.get("batch_stats", {}), run_rng

    def apply(self, model, policy: precision.Policy | None, rng_impl: str) -> LinenApply:
        return LinenApply(model, policy)


# ----------------------------------------------------------------------------------------------
# NNX: its own constructors, `nnx.split` once, `nnx.merge` in the step.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NnxEncoder:
    """What the NNX `Encoder` is built with (`config`, as the linen module's, for the tools)."""

    config: models_config.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    def clone(self, **changes) -> NnxEncoder:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class NnxClassifier:
    """The NNX classifier of a run, as built from `spec.model`: `make(rngs)` runs the
    constructors of `isojax.nnx.Encoder` and `SequenceClassifier`. Its fields are the ones the
    loop and the tools read of a classifier (`sentence`, `normalizer`, `dropout_rate`,
    `encoder.config`, ...); `clone` replaces some, as a linen module's does."""

    encoder: NnxEncoder
    num_labels: int
    sentence: str
    normalizer: str
    normalizer_kwargs: Mapping
    dropout_rate: float
    output_bias: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def clone(self, **changes) -> NnxClassifier:
        return dataclasses.replace(self, **changes)

    def make(self, rngs: nnx.Rngs) -> ijx.SequenceClassifier:
        enc = self.encoder
        encoder = ijx.Encoder(
            enc.config, dtype=enc.dtype, param_dtype=enc.param_dtype, remat=enc.remat, rngs=rngs
        )
        return ijx.SequenceClassifier(
            encoder,
            self.num_labels,
            sentence=self.sentence,
            normalizer=self.normalizer,
            normalizer_kwargs=dict(self.normalizer_kwargs),
            dropout_rate=self.dropout_rate,
            output_bias=self.output_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            rngs=rngs,
        )


def from_linen_tree(state: nnx.State, tree: Mapping, what: str = "variables") -> nnx.State:
    """`state` (NNX paths) with each value read from the linen-shaped `tree` at its
    `linen_path`; ValueError (one line) naming the first path `tree` lacks."""
    flat = traverse_util.flatten_dict(dict(tree))
    out = []
    for path, variable in nnx.to_flat_state(state):
        key = nnx_pretrained.linen_path(path)
        if key not in flat:
            raise ValueError(f"{what}: no {'/'.join(key)} for the NNX model's {path}")
        out.append((path, variable.replace(flat[key])))
    if len(out) != len(flat):
        extra = sorted(set(flat) - {nnx_pretrained.linen_path(p) for p, _ in out})
        raise ValueError(f"{what}: {'/'.join(extra[0])} has no place in the NNX model")
    return nnx.from_flat_state(out)


def to_linen_tree(state: nnx.State) -> dict:
    """The linen-shaped tree of `state`'s values, by `linen_path` (the inverse of
    `from_linen_tree`)."""
    flat = {nnx_pretrained.linen_path(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    return traverse_util.unflatten_dict(flat) if flat else {}


def _raw_keys(rngs: nnx.State) -> nnx.State:
    """The streams with each key as raw key data (what a checkpoint holds)."""
    return nnx.from_flat_state(
        [
            (p, v.replace(jax.random.key_data(v.get_value())) if isinstance(v, nnx.RngKey) else v)
            for p, v in nnx.to_flat_state(rngs)
        ]
    )


def _typed_keys(rngs: nnx.State, impl: str) -> nnx.State:
    """The streams with each raw key wrapped as a key of `impl` (what the modules draw from)."""
    return nnx.from_flat_state(
        [
            (p, v.replace(jax.random.wrap_key_data(v.get_value(), impl=impl)))
            if isinstance(v, nnx.RngKey)
            else (p, v)
            for p, v in nnx.to_flat_state(rngs)
        ]
    )


@dataclasses.dataclass(frozen=True)
class NnxApply:
    """The NNX classifier as the steps call it: `nnx.merge(graphdef, params, batch_stats,
    rngs)`, then the module's own `__call__`. Nothing of it is an array; compares by value.

    Attributes:
      graphdef: the classifier's `nnx.GraphDef` (`nnx.split` once, at build).
      streams: `(NNX path, tag)` of each dropout stream's key (`nnx.RngKey`); each has an
        `nnx.RngCount` beside it.
      policy: the outputs' cast (`precision.OutputCast`); None: as the module returns them.
      rng_impl: the key implementation of the streams' keys.
    """

    graphdef: Any
    streams: tuple
    policy: precision.Policy | None = None
    rng_impl: str = "threefry2x32"

    def streams_from_key(self, key: jax.Array) -> nnx.State:
        """Streams keyed by one key (raw key data): stream `p` gets `fold_in(key, crc32(p))`,
        its counter 0; a one-off call's `rngs={'dropout': key}`, and a 0.4.0 run's key."""
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key, impl=self.rng_impl)
        flat = []
        for path, tag in self.streams:
            salt = zlib.crc32("/".join(map(str, path)).encode()) & 0x7FFFFFFF
            stream_key = jax.random.key_data(jax.random.fold_in(key, salt))
            flat.append((path, nnx.RngKey(stream_key, tag=tag)))
            flat.append((path[:-1] + ("count",), nnx.RngCount(jnp.zeros([], jnp.uint32), tag=tag)))
        return nnx.from_flat_state(flat)

    def model(self, variables: Mapping, rngs: nnx.State | None = None) -> nnx.Module:
        """The classifier merged from `variables` (`params`, `batch_stats`) and raw `rngs`
        (None: placeholder streams, for calls that draw no dropout)."""
        if rngs is None:
            rngs = self.streams_from_key(jax.random.key(0, impl=self.rng_impl))
        states = (variables["params"], variables.get("batch_stats") or nnx.State({}), rngs)
        # Fresh Variables, of this trace (NNX refuses to update one made outside it).
        params, batch_stats, rngs = jax.tree.map(lambda x: x, states)
        return nnx.merge(self.graphdef, params, batch_stats, _typed_keys(rngs, self.rng_impl))

    def _cast(self, out):
        if self.policy is None:
            return out
        return precision.OutputCast(lambda o: o, self.policy)(out)

    def __call__(self, variables: Mapping, *args, rngs=None, mutable=False, **kwargs):
        """Linen's calling convention: `rngs` None (no dropout drawn), `{'dropout': key}`
        (`streams_from_key`) or the raw streams; `mutable` returns `{'batch_stats',
        'rngs'}` after the call, as NNX states."""
        if rngs is not None and not isinstance(rngs, nnx.State):
            rngs = self.streams_from_key(rngs["dropout"])
        model = self.model(variables, rngs)
        out = self._cast(model(*args, **kwargs))
        if not mutable:
            return out
        updates = {
            "batch_stats": nnx.state(model, nnx.BatchStat),
            "rngs": _raw_keys(nnx.state(model, nnx.RngState)),
        }
        return out, updates

    def step_rngs(self, rng: nnx.State, step: jax.Array, impl: str) -> nnx.State:
        """The model's own streams, as the previous step left them."""
        return rng

    def micro_rngs(self, rngs: nnx.State, i: jax.Array) -> nnx.State:
        return rngs  # each micro-batch advances the streams' counters

    def carry_rngs(self, rngs: nnx.State, after: nnx.State) -> nnx.State:
        """The streams as the call left them."""
        return after

    def next_rng(self, rng: nnx.State, rngs: nnx.State) -> nnx.State:
        """`TrainState.rng` after the step: the streams, moved on."""
        return rngs

    def train(self, variables, rngs, *args, **kwargs):
        """`(output, new batch_stats, the streams after the call)` in train mode."""
        out, updates = self(
            variables,
            *args,
            deterministic=False,
            use_running_average=False,
            rngs=rngs,
            mutable=True,
            **kwargs,
        )
        return out, updates["batch_stats"], updates["rngs"]

    def to_linen(self, variables: Mapping) -> tuple[linen.SequenceClassifier, dict]:
        """The linen twin with the same weights (`isojax.nnx.export.to_linen`): for export."""
        return nnx_export.to_linen(self.model(variables))

    def older_layouts(self, state) -> tuple:
        """`((abstract state, convert),)`: the train state as isojax 0.4.0 saved an NNX run
        (linen's tree, a raw run key) and the conversion of such a state to NNX's."""
        return (_older_layout(self, state),)


def _older_layout(apply: NnxApply, state) -> tuple[Any, Callable]:
    leaves = [x for x in jax.tree.leaves(state.params) if getattr(x, "sharding", None)]
    replicated = None
    if leaves:
        mesh = leaves[0].sharding.mesh
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def placed(tree):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), tree
        )

    params, batch_stats = to_linen_tree(state.params), to_linen_tree(state.batch_stats)
    opt_state = jax.eval_shape(state.tx.init, params)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=apply.rng_impl)))
    older = state.replace(
        params=placed(params),
        opt_state=placed(opt_state),
        batch_stats=placed(batch_stats),
        rng=placed(key),
    )
    structure = jax.tree.structure(params)

    def convert(saved):
        def one(x):
            if isinstance(x, Mapping) and jax.tree.structure(x) == structure:
                return from_linen_tree(state.params, x, "a 0.4.0 checkpoint's optimizer state")
            return x

        new = saved.replace(
            params=from_linen_tree(state.params, saved.params, "a 0.4.0 checkpoint's params"),
            opt_state=jax.tree.map(one, saved.opt_state, is_leaf=lambda x: isinstance(x, Mapping)),
            batch_stats=from_linen_tree(state.batch_stats, saved.batch_stats, "its batch_stats"),
            rng=apply.streams_from_key(saved.rng),
        )
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), state)
        if any(s is not None for s in jax.tree.leaves(shardings)):
            new = jax.device_put(new, shardings)
        return new

    return older, convert


@dataclasses.dataclass(frozen=True)
class Nnx:
    """The NNX front end (`isojax.nnx`)."""

    name: str = "nnx"
    fresh_params: Callable = nnx_pretrained.fresh_params

    def build(self, enc: models_config.EncoderConfig, num_labels: int, *, spec, dropout_rate):
        policy = spec.policy
        return NnxClassifier(
            encoder=NnxEncoder(enc, policy.compute_dtype, policy.param_dtype, spec.remat),
            num_labels=num_labels,
            sentence=spec.sentence,
            normalizer=spec.normalizer,
            normalizer_kwargs=dict(spec.normalizer_kwargs),
            dropout_rate=float(dropout_rate),
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
        )

    def init(self, model: NnxClassifier, init_rng, run_rng, encoder_params, rng_impl: str):
        """NNX's constructors under `nnx.Rngs(params=init_rng, dropout=run key)`; the
        pre-trained encoder weights (linen names, as the tables read them) put in its tree."""
        run_key = jax.random.wrap_key_data(run_rng, impl=rng_impl)
        net = model.make(nnx.Rngs(params=init_rng, dropout=run_key))
        _, params, batch_stats, rngs = nnx.split(net, *_STATES)
        if encoder_params is not None:
            params["encoder"] = from_linen_tree(
                nnx.State(params["encoder"]), encoder_params, "encoder_params"
            )
        return params, batch_stats, _raw_keys(rngs)

    def apply(self, model: NnxClassifier, policy, rng_impl: str) -> NnxApply:
        abstract = nnx.eval_shape(lambda: model.make(nnx.Rngs(params=0, dropout=0)))
        graphdef, _, _, rngs = nnx.split(abstract, *_STATES)
        streams = tuple(
            (p, v.get_metadata()["tag"])
            for p, v in nnx.to_flat_state(rngs)
            if isinstance(v, nnx.RngKey)
        )
        return NnxApply(graphdef, streams, policy, rng_impl)


LINEN = Linen()
NNX = Nnx()
FRONT_ENDS = {"linen": LINEN, "nnx": NNX}


def get(name: str) -> Linen | Nnx:
    """The front end named by `config.front_end` ("linen" or "nnx")."""
    if name not in FRONT_ENDS:
        raise ValueError(f"front_end must be one of {sorted(FRONT_ENDS)}, got {name!r}")
    return FRONT_ENDS[name]
