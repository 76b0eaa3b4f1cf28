"""Train-step time of isojax against transformers' PyTorch model with the same weights, per
encoder variant: prints figures; not a test.

    python -m experiments.bench.torch_speed     # MiniLM-L6 32x128, ModernBERT-base
                                                          # 8x128 (about 10 s a step), 7 rounds
    python -m experiments.bench.torch_speed --variant tiny --rounds 1 --length 16
                                                          # smoke test
    python -m experiments.bench.torch_speed --variant modernbert-base@8 --layers 11 \
        --rounds 3 [--remat]                              # the depth sweep of benchmarks.md
    python -m experiments.bench.torch_speed --variant minilm-l6 --profile 3
                                                          # where each side's step goes

Each variant's classifier is built by isojax from `models.VARIANTS` (random weights, seed 0),
exported with `export_pretrained` and loaded by transformers' `<Family>ForSequenceClassification`
from that folder, so both sides compute the same model from the same numbers. Each side's step
is a training step as its users run it: forward in train mode with the config's dropouts,
cross-entropy on 2 labels, backward, one AdamW update (lr 2e-5, weight decay 0.01), float32,
every token of every layer computed (what I-STAR's step needs; PyTorch always does). isojax's
step is one `jax.jit` of loss, gradient and `optax.adamw`; PyTorch runs eagerly with
`torch.set_num_threads(--threads)` and its default attention (SDPA).

One process, interleaved rounds: each round times one step of each side in a random order drawn
per round (seeded), so load from other processes hits both alike. The figure is the median over
rounds of the per-round ratio isojax / PyTorch, with the min-max spread as the noise. Rows carry
about a quarter padding (lengths uniform in [length/2, length]).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.bench import train_speed
from isojax import linen, models

LR, WEIGHT_DECAY = 2e-5, 0.01


def make_isojax_step(head, params, dropout_key):
    """A jitted AdamW train step of `head` and its initial optimizer state."""
    optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)

    def loss(params, ids, mask, labels, key):
        logits, _ = head.apply(
            {"params": params}, ids, mask, deterministic=False, rngs={"dropout": key}
        )
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], 1))

    @jax.jit
    def step(params, opt_state, ids, mask, labels, key):
        key, sub = jax.random.split(key)
        value, grads = jax.value_and_grad(loss)(params, ids, mask, labels, sub)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, key, value

    return step, optimizer.init(params)


def torch_model(head, params, folder: str, threads: int):
    """transformers' classifier loaded from isojax's export of (`head`, `params`), train mode."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    linen.export_pretrained(folder, head, params)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    return model.train()


def same_model_gap(head, params, model, jax_inputs, torch_inputs) -> float:
    """Max |logits| difference of the two sides in eval mode on the timed batch."""
    import torch

    logits, _ = head.apply({"params": params}, *jax_inputs)
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=torch_inputs[0], attention_mask=torch_inputs[1]).logits
    model.train()
    return float(np.max(np.abs(np.asarray(logits) - reference.numpy())))


def rows(args, vocab: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, vocab, (args.batch, args.length))
    lengths = rng.integers(args.length // 2, args.length + 1, args.batch)
    mask = (np.arange(args.length)[None] < lengths[:, None]).astype(np.int64)
    return ids, mask, rng.integers(0, 2, args.batch)


def torch_kind(name: str) -> str:
    """The kind of an aten op, in `train_speed.op_kind`'s words where one applies."""
    for kind, pattern in (
        ("matmul", r"addmm|::mm$|bmm|matmul|linear|scaled_dot|flash|efficient"),
        ("LayerNorm", r"layer_norm"),
        ("dropout (bits and mask)", r"dropout|bernoulli"),
        ("softmax and mask", r"softmax"),
        ("GELU", r"gelu"),
        ("optimizer", r"_foreach|adam|lerp|addcdiv|addcmul|sqrt"),
        ("transpose/copy", r"copy|contiguous|transpose|permute|clone"),
    ):
        if re.search(pattern, name):
            return kind
    return "other"


def profile_sides(isojax_step, torch_step, compiled_text: str, steps: int) -> dict:
    """`{side: {kind: ms per step}}` of `steps` traced steps of each side."""
    import torch.profiler

    kinds, _ = train_speed.traced_kinds(compiled_text, isojax_step, steps)
    sides = {"isojax": {" ".join(kind): ms for kind, ms in kinds.items()}}
    sides["pytorch"] = collections.defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            torch_step()
    for row in prof.key_averages():
        sides["pytorch"][torch_kind(row.key)] += row.self_cpu_time_total / 1e3 / steps
    return sides


def print_profile(where: str, sides: dict) -> None:
    for side, kinds in sides.items():
        total = sum(kinds.values())
        print(f"{where} {side}: {total:.0f} ms a step over the ops profiled")
        for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"    {kind:44s} {ms:8.1f} ms {100 * ms / total:5.1f} %")


def bench_variant(variant: str, args) -> None:
    """Builds both sides of `variant`, times interleaved rounds, prints one line per figure."""
    import torch

    cfg = models.VARIANTS[variant]
    if args.layers:  # the first `layers` layers of the variant (ModernBERT: their layer types)
        cfg = cfg.replace(num_layers=args.layers, layer_types=cfg.layer_types[: args.layers])
    head = linen.SequenceClassifier(linen.Encoder(cfg, remat=args.remat), num_labels=2)
    params = linen.init_variables(head, jax.random.key(0))["params"]
    ids, mask, labels = rows(args, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        model = torch_model(head, params, folder, args.threads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    t_ids, t_mask, t_labels = (torch.as_tensor(a, dtype=torch.long) for a in (ids, mask, labels))
    j_ids, j_mask, j_labels = (jnp.asarray(a, jnp.int32) for a in (ids, mask, labels))
    print(
        f"{variant}: max |logits isojax - pytorch| in eval mode "
        f"{same_model_gap(head, params, model, (j_ids, j_mask), (t_ids, t_mask)):.2e}"
    )

    def torch_step() -> None:
        optimizer.zero_grad()
        logits = model(input_ids=t_ids, attention_mask=t_mask).logits
        torch.nn.functional.cross_entropy(logits, t_labels).backward()
        optimizer.step()

    step, opt_state = make_isojax_step(head, params, jax.random.key(1))
    state = [params, opt_state, jax.random.key(1)]

    def isojax_step() -> None:
        out = step(*state[:2], j_ids, j_mask, j_labels, state[2])
        jax.block_until_ready(out)
        state[:] = out[:3]

    arms = {"isojax": isojax_step, "pytorch": torch_step}
    for run in arms.values():  # compile and warm
        run()
    depth = f", {cfg.num_layers} layers" + (", remat" if args.remat else "")
    where = f"{variant} {args.batch}x{args.length} float32{depth}, {args.threads} threads"
    if args.profile:
        text = step.lower(*state[:2], j_ids, j_mask, j_labels, state[2]).compile().as_text()
        print_profile(where, profile_sides(isojax_step, torch_step, text, args.profile))
        return
    times = interleaved(arms, args.rounds)
    for name, seconds in times.items():
        print(f"{where} {name}: {statistics.median(seconds) * 1e3:.1f} ms/step (median)")
    print(f"{where} isojax/pytorch: {ratio_summary(times)}")


def interleaved(arms: dict, rounds: int) -> dict:
    """`{arm: [seconds]}`: each round calls every arm once, in a seeded random order."""
    order, times = random.Random(0), {name: [] for name in arms}
    for _ in range(rounds):
        for name in order.sample(list(arms), len(arms)):
            start = time.perf_counter()
            arms[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_summary(times: dict) -> str:
    """The median of the per-round ratios isojax / pytorch, with their min-max as the noise."""
    ratios = [j / p for j, p in zip(times["isojax"], times["pytorch"], strict=True)]
    return (
        f"median {statistics.median(ratios):.3f} over {len(ratios)} rounds "
        f"(noise: min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variant",
        action="append",
        help="models.VARIANTS name, @B for batch B (default: minilm-l6 modernbert-base@8)",
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--layers", type=int, help="keep the variant's first N layers")
    parser.add_argument(
        "--remat", action="store_true", help="isojax rematerialises each layer (nn.remat)"
    )
    parser.add_argument(
        "--profile", type=int, default=0, help="trace this many steps of each side, no rounds"
    )
    args = parser.parse_args(argv)
    for spec in args.variant or ["minilm-l6", "modernbert-base@8"]:
        variant, _, batch = spec.partition("@")
        bench_variant(
            variant, argparse.Namespace(**{**vars(args), "batch": int(batch or args.batch)})
        )


if __name__ == "__main__":
    main()
