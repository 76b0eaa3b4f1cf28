"""What the builders of a run read, taken from its validated config once, at the boundary.

    config_lib.validate_config(config)          # the one validation
    spec = specs.RunSpec.of(config)             # frozen: model, data, feed, state, loop
    model, params, tokenizer, hidden = build.build_model(spec.model, task.num_labels)
    for batch in feeds.train_batches(encoded, spec.feed, epoch): ...

`train_and_evaluate` and `setup` (`loop`) and `runs.restore` validate the `ConfigDict` and build
its `RunSpec`; below them every builder takes the spec it needs (`ModelSpec` for the classifier,
`DataSpec` for the examples, `FeedSpec` for the batches, `StateSpec` with its `OptimSpec` and
`ObjectiveSpec` for the train state, `LoopSpec` for the loop), not the whole config, and the
built classifier (`build.Classifier`: the loop's `Run`, `runs.Restored`) carries its `spec`.
Each spec holds only the fields its builders read, under the config's names where one field
is one key; `RunSpec.fields` is the flattened config itself, what the run folder's
`config.json` and each checkpoint's stamp hold (`resume.config_stamp`).
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from isojax.training import config as config_lib
from isojax.training import precision


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The classifier's build (`build.build_model`, `build.check_model`).

    Attributes:
      model: a model folder, a weights package, or "tiny-bert" (`config.TINY_MODEL`).
      tokenizer: a tokenizer folder; None: the model's own.
      max_length: tokens per example (tiny-bert's position table covers it; a pre-trained
        model's must).
      remat: recompute layer activations in the backward pass.
      policy: the dtypes (`precision.get_policy(config.policy)`).
      normalizer: the head's normaliser (`normalizers.NORMALIZERS`).
      normalizer_kwargs: its keyword arguments (`config.normalizer_of`: `config.isobn` under
        `config.normalizer_kwargs` for IsoBN).
      sentence: the sentence vector, "pooled" or "cls".
      dropout_rate: the head's dropout; None: the model's classifier dropout.
      label_mean_bias: a regression head's bias starts at the training labels' mean
        (`build.output_bias`); else at 0.
      attention_backend: the encoder's attention kernel (`isojax.models.attention`).
      packing: packed rows (the attention backend's choice reads it).
    """

    model: str
    tokenizer: str | None
    max_length: int
    remat: bool
    policy: precision.Policy
    normalizer: str
    normalizer_kwargs: dict
    sentence: str
    dropout_rate: float | None
    label_mean_bias: bool
    attention_backend: str = "auto"
    packing: bool = False

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> ModelSpec:
        normalizer, kwargs = config_lib.normalizer_of(config)
        return cls(
            model=config.model,
            tokenizer=config.tokenizer,
            max_length=config.max_length,
            remat=config.remat,
            policy=precision.get_policy(config.policy),
            normalizer=normalizer,
            normalizer_kwargs=kwargs,
            sentence=config.sentence,
            dropout_rate=config.dropout_rate,
            label_mean_bias=config.label_mean_bias,
            attention_backend=config.attention_backend,
            packing=config.packing,
        )


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The task's examples (`build.load_examples`, `batching.encode`, `loop.data_source`).

    Attributes:
      task: the GLUE task's name.
      data_dir: the glue_data folder of TSVs; None: tensorflow-datasets.
      tfds_data_dir: tensorflow-datasets' data folder; None: its default.
      max_length: tokens per encoded example.
      max_train_examples, max_eval_examples: the first N rows of a split; None: all.
    """

    task: str
    data_dir: str | None
    tfds_data_dir: str | None
    max_length: int
    max_train_examples: int | None
    max_eval_examples: int | None

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> DataSpec:
        return cls(
            task=config.task,
            data_dir=config.data_dir,
            tfds_data_dir=config.tfds_data_dir,
            max_length=config.max_length,
            max_train_examples=config.max_train_examples,
            max_eval_examples=config.max_eval_examples,
        )


@dataclasses.dataclass(frozen=True)
class FeedSpec:
    """How encoded examples become batches (`feeds`, the evaluation's batches).

    Attributes:
      batch_size: examples per optimizer update (global).
      eval_batch_size: examples per evaluation batch (global).
      grad_accum_steps: micro-batches per update (`feeds.update_batches`).
      buckets: padded lengths below `max_length`; (): every batch padded to it.
      packing: examples packed end to end into rows (`data.packing`); `buckets` unused.
      row_buckets: packed row counts; None: 8 evenly spaced.
      seed: the training order's seed (with the epoch).
    """

    batch_size: int
    eval_batch_size: int
    grad_accum_steps: int
    buckets: tuple
    packing: bool
    row_buckets: tuple | None
    seed: int

    @property
    def micro_batch_size(self) -> int:
        """Examples per micro-batch: `batch_size / grad_accum_steps`."""
        return self.batch_size // self.grad_accum_steps

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> FeedSpec:
        return cls(
            batch_size=config.batch_size,
            eval_batch_size=config.eval_batch_size,
            grad_accum_steps=config.grad_accum_steps,
            buckets=tuple(config.buckets),
            packing=config.packing,
            row_buckets=None if config.row_buckets is None else tuple(config.row_buckets),
            seed=config.seed,
        )


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """The optimizer (`build.make_optimizer`, the logged schedule): `config.optimizer`'s
    fields, as `optim.make_optimizer` takes them."""

    learning_rate: float
    schedule: str
    warmup_fraction: float
    weight_decay: float
    b1: float
    b2: float
    adam_eps: float
    clip_norm: float | None

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> OptimSpec:
        return cls(**config.optimizer.to_dict())


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """What the train step minimises (`build.make_objective`) and the C0 it keeps.

    Attributes:
      penalty: the token penalty, "none", "istar" or "cosreg".
      weight: its weight (`istar.weight` or `cosreg.weight`; 0.0 without a penalty).
      include_padding: the penalty also counts padding tokens (its section's field).
      zeta: I-STAR's shrinkage towards C0 (also the evaluation's IsoScore*).
      c0_mode: how C0 is estimated, `istar.stabilizer.kind`: "pass", "epoch" or "ema".
      c0_tokens: token vectors per C0 pass (and "epoch"'s default window in tokens).
      c0_window, c0_unit: "epoch"'s window and its unit ("tokens" or "steps").
      c0_momentum, c0_debias: "ema"'s moving average.
      cls_only: the last layer at [CLS] only when no penalty reads the tokens.
      grad_accum_steps: micro-batches per update (a running C0 counts micro-batches).
    """

    penalty: str
    weight: float
    include_padding: bool
    zeta: float
    c0_mode: str
    c0_tokens: int
    c0_window: int | None
    c0_unit: str
    c0_momentum: float
    c0_debias: bool
    cls_only: bool
    grad_accum_steps: int

    def c0_settings(self, steps_per_epoch: int) -> dict:
        """The `IsoScoreStar` fields of the C0 mode: the window of "epoch" (default:
        `c0_tokens` tokens, or `steps_per_epoch` steps), the momentum and debiasing of "ema",
        nothing for "pass"."""
        if self.c0_mode == "epoch":
            default = self.c0_tokens if self.c0_unit == "tokens" else steps_per_epoch
            window = default if self.c0_window is None else self.c0_window
            return {"window": int(window), "window_unit": self.c0_unit}
        if self.c0_mode == "ema":
            return {"momentum": float(self.c0_momentum), "debias": bool(self.c0_debias)}
        return {}

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> ObjectiveSpec:
        penalty = config.penalty
        section = config.istar if penalty == "istar" else config.cosreg
        s = config.istar.stabilizer
        return cls(
            penalty=penalty,
            weight={"istar": config.istar.weight, "cosreg": config.cosreg.weight}.get(penalty, 0.0),
            include_padding=section.include_padding,
            zeta=config.istar.zeta,
            c0_mode=s.kind,
            c0_tokens=s.tokens,
            c0_window=s.window,
            c0_unit=s.unit,
            c0_momentum=s.momentum,
            c0_debias=s.debias,
            cls_only=config.cls_only,
            grad_accum_steps=config.grad_accum_steps,
        )


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """The train state (`build.train_state`, `build.create_train_state`).

    Attributes:
      seed: the parameters' and dropout's key.
      rng_impl: the dropout key's generator.
      policy: the dtypes (`precision.get_policy(config.policy)`).
      loss_scale: "auto", "dynamic" or "none" (`precision.make_loss_scale`).
      fsdp: parameters and optimizer state sharded over the devices.
      front_end: the modules that run the classifier, "linen" or "nnx"
        (`front_ends.get`).
      optim: the optimizer's `OptimSpec`.
      objective: the train step's `ObjectiveSpec`.
    """

    seed: int
    rng_impl: str
    policy: precision.Policy
    loss_scale: str
    fsdp: bool
    front_end: str
    optim: OptimSpec
    objective: ObjectiveSpec

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> StateSpec:
        return cls(
            seed=config.seed,
            rng_impl=config.rng_impl,
            policy=precision.get_policy(config.policy),
            loss_scale=config.loss_scale,
            fsdp=config.fsdp,
            front_end=config.front_end,
            optim=OptimSpec.of(config),
            objective=ObjectiveSpec.of(config),
        )


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """The loop's length, logs, checkpoints and watches (`loop.Loop`).

    Attributes:
      num_epochs: epochs to train.
      max_steps: stop after N updates; None: `num_epochs` epochs.
      log_every: steps per logged window.
      checkpoint_every: steps between checkpoints; None: at epoch ends only.
      keep_checkpoints: the newest checkpoints kept.
      max_nonfinite_steps: consecutive non-finite losses that stop the run; None: never.
      progress, tensorboard: the progress line; TensorBoard event files.
      throughput: the throughput meter; peak_flops: one device's peak (None: known table).
      profile_steps: `(start, stop)` of a profiler trace; None: none.
    """

    num_epochs: int
    max_steps: int | None
    log_every: int
    checkpoint_every: int | None
    keep_checkpoints: int
    max_nonfinite_steps: int | None
    progress: bool
    tensorboard: bool
    throughput: bool
    peak_flops: float | None
    profile_steps: tuple | None

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> LoopSpec:
        profile = config.profile_steps
        return cls(
            num_epochs=config.num_epochs,
            max_steps=config.max_steps,
            log_every=config.log_every,
            checkpoint_every=config.checkpoint_every,
            keep_checkpoints=config.keep_checkpoints,
            max_nonfinite_steps=config.max_nonfinite_steps,
            progress=config.progress,
            tensorboard=config.tensorboard,
            throughput=config.throughput,
            peak_flops=config.peak_flops,
            profile_steps=None if profile is None else tuple(profile),
        )


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run's specs, built once from its validated config (`of`).

    Attributes:
      model, data, feed, state, loop: what each builder reads (`ModelSpec`, `DataSpec`,
        `FeedSpec`, `StateSpec`, `LoopSpec`).
      fields: the flattened config (`config.flatten` of its JSON values), what `config.json`
        and each checkpoint's stamp record (`resume.config_stamp`, `resume.check_same_run`).
    """

    model: ModelSpec
    data: DataSpec
    feed: FeedSpec
    state: StateSpec
    loop: LoopSpec
    fields: dict = dataclasses.field(repr=False)

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> RunSpec:
        """The specs of `config`, validated first by the caller (`config.validate_config`)."""
        return cls(
            model=ModelSpec.of(config),
            data=DataSpec.of(config),
            feed=FeedSpec.of(config),
            state=StateSpec.of(config),
            loop=LoopSpec.of(config),
            fields=config_lib.flatten(json.loads(config.to_json())),
        )
