"""Train-step time of MiniLM-L6 at 32 x 128 with attention through `jax.nn.dot_product_attention`
(`transformer.attend`) over the einsum path (`transformer.attend_reference`): prints figures;
not a test.

    .venv/bin/python experiments/bench/attention_speed.py              # 7 rounds
    .venv/bin/python experiments/bench/attention_speed.py --rounds 1   # smoke test

One process, interleaved rounds: each round times one jitted forward + backward (float32,
random MiniLM-L6 weights, 32 rows of 128 tokens with a quarter padding, token ids random)
of each arm in a random order drawn per round (seeded), so that load from other processes
hits both alike. The figure is the median over rounds of the per-round ratio new / old, with
the spread (min-max) as the noise. The step has no attention dropout (`attention_dropout`
0): with it a training step keeps the einsum path (the fused call has no dropout), so the
ratio would be 1 by construction; evaluation steps and ModernBERT (attention dropout 0 in
its published configs) take the fused path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from isojax import models
from isojax.models import transformer


def make_step(attend):
    """A jitted loss-and-gradient step of MiniLM-L6 whose attention is `attend`."""
    cfg = models.VARIANTS["minilm-l6"].replace(attention_dropout=0.0, hidden_dropout=0.0)
    head = models.SequenceClassifier(models.Encoder(cfg), num_labels=2, dropout_rate=0.0)

    def loss(params, ids, mask, labels):
        original = transformer.attend
        transformer.attend = attend  # read while tracing only
        try:
            logits, _ = head.apply({"params": params}, ids, mask)
        finally:
            transformer.attend = original
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    return head, jax.jit(jax.value_and_grad(loss))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1000, 30000, (args.batch, args.length)), jnp.int32)
    lengths = rng.integers(args.length // 2, args.length + 1, args.batch)
    mask = jnp.asarray(np.arange(args.length)[None] < lengths[:, None], jnp.int32)
    labels = jnp.asarray(rng.integers(0, 2, args.batch), jnp.int32)
    arms = {"new": make_step(transformer.attend), "old": make_step(transformer.attend_reference)}
    head = arms["new"][0]
    params = models.init_variables(head, jax.random.key(0), seq_len=8)["params"]
    for _, step in arms.values():  # compile
        jax.block_until_ready(step(params, ids, mask, labels))
    order = random.Random(0)
    ratios = []
    for _ in range(args.rounds):
        times = {}
        for name in order.sample(list(arms), len(arms)):
            start = time.perf_counter()
            jax.block_until_ready(arms[name][1](params, ids, mask, labels))
            times[name] = time.perf_counter() - start
        ratios.append(times["new"] / times["old"])
        print(f"round: new {times['new'] * 1e3:.1f} ms, old {times['old'] * 1e3:.1f} ms")
    median = statistics.median(ratios)
    print(
        f"MiniLM-L6 {args.batch}x{args.length} train step, new/old: median {median:.3f} over "
        f"{len(ratios)} rounds (noise: min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
