"""Accelerator figures: bf16 train-step time, tokens/s and model FLOPs utilisation (MFU) of a
BERT-base-sized encoder, plain and with IsoBN and I-STAR (as ratios to plain). Prints one table.

    python -m experiments.bench.accelerator                 # GPU/TPU: BERT-base, 32x128, 256x128
    python -m experiments.bench.accelerator --tiny          # tiny config, seconds (CPU default)

Each setting is one jitted AdamW step built here from the public model APIs
(`isojax.linen.SequenceClassifier` over `isojax.linen.Encoder`, random weights, compute
bfloat16, parameters float32; `isojax.linen.norms` IsoBN on the pooled vector;
`isojax.core.penalties`
I-STAR penalty over every layer's tokens with C0 = identity), on one device, with all `len`
tokens real. Step time: the median over `--rounds` rounds, in rotating order, of the mean of
`--iters` back-to-back steps (one dispatch queue, one final `block_until_ready`), after a
compile (the settings compile side by side, in threads) and one warm-up step.

FLOPs per step:
  model: `isojax.training.throughput.model_flops` of the encoder's config (2 x in x out per
       dense layer a token passes through, 4 x keys x width per layer for the attention, the
       pooler and head, x 3 for training): what MFU is read from, as in the training run;
  6N:  6 · N · tokens with N the non-embedding parameters (Kaplan et al. 2020, eq. 2.1),
       attention's t² terms not included;
  XLA: `jitted.lower(...).compile().cost_analysis()["flops"]` of the whole step (forward,
       backward, optimizer; every op XLA counts), printed beside them, named as such.
MFU = model FLOPs / step time / the device's peak dense bf16 FLOP/s, through the functions the
training run's figures use (`isojax.training.throughput`: `model_flops`, `peak_flops` over its
vendor table `PEAK_FLOPS`, `mfu`), so the run's logged `mfu` and this table's "MFU" are one
computation; an unknown device prints "peak unknown". Without an accelerator
(CPU) the tiny configuration runs and the table says "not measured: no accelerator".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from isojax import linen
from isojax.core import penalties
from isojax.models import config as config_lib
from isojax.training import throughput

VARIANTS = ("plain", "isobn", "istar")
ISTAR_WEIGHT = -0.1  # the sign does not change the cost
TINY = config_lib.EncoderConfig(
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of `device_kind`
    (`isojax.training.throughput.PEAK_FLOPS`, the
    table the training run's MFU uses), None when unknown."""
    return throughput.peak_flops(device_kind, jnp.bfloat16)[0]


def xla_flops(compiled) -> float | None:
    """FLOPs of a compiled step on one device (`isojax.training.throughput.step_flops`, as the
    run)."""
    return throughput.step_flops(compiled)


def non_embedding_params(params) -> int:
    """Parameters outside the embedding tables (N of the 6·N·tokens count)."""
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    embeddings = sum(
        int(np.prod(table["embedding"].shape))
        for name, table in params["encoder"]["embeddings"].items()
        if name in ("word", "position", "token_type")
    )
    return total - embeddings


def make_head(cfg: config_lib.EncoderConfig, variant: str, dtype) -> linen.SequenceClassifier:
    """The classifier of one variant: IsoBN on the pooled vector for "isobn", none otherwise."""
    return linen.SequenceClassifier(
        linen.Encoder(cfg, dtype=dtype),
        num_labels=2,
        normalizer="isobn" if variant == "isobn" else "none",
        dtype=dtype,
    )


def build_step(variables: dict, cfg, variant: str, batch: int, length: int, device, dtype):
    """`(step, state, inputs)`: a jitted AdamW train step of `variant` from `variables` (the
    IsoBN head's: the same params for every variant, IsoBN's statistics used by "isobn" only)
    on random tokens (compute `dtype`), state and inputs already on `device`."""
    head = make_head(cfg, variant, dtype)
    # Copies: the step donates its state, and the variables serve every setting.
    params = jax.tree.map(jnp.copy, variables["params"])
    batch_stats = jax.tree.map(jnp.copy, variables["batch_stats"]) if variant == "isobn" else {}
    tx = optax.adamw(1e-5, weight_decay=0.01)
    rng = np.random.default_rng(0)
    inputs = {
        "input_ids": rng.integers(5, cfg.vocab_size, (batch, length)).astype(np.int32),
        "attention_mask": np.ones((batch, length), np.int32),
        "token_type_ids": np.zeros((batch, length), np.int32),
        "labels": rng.integers(0, 2, batch).astype(np.int32),
    }
    c0 = jnp.eye(cfg.hidden_size, dtype=jnp.float32)

    def loss_fn(params, batch_stats, inputs, key):
        (logits, out), updates = head.apply(
            {"params": params, "batch_stats": batch_stats},
            inputs["input_ids"],
            inputs["attention_mask"],
            inputs["token_type_ids"],
            deterministic=False,
            use_running_average=False,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, inputs["labels"]).mean()
        if variant == "istar":
            penalty = penalties.istar_penalty(
                out["encoder"].hidden_states, inputs["attention_mask"], c0=c0, zeta=0.2
            )
            loss = loss + ISTAR_WEIGHT * penalty
        return loss, updates.get("batch_stats", {})

    def step(state, inputs):
        params, opt_state, batch_stats, key = state
        key, dropout_key = jax.random.split(key)
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, inputs, dropout_key
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, batch_stats, key), loss

    state = (params, tx.init(params), batch_stats, jax.random.key(1))
    state, inputs = jax.device_put((state, inputs), device)
    return jax.jit(step, donate_argnums=0), state, inputs


class Setting:
    """One (variant, batch) step: lowered, compiled once (`compile`, thread-safe: the settings
    compile side by side), then timed in rounds."""

    def __init__(self, variables, cfg, variant, batch, length, device, dtype):
        self.variant, self.batch, self.length = variant, batch, length
        step, self.state, self.inputs = build_step(
            variables, cfg, variant, batch, length, device, dtype
        )
        self.lowered = step.lower(self.state, self.inputs)
        self.times: list[float] = []

    def compile(self) -> None:
        self.step = self.lowered.compile()
        self.flops = xla_flops(self.step)

    def warm_up(self) -> None:
        self.state, loss = self.step(self.state, self.inputs)
        jax.block_until_ready(loss)

    def time(self, iters: int) -> None:
        start = time.perf_counter()
        for _ in range(iters):
            self.state, loss = self.step(self.state, self.inputs)
        jax.block_until_ready((self.state, loss))
        self.times.append((time.perf_counter() - start) / iters)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config (default on CPU)")
    parser.add_argument("--batches", default=None, help="batch sizes, e.g. 32,256")
    parser.add_argument("--length", type=int, default=None, help="tokens per row")
    parser.add_argument("--iters", type=int, default=None, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per setting")
    return parser.parse_args(argv)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _rows(settings: list, n_params: int, peak: float | None, cfg) -> list[dict]:
    """Per setting: its median step, throughput, FLOPs, MFUs and ratio to `plain`'s step."""
    rows = []
    plain = {}
    for s in settings:
        step_s = statistics.median(s.times)
        tokens = s.batch * s.length
        flops_6n = 6 * n_params * tokens
        flops = throughput.model_flops(cfg, s.batch, s.length)
        if s.variant == "plain":
            plain[s.batch] = step_s
        rows.append(
            {
                "variant": s.variant,
                "batch": f"{s.batch}x{s.length}",
                "step_ms": 1e3 * step_s,
                "tokens_per_s": tokens / step_s,
                "xla_gflop": None if s.flops is None else s.flops / 1e9,
                "mfu": throughput.mfu(flops, step_s, peak),  # the run's own MFU
                "mfu_6n": throughput.mfu(flops_6n, step_s, peak),
                "ratio": step_s / plain[s.batch],
            }
        )
    return rows


def _print_table(rows: list[dict]) -> None:
    """The rows as a fixed-width table on stdout."""
    header = (
        f"{'variant':<8} {'batch':>8} {'step ms':>9} {'tokens/s':>10} {'XLA GFLOP':>10} "
        f"{'MFU':>8} {'MFU 6N':>7} {'x plain':>8}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['variant']:<8} {row['batch']:>8} {row['step_ms']:>9.2f} "
            f"{row['tokens_per_s']:>10.0f} {fmt(row['xla_gflop'], '.4g'):>10} "
            f"{fmt(row['mfu'], '.1%'):>8} {fmt(row['mfu_6n'], '.1%'):>7} "
            f"{row['ratio']:>8.3f}"
        )


def main(argv=None) -> list[dict]:
    """Runs the benchmark, prints the table; returns its rows (for tests)."""
    args = parse_args(argv)
    device = jax.devices()[0]
    accelerator = device.platform != "cpu"
    tiny = args.tiny or not accelerator
    cfg = TINY if tiny else config_lib.VARIANTS["bert-base"]
    batches = [int(b) for b in (args.batches or ("4,8" if tiny else "32,256")).split(",")]
    length = args.length or (16 if tiny else 128)
    iters = args.iters or (2 if tiny else 10)
    rounds = args.rounds or (2 if tiny else 5)
    peak = peak_flops(device.device_kind) if accelerator else None
    started = time.perf_counter()

    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}")
    print(
        f"model: {'tiny' if tiny else 'bert-base'} (L={cfg.num_layers}, H={cfg.hidden_size}, "
        f"A={cfg.num_heads}), random weights, compute bf16, params f32, AdamW, dropout on"
    )
    print(
        "peak bf16: "
        + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "peak unknown")
        + f"; step = mean of {iters} steps, median of {rounds} rotating rounds"
    )
    if not accelerator:
        print("not measured: no accelerator (tiny configuration on CPU, to test the script)")

    dtype = jnp.bfloat16
    variables = linen.init_variables(make_head(cfg, "isobn", dtype), jax.random.key(0))
    n_params = non_embedding_params(variables["params"])
    settings = [
        Setting(variables, cfg, v, b, length, device, dtype) for b in batches for v in VARIANTS
    ]
    with concurrent.futures.ThreadPoolExecutor(len(settings)) as pool:
        list(pool.map(Setting.compile, settings))
    for s in settings:
        s.warm_up()
    for r in range(rounds):
        for s in settings[r % len(settings) :] + settings[: r % len(settings)]:
            s.time(iters)

    rows = _rows(settings, n_params, peak, cfg)
    _print_table(rows)
    if peak is None:
        print("MFU: peak unknown" if accelerator else "MFU: not measured: no accelerator")
    total = time.perf_counter() - started
    print(f"N (non-embedding params) = {n_params:,}; total {total:.0f} s")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
