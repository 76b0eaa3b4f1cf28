"""What the `iternorm` normaliser (SPEC.md §10.3) costs a train step on MiniLM-L6 (prints
figures; not a test).

    python -m experiments.bench.iternorm_cost                # full run (9 rounds)
    python -m experiments.bench.iternorm_cost --rounds 1     # smoke test

The MiniLM-L6 AdamW train step (float32, 1 device, real RTE rows, 32 x 128, the
`IsojaxStepper` of `train_speed.py`) with the `iternorm` head (its defaults: T = 5, one group of
384) against `none`, in ONE process, in `--rounds` interleaved rounds whose arm order
alternates (none then iternorm, iternorm then none), so that load from other processes and the
arm run just before hit both alike. The figure is the median of the per-round ratios
iternorm / none with its spread and noise (`train_speed.summarize`: IQR, min-max, the
half-width of a bootstrap 95 % interval of the median); issue 47's goal is at most 1.05. Take it
from a quiet machine (the study grids paused): the noise on a shared one is larger than the
effect. The train-mode work is 3 T = 15 products of `[d, d]` matrices (Newton–Schulz) and the
`[32, d] x [d, d]` transform, forward and backward.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np

from experiments.bench import cpu_offline, train_speed

BATCH, LENGTH = 32, 128
ARMS = ("none", "iternorm")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (>= 7)")
    parser.add_argument(
        "--glue_dir",
        default=os.environ.get("ISOJAX_GLUE_DIR", os.path.join("..", "shared", "data", "glue")),
    )
    args = parser.parse_args()
    args.batch, args.length = BATCH, LENGTH  # what train_speed.bench_config reads
    return args


def time_arms(args) -> None:
    """iternorm / none per round, arm order alternating."""
    arms = {name: train_speed.IsojaxStepper(args, name) for name in ARMS}
    for stepper in arms.values():
        stepper()  # compile
        stepper()  # warm
    times = {name: [] for name in arms}
    for r in range(args.rounds):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for name in order:
            times[name].append(arms[name]())
        print(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in order),
            flush=True,
        )
    none, iternorm = (np.asarray(times[name]) for name in ARMS)
    print(f"step time medians: none {np.median(none):.3f} s, iternorm {np.median(iternorm):.3f} s")
    text, _ = train_speed.summarize(iternorm / none)
    print(f"MiniLM-L6 train step {BATCH} x {LENGTH}, iternorm / none: {text}")


def main() -> None:
    cpu_offline()
    args = parse_args()
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, load "
        f"average {os.getloadavg()[0]:.1f}"
    )
    time_arms(args)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
