"""Train-step time with attention through `transformer.attend` ("fused": the config's
`attention_backend`, "auto": XLA's `jax.nn.dot_product_attention` on CPU and TPU, cuDNN's kernel
where `isojax.models.attention` allows it on a GPU) over the einsum path
(`transformer.attend_reference`): prints figures; not a test.

    python -m experiments.bench.attention_speed              # MiniLM-L6, 7 rounds
    python -m experiments.bench.attention_speed --rounds 1   # smoke test
    python -m experiments.bench.attention_speed --variant bert-base \
        --variant modernbert-base --dtype bfloat16 --batch 256 --rounds 5   # issue 51's check

One process, interleaved rounds: each round times one jitted forward + backward (random
weights of the named `models.VARIANTS`, rows with about a quarter padding, random token ids)
of each arm in a random order drawn per round (seeded), so that load from other processes hits
both alike. The figure is the median over rounds of the per-round ratio fused / einsum, with the
spread (min-max) as the noise, and per arm the median tokens/s, real (non-padding) tokens/s and
MFU (the model FLOPs of a training step, `isojax.training.throughput.model_flops`, over the
device's data-sheet peak for the dtype; XLA's count of the step printed beside it). In the
installed JAX the "fused" call (`implementation` "xla" or None) is XLA's own
scores-softmax-values: the two arms compute the same thing two ways, and cuDNN is measured by
`experiments/device/accel_check.py` (issue 59). The step has no attention dropout: with it a
training step keeps
the einsum path (the fused call has no dropout), so the ratio would be 1 by construction;
evaluation steps and ModernBERT (attention dropout 0 in its published configs) take the fused
path.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from isojax import linen, models
from isojax.models import transformer
from isojax.training import throughput


def einsum_attend(query, key, value, mask, dropout=None, window=None, **backend):
    """`transformer.attend`'s call, through the einsum path (`attend_reference`); `backend`
    (`backend=`, `packed=`) does not apply to it."""
    return transformer.attend_reference(query, key, value, mask, dropout, window)


def make_step(variant: str, attend, dtype):
    """A jitted loss-and-gradient step of `variant` whose attention is `attend`."""
    cfg = models.VARIANTS[variant].replace(attention_dropout=0.0, hidden_dropout=0.0)
    encoder = linen.Encoder(cfg, dtype=dtype)
    head = linen.SequenceClassifier(encoder, num_labels=2, dropout_rate=0.0, dtype=dtype)

    def loss(params, ids, mask, labels):
        original = transformer.attend
        transformer.attend = attend  # read while tracing only
        try:
            logits, _ = head.apply({"params": params}, ids, mask)
        finally:
            transformer.attend = original
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

    return head, jax.jit(jax.value_and_grad(loss))


def batch(args, vocab: int):
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(5, vocab, (args.batch, args.length)), jnp.int32)
    lengths = rng.integers(args.length // 2, args.length + 1, args.batch)
    mask = jnp.asarray(np.arange(args.length)[None] < lengths[:, None], jnp.int32)
    return ids, mask, jnp.asarray(rng.integers(0, 2, args.batch), jnp.int32)


def bench_variant(variant: str, args) -> None:
    """Compiles both arms of `variant`, times interleaved rounds, prints one line per figure."""
    dtype = jnp.dtype(args.dtype)
    ids, mask, labels = batch(args, models.VARIANTS[variant].vocab_size)
    arms = {
        "fused": make_step(variant, transformer.attend, dtype),
        "einsum": make_step(variant, einsum_attend, dtype),
    }
    params = linen.init_variables(arms["fused"][0], jax.random.key(0), seq_len=8)["params"]
    inputs = (params, ids, mask, labels)
    xla = {n: throughput.step_flops(s.lower(*inputs).compile()) for n, (_, s) in arms.items()}
    flops = throughput.model_flops(models.VARIANTS[variant], args.batch, args.length)
    for _, step in arms.values():  # compile (and warm)
        jax.block_until_ready(step(*inputs))
    order, times = random.Random(0), {name: [] for name in arms}
    for _ in range(args.rounds):
        for name in order.sample(list(arms), len(arms)):
            start = time.perf_counter()
            jax.block_until_ready(arms[name][1](*inputs))
            times[name].append(time.perf_counter() - start)
    device = jax.devices()[0]
    peak, _ = throughput.peak_flops(device.device_kind, dtype)
    tokens, real = ids.size, int(mask.sum())
    where = f"{variant} {args.batch}x{args.length} {dtype.name} on {device.device_kind}"
    for name, seconds in times.items():
        t = statistics.median(seconds)
        util = throughput.mfu(flops, t, peak)
        util = "unknown" if util is None else f"{util:.3f}"
        counted = "none" if xla[name] is None else f"{xla[name]:.4g}"
        print(
            f"{where} {name}: {t * 1e3:.1f} ms/step, {tokens / t:,.0f} tokens/s, "
            f"{real / t:,.0f} real tokens/s, MFU {util} (model FLOPs {flops:.4g}; XLA's count "
            f"{counted})"
        )
    ratios = [f / e for f, e in zip(times["fused"], times["einsum"], strict=True)]
    print(
        f"{where} fused/einsum: median {statistics.median(ratios):.3f} over {len(ratios)} "
        f"rounds (noise: min {min(ratios):.3f}, max {max(ratios):.3f})"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", help="models.VARIANTS (minilm-l6)")
    parser.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on GPU)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args(argv)
    for variant in args.variant or ["minilm-l6"]:
        bench_variant(variant, args)


if __name__ == "__main__":
    main()
