"""The fine-tuning configuration: its fields and defaults (declared by the specs), and their
validation.

    config = isojax.training.config.default_config()       # or
    isojax.training.configs.isobn.get_config()
    config.task, config.data_dir, config.normalizer = "rte", "glue_data", "isobn"
    isojax.training.config.validate_config(config)        # one-line ValueError naming the bad field

Each field is declared once, as a field of the spec that reads it (`isojax.training.specs`: its
name, default, type and doc); `default_config` is read off those declarations. A field that
may be absent is `None` (no 0 or -1 sentinels). The reference recipes of the
papers are `get_config()` files in `isojax.training.configs` (big_vision's layout), so an installed
isojax carries them: `isojax finetune --config isobn`. Each value is checked by the module that
owns it (`optim`, `norms`, `stabilizer`, `precision`, `glue`); `validate_config` only adds the
field's path to that module's message, and raises `ConfigError` (a `ValueError`), which
`isojax finetune` prints as one line with exit status 2. A field with a value by default may
not be None (except `optimizer.clip_norm`, None: no clipping, and `max_nonfinite_steps`,
None: never stop). `normalizer_kwargs` is the one
open field: its keys are the normaliser's hyper-parameters (`--set
normalizer_kwargs.epsilon=1e-5`), each typed and checked by its row of `normalizers.schema`
(`normalizers.check_hparams`); every other field must have its default's type. That a
`group_size` divides the model's hidden size is checked from the model's config.json before any
weights are read (`build.check_head_width`).
"""

from __future__ import annotations

import math
import numbers
import os
import pathlib
from collections.abc import Callable

import ml_collections

from isojax import errors
from isojax.core import istar, normalizers, penalties
from isojax.data import batching, tasks
from isojax.models import heads
from isojax.models.config import ATTENTION_BACKENDS
from isojax.training import optim, precision, schema, specs, throughput

# `config.normalizer` is one of `normalizers.NORMALIZERS` (the head's normaliser: none recenter
# batchnorm layernorm isobn ...); `config.penalty` one of `penalties.PENALTIES` (a token loss
# term). The two combine: IsoBN in the head with I-STAR on the tokens is normalizer "isobn",
# penalty "istar".
PENALTIES = penalties.PENALTIES
RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
LOSS_SCALES = ("auto", "dynamic", "none")
TINY_MODEL = "tiny-bert"
# Which front end's modules run the classifier in the loop: the linen `isojax.models` ones, or
# the `isojax.nnx` ones (`isojax.training.front_ends`); the rest of the run is one.
FRONT_ENDS = ("linen", "nnx")
# Dict fields whose keys are not fixed by `default_config` (empty there): their owner checks the
# keys (`normalizers.check_hparams`), and `--set FIELD.KEY=VALUE` may add one.
OPEN_FIELDS = tuple(d.path for d in schema.declarations(specs.RunSpec) if d.open)
# Normaliser fields the classifier head sets itself (from the policy and the mesh): not
# hyper-parameters, so not `normalizer_kwargs` keys.
HEAD_SETS = ("dtype", "param_dtype", "axis_name", "name", "parent", "use_running_average")
# Fields with a value by default that accept None too (their spec's annotation admits None:
# `optimizer.clip_norm` None: clipping off; `max_nonfinite_steps` None: never stop).
NULLABLE = tuple(
    d.path for d in schema.declarations(specs.RunSpec) if d.nullable and d.default is not None
)
# `jax.random.key(seed)` takes 32 bits: 2**32 would draw seed 0's keys again; numpy's
# `default_rng((seed, epoch))` refuses negative seeds.
MAX_SEED = 2**32 - 1


class ConfigError(errors.InputError):
    """A configuration that cannot run: one line naming the field (`isojax finetune`: exit
    status 2). Raised by `validate_config`, and by the build for checks that need the model or
    the data (`max_length` above the model's positions, a batch larger than the data)."""


# Fields renamed (old path -> new path), read under the new path from a run folder's
# `config.json` and a checkpoint's stamp (`translate`); a config or `--set` that names an old
# path is refused with the new one. "preset" and "method" name no path (a field removed, a
# field split in two): the value is the advice shown.
RENAMED = {
    "istar.stabilizer": "istar.stabilizer.kind",  # a string before the section
    "istar.stabilizer_tokens": "istar.stabilizer.tokens",
    "istar.stabilizer_window": "istar.stabilizer.window",
    "istar.stabilizer_window_unit": "istar.stabilizer.unit",
    "istar.stabilizer_momentum": "istar.stabilizer.momentum",
    "istar.stabilizer_debias": "istar.stabilizer.debias",
    "preset": "--config isobn|istar (the presets are config files in isojax/configs)",
    "method": "two fields: normalizer (none recenter batchnorm layernorm isobn ...) and penalty "
    "(none istar cosreg); flags --normalizer NAME --penalty NAME",
}


def default_config() -> ml_collections.ConfigDict:
    """Every field of a fine-tuning run, with its default (override, then `validate_config`),
    read off the specs that declare them (`specs.RunSpec`, `schema.tree`): each field's
    default, type and doc are its spec's."""
    return schema.tree(specs.RunSpec)


def translate(flat: dict) -> dict:
    """A flattened config (a run folder's `config.json`, a checkpoint's stamp) with each
    renamed path (`RENAMED`) under its new one; a field `RENAMED` names no path for (a field
    split or removed) is kept, for the caller to refuse."""
    known = flatten(default_config().to_dict())
    return {(RENAMED[k] if RENAMED.get(k) in known else k): v for k, v in flat.items()}


flatten = schema.flatten


def default_glue_dir() -> str | None:
    """`$ISOJAX_GLUE_DIR`, else `../shared/data/glue` beside a source checkout, when the folder
    exists; None (tensorflow-datasets) otherwise. The experiments' configs use it."""
    checkout = pathlib.Path(__file__).resolve().parents[2]
    path = os.environ.get("ISOJAX_GLUE_DIR") or str(checkout.parent / "shared" / "data" / "glue")
    return path if pathlib.Path(path).is_dir() else None


normalizer_of = specs.normalizer_of


def _owned(field: str, check, *args, **kwargs) -> None:
    """Runs an owning module's check; its ValueError comes back prefixed with `field`."""
    try:
        check(*args, **kwargs)
    except ValueError as err:
        raise ConfigError(f"config: {field}: {err}") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"config: {message}")


def _lookup(config: ml_collections.ConfigDict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ConfigError(f"config: field {key!r} is missing")
        node = node[part]
    return node


def _check_present(config: ml_collections.ConfigDict) -> None:
    """Every field with a value by default has one (not None), unless it is `NULLABLE`."""
    for key, default in flatten(default_config().to_dict()).items():
        if default is not None and key not in NULLABLE and _lookup(config, key) is None:
            raise ConfigError(f"config: {key} must be set (its default is {default!r}), got None")


def _check_known(config: ml_collections.ConfigDict) -> None:
    """Every field of `config` is one of `default_config`'s (or a key of an open field); a
    renamed one names its new spelling (`RENAMED`)."""
    known = flatten(default_config().to_dict())
    for key in flatten(config.to_dict()):
        if key in known or key.partition(".")[0] in OPEN_FIELDS:
            continue
        if key in RENAMED:
            raise ConfigError(f"config: field {key!r} was renamed: use {RENAMED[key]}")
        raise ConfigError(f"config: unknown field {key!r}")


def _kind(default) -> tuple[str, Callable[[object], bool]]:
    """The type of a field with this default: its name and its test (an int is a float; a
    bool is neither a number nor a string)."""
    if isinstance(default, bool):
        return "True or False", lambda v: isinstance(v, bool)
    if isinstance(default, int):
        return "an integer", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool)
    if isinstance(default, float):
        return "a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
    if isinstance(default, (tuple, list)):
        return "a tuple", lambda v: isinstance(v, (tuple, list))
    return type(default).__name__, lambda v: isinstance(v, type(default))


def _check_types(config: ml_collections.ConfigDict) -> None:
    """Every set field has its default's type: the typed schema of the fixed fields, the
    penalties' sections (`istar`, `cosreg`) and IsoBN's included (a whole section replaced by a
    `ConfigDict` of other types bypasses ConfigDict's own check). The normaliser's open
    `normalizer_kwargs` are typed by its row of `normalizers.schema` (`check_hparams`)."""
    for key, default in flatten(default_config().to_dict()).items():
        value = _lookup(config, key)
        if default is None or value is None or isinstance(default, dict):
            continue
        kind, test = _kind(default)
        _check(test(value), f"{key} must be {kind}, got {value!r}")


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises `ConfigError` (a ValueError) with one line naming the first bad field of
    `config`."""
    _check_known(config)
    _check_present(config)
    _check_types(config)
    _check_objective(config)
    _check_loop(config)
    _check_numerics(config)


def _check_objective(config: ml_collections.ConfigDict) -> None:
    """The task, the normaliser, the penalty and their hyper-parameters."""
    _owned("task", tasks.get_task, config.task)
    _check(
        config.front_end in FRONT_ENDS,
        f"front_end must be one of {FRONT_ENDS}, got {config.front_end!r}",
    )
    names = normalizers.NORMALIZERS
    _check(config.normalizer in names, f"unknown normalizer {config.normalizer!r}; known: {names}")
    _check(config.penalty in PENALTIES, f"unknown penalty {config.penalty!r}; known: {PENALTIES}")
    _check(
        config.sentence in heads.SENTENCE_VECTORS,
        f"sentence must be one of {heads.SENTENCE_VECTORS}, got {config.sentence!r}",
    )
    _owned("isobn", normalizers.check_hparams, "isobn", front="config", **config.isobn.to_dict())
    reserved = sorted(set(config.normalizer_kwargs) & set(HEAD_SETS))
    _check(not reserved, f"normalizer_kwargs: {reserved} are set by the classifier head")
    normalizer, kwargs = normalizer_of(config)
    _owned("normalizer_kwargs", normalizers.check_hparams, normalizer, front="config", **kwargs)
    _owned("istar.zeta", istar.check_zeta, config.istar.zeta)
    s = config.istar.stabilizer
    window = s.window if s.window is not None else (s.tokens if s.unit == "tokens" else 1)
    _owned(
        "istar.stabilizer",
        istar.check_hparams,
        kind=s.kind,
        window=window,
        window_unit=s.unit,
        momentum=s.momentum,
    )
    _check(s.tokens >= 2, f"istar.stabilizer.tokens must be >= 2, got {s.tokens}")
    _check(
        math.isfinite(config.istar.weight) and math.isfinite(config.cosreg.weight),
        "istar.weight and cosreg.weight must be finite",
    )


def _check_loop(config: ml_collections.ConfigDict) -> None:
    """The optimizer, batch sizes, counts and limits of the loop, lengths and buckets."""
    _owned("optimizer", optim.OptimSpec, **config.optimizer.to_dict())
    for name in ("batch_size", "eval_batch_size", "num_epochs", "log_every", "keep_checkpoints"):
        _check(int(config[name]) >= 1, f"{name} must be >= 1, got {config[name]}")
    _check(
        isinstance(config.seed, int) and 0 <= config.seed <= MAX_SEED,
        f"seed must be an integer in [0, 2**32 - 1], got {config.seed}",
    )
    _check(
        config.peak_flops is None or config.peak_flops > 0,
        f"peak_flops must be None or > 0, got {config.peak_flops}",
    )
    _owned("profile_steps", throughput.check_steps, config.profile_steps)
    k = config.grad_accum_steps
    _check(
        int(k) >= 1 and config.batch_size % k == 0,
        f"grad_accum_steps {k} must be >= 1 and divide batch_size {config.batch_size}",
    )
    _check_micro_batch(config)
    for name in (
        "max_steps",
        "checkpoint_every",
        "max_train_examples",
        "max_eval_examples",
        "max_nonfinite_steps",
    ):
        value = config[name]
        _check(value is None or value >= 1, f"{name} must be None or >= 1, got {value}")
    shortest = batching.MIN_LENGTH
    _check(
        config.max_length >= shortest, f"max_length must be >= {shortest}, got {config.max_length}"
    )
    _check(all(int(b) >= 1 for b in config.buckets), f"buckets must be positive: {config.buckets}")
    _check(
        not (config.packing and config.row_buckets) or all(int(r) >= 1 for r in config.row_buckets),
        f"row_buckets must be positive row counts: {config.row_buckets}",
    )


def _check_micro_batch(config: ml_collections.ConfigDict) -> None:
    """A micro-batch of at least the normaliser's `normalizers.MIN_ROWS` rows: fewer, and every
    batch is skipped (its statistics unusable: a constant output, no running update)."""
    micro, least = config.batch_size // config.grad_accum_steps, normalizers.MIN_ROWS
    need = least[config.normalizer]
    _check(
        micro >= need,
        f"batch_size / grad_accum_steps = {config.batch_size} / {config.grad_accum_steps} = "
        f"{micro} row(s) per micro-batch, fewer than the {need} that normalizer "
        f"{config.normalizer!r} needs: raise batch_size or lower grad_accum_steps",
    )


def _check_numerics(config: ml_collections.ConfigDict) -> None:
    """Packing against the penalties, dropout, loss scaling, rng, precision, the tiny model."""
    penalty = {"istar": config.istar, "cosreg": config.cosreg}.get(config.penalty)
    _check(
        not (config.packing and penalty is not None and penalty.include_padding),
        f"packing leaves no padding positions, so {config.penalty}.include_padding (reference "
        "parity) needs packing False",
    )
    _check(
        config.dropout_rate is None or 0.0 <= config.dropout_rate < 1.0,
        f"dropout_rate {config.dropout_rate} not in [0, 1)",
    )
    _check(
        config.loss_scale in LOSS_SCALES, f"loss_scale {config.loss_scale!r} not in {LOSS_SCALES}"
    )
    _check(config.rng_impl in RNG_IMPLS, f"rng_impl {config.rng_impl!r} not in {RNG_IMPLS}")
    _check(
        config.attention_backend in ATTENTION_BACKENDS,
        f"attention_backend {config.attention_backend!r} not in {ATTENTION_BACKENDS}",
    )
    _owned("policy", precision.get_policy, config.policy)
    _check(
        config.model != TINY_MODEL or bool(config.tokenizer),
        "model 'tiny-bert' needs config.tokenizer (a folder with a tokenizer)",
    )
