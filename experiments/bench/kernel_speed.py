"""One transformer layer's pieces, forward and backward, isojax (one `jax.jit` each) against
PyTorch's kernels at the same shapes: where `torch_speed`'s train-step ratio comes from.
Prints figures; not a test.

    python -m experiments.bench.kernel_speed                  # MiniLM-L6's shapes, 32x128
    python -m experiments.bench.kernel_speed --variant bert-base --batch 8 --rounds 31
    python -m experiments.bench.kernel_speed --variant tiny --rounds 1 --length 16   # smoke

The pieces, float32, each the gradient of `sum(piece(x) * g)` for a fixed random `g`:
- `dense-act-dense`: `W2 act(W1 x + b1) + b2`, the variant's `hidden_act` (isojax's
  `transformer.activation`, `torch.nn.functional.gelu` / `gelu(approximate="tanh")`);
- `attention, train mode`: `transformer.attend_reference` with isojax's dropout at the variant's
  attention dropout, against `scaled_dot_product_attention(dropout_p=...)` with the same key
  mask (about a quarter padding), as transformers' SDPA attention calls it;
- `attention, no dropout`: `transformer.attend` (XLA's `dot_product_attention` here) against
  SDPA without dropout;
- `LayerNorm`: the encoders' two-pass `nn.LayerNorm` against `torch.nn.functional.layer_norm`.

Interleaved rounds in a seeded random order per round (`torch_speed.interleaved`): the figure
is the median of the per-round ratios isojax / PyTorch, with the min-max spread as the noise.
"""

from __future__ import annotations

import argparse
import os
import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import cpu_offline, torch_speed
from isojax import models
from isojax.models import dropout as dropout_lib
from isojax.models import transformer


def jax_pieces(cfg, batch: int, length: int, mask: np.ndarray) -> dict:
    """`{name: (function, args)}`: each piece's jitted value-and-gradient and its inputs."""
    d, f, heads = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32)

    x, split = normal(batch, length, d), (batch, length, heads, d // heads)
    act, drop_key = transformer.activation(cfg.hidden_act), next(keys)
    norm = nn.LayerNorm(epsilon=cfg.layer_norm_eps, use_fast_variance=False)
    key_mask = jnp.asarray(mask, jnp.int32)

    def ffn(x, w1, b1, w2, b2):
        return act(x @ w1 + b1) @ w2 + b2

    def attention_train(q, k, v):
        drop = lambda p: dropout_lib.dropout(p, cfg.attention_dropout, drop_key)  # noqa: E731
        return transformer.attend_reference(q, k, v, key_mask, drop)

    def attention_eval(q, k, v):
        return transformer.attend(q, k, v, key_mask, backend="xla")

    def layer_norm(x, scale, bias):
        return norm.apply({"params": {"scale": scale, "bias": bias}}, x)

    qkv = (normal(*split), normal(*split), normal(*split))
    pieces = {
        "dense-act-dense": (
            ffn,
            (x, normal(d, f) * 0.05, normal(f), normal(f, d) * 0.05, normal(d)),
        ),
        "attention, train mode": (attention_train, qkv),
        "attention, no dropout": (attention_eval, qkv),
        "LayerNorm": (layer_norm, (x, 1 + 0.1 * normal(d), 0.1 * normal(d))),
    }
    out = {}
    for name, (fn, args) in pieces.items():
        g = normal(*jax.eval_shape(fn, *args).shape)
        grad = jax.jit(
            jax.value_and_grad(lambda *a, fn=fn, g=g: jnp.sum(fn(*a) * g), range(len(args)))
        )
        out[name] = (grad, args)
    return out


def torch_pieces(cfg, jax_side: dict, mask: np.ndarray, threads: int) -> dict:
    """The same pieces in PyTorch, from the same numbers (attention in `[batch, heads, len,
    head_dim]`, as transformers' SDPA attention transposes it)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)

    def tensors(args, heads_major=False):
        out = [torch.tensor(np.asarray(a)) for a in args]
        if heads_major:
            out = [t.transpose(1, 2) for t in out]
        return [t.requires_grad_() for t in out]

    act = {"gelu": F.gelu, "relu": F.relu}.get(
        cfg.hidden_act, lambda x: F.gelu(x, approximate="tanh")
    )
    keep = torch.tensor(mask).bool()[:, None, None, :]
    eps = cfg.layer_norm_eps
    fns = {
        "dense-act-dense": (lambda x, w1, b1, w2, b2: act(x @ w1 + b1) @ w2 + b2, False),
        "attention, train mode": (
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=cfg.attention_dropout
            ),
            True,
        ),
        "attention, no dropout": (
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
            True,
        ),
        "LayerNorm": (lambda x, s, b: F.layer_norm(x, x.shape[-1:], s, b, eps), False),
    }
    out = {}
    for name, (fn, heads_major) in fns.items():
        args = tensors(jax_side[name][1], heads_major)
        g = torch.randn_like(fn(*args))

        def run(fn=fn, args=args, g=g):
            torch.autograd.grad((fn(*args) * g).sum(), args)

        out[name] = run
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="minilm-l6", help="a models.VARIANTS name")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    cpu_offline()
    cfg = models.VARIANTS[args.variant]
    _, mask, _ = torch_speed.rows(args, cfg.vocab_size)  # the same padding as its steps
    jax_side = jax_pieces(cfg, args.batch, args.length, mask)
    torch_side = torch_pieces(cfg, jax_side, mask, args.threads)
    where = f"{args.variant} {args.batch}x{args.length} float32, {args.threads} threads"
    for name, (grad, inputs) in jax_side.items():
        arms = {"isojax": lambda grad=grad, inputs=inputs: jax.block_until_ready(grad(*inputs))}
        arms["pytorch"] = torch_side[name]
        for run in arms.values():  # compile and warm
            run()
        times = torch_speed.interleaved(arms, args.rounds)
        print(
            f"{where} {name}, forward and backward: isojax "
            f"{statistics.median(times['isojax']) * 1e3:.2f} ms, pytorch "
            f"{statistics.median(times['pytorch']) * 1e3:.2f} ms; isojax/pytorch "
            f"{torch_speed.ratio_summary(times)}"
        )


if __name__ == "__main__":
    main()
