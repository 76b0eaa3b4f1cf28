"""Cost of IsoBN, I-STAR and CosReg as a ratio to a plain forward+backward of the same encoder.

Each variant is one jitted training gradient of a sequence classifier on a MiniLM-sized BERT
(6 layers, hidden 384, 12 heads, intermediate 1536; random weights, the cost does not depend on
them): `isojax.models` when it imports, otherwise a same-size stand-in (said in the output).

    plain     cross-entropy on the pooled [CLS]                     (the baseline)
    isobn     + IsoBN on the pooled vector, running stats updated (batch_stats mutable)
    istar     + lambda * I-STAR over every token of every layer (padding masked)
    cosreg    + lambda * CosReg over the last layer's tokens

Timings are medians of `--iters` round-robin calls after one compile-and-warm-up call each.

    python -m experiments.bench.transform_cost --batch 16 --len 64 --iters 5
"""

import argparse
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from isojax.core import penalties
from isojax.linen import norms

MINILM = dict(hidden=384, layers=6, heads=12, intermediate=1536, vocab=30522)


class StandInLayer(nn.Module):
    """Post-LN transformer layer of BERT's shape (attention, GELU MLP), for timing only."""

    heads: int
    intermediate: int

    @nn.compact
    def __call__(self, h, mask):
        attn = nn.MultiHeadDotProductAttention(num_heads=self.heads)(
            h, mask=nn.make_attention_mask(mask, mask)
        )
        h = nn.LayerNorm(epsilon=1e-12)(h + attn)
        mlp = nn.Dense(h.shape[-1])(nn.gelu(nn.Dense(self.intermediate)(h)))
        return nn.LayerNorm(epsilon=1e-12)(h + mlp)


class StandInClassifier(nn.Module):
    """Same-size stand-in for `isojax.linen.SequenceClassifier` (pooled [CLS] -> norm -> 2)."""

    normalizer: str

    @nn.compact
    def __call__(self, ids, mask, *, use_running_average=True):
        h = nn.Embed(MINILM["vocab"], MINILM["hidden"])(ids)
        h = h + nn.Embed(512, MINILM["hidden"])(jnp.arange(ids.shape[1]))
        hidden_states = []
        for _ in range(MINILM["layers"]):
            h = StandInLayer(MINILM["heads"], MINILM["intermediate"])(h, mask)
            hidden_states.append(h)
        pooled = jnp.tanh(nn.Dense(MINILM["hidden"])(h[:, 0]))
        sentence = norms.make_normalizer(self.normalizer)(pooled, use_running_average)
        return nn.Dense(2)(sentence), tuple(hidden_states)


def build(normalizer: str, standin: bool):
    """`(apply(variables, ids, mask, train) -> (logits, hidden_states, updates), init, label)`."""
    try:
        if standin:
            raise RuntimeError("--standin given")
        from isojax import linen, models

        config = models.EncoderConfig(
            hidden_size=MINILM["hidden"],
            num_layers=MINILM["layers"],
            num_heads=MINILM["heads"],
            intermediate_size=MINILM["intermediate"],
        )
        head = linen.SequenceClassifier(
            encoder=linen.Encoder(config), num_labels=2, normalizer=normalizer
        )

        def apply(variables, ids, mask, train):
            (logits, out), updates = head.apply(
                variables,
                ids,
                mask,
                deterministic=True,
                use_running_average=not train,
                mutable=["batch_stats"],
            )
            return logits, out["encoder"].hidden_states, updates

        def init(rng, ids, mask):
            return head.init(rng, ids, mask)

        return apply, init, "isojax.models BERT, MiniLM-L6 size (random weights)"
    except Exception as err:  # noqa: BLE001 (models not there yet: time the stand-in instead)
        model = StandInClassifier(normalizer)
        reason = f"{type(err).__name__}: {err}"[:80]

        def apply(variables, ids, mask, train):
            (logits, hidden), updates = model.apply(
                variables, ids, mask, use_running_average=not train, mutable=["batch_stats"]
            )
            return logits, hidden, updates

        return apply, model.init, f"same-size Flax stand-in (isojax.models unusable: {reason})"


def make_step(variant: str, standin: bool, weight: float = 0.25):
    apply, init, label = build("isobn" if variant == "isobn" else "none", standin)

    def loss_fn(params, other, ids, mask, labels):
        logits, hidden, updates = apply({"params": params, **other}, ids, mask, train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        if variant == "istar":
            loss = loss + weight * penalties.istar_penalty(hidden, mask, zeta=0.2)
        elif variant == "cosreg":
            loss = loss + weight * penalties.cosreg_penalty(hidden[-1], mask)
        return loss, updates

    @jax.jit
    def step(params, other, ids, mask, labels):
        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, other, ids, mask, labels
        )
        return loss, grads, updates

    return step, init, label


def prepare(variant, batch, length, standin, seed=0):
    """A compiled, warmed-up `run()` of one variant's training gradient, and the encoder label."""
    step, init, label = make_step(variant, standin)
    rng = jax.random.key(seed)
    ids = jax.random.randint(rng, (batch, length), 1, MINILM["vocab"], jnp.int32)
    lengths = jnp.linspace(length // 2, length, batch).astype(jnp.int32)
    mask = (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.int32)
    labels = jnp.arange(batch) % 2
    variables = dict(init(jax.random.key(1), ids, mask))
    params = variables.pop("params")

    def run():
        return jax.block_until_ready(step(params, variables, ids, mask, labels))

    run()  # compile + warm up
    return run, label


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--len", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--variants", default="plain,isobn,istar,cosreg")
    parser.add_argument("--standin", action="store_true", help="time the stand-in encoder")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if variants[0] != "plain":
        parser.error("the first variant must be 'plain' (the baseline)")
    runs = {}
    for variant in variants:
        runs[variant], label = prepare(variant, args.batch, args.len, args.standin)
    # Round-robin, so a change in machine load hits every variant alike.
    times = {variant: [] for variant in variants}
    for _ in range(args.iters):
        for variant, run in runs.items():
            start = time.perf_counter()
            run()
            times[variant].append(time.perf_counter() - start)
    print(f"encoder: {label}")
    print(
        f"device: {jax.devices()[0].platform} x{len(jax.devices())}; batch {args.batch}, "
        f"length {args.len}; median of {args.iters} round-robin jitted forward+backward steps"
    )
    base = statistics.median(times["plain"])
    for variant, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{variant:8s} {median * 1e3:9.1f} ms   ratio {median / base:5.3f}")


if __name__ == "__main__":
    main()
