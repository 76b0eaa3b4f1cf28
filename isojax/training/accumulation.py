"""Gradient accumulation's batches: `k` micro-batches stacked into one `[k, ...]` update batch.

    config.batch_size, config.grad_accum_steps = 32, 4     # 4 micro-batches of 8 per update
    for batch in feeds.update_batches(encoded, config, epoch):   # input_ids [4, 8, t] ...
        state, metrics = run.train_fn(state, distributed.global_batch(batch, mesh, stacked=True))

`config.batch_size` stays the examples per optimizer update. The epoch's micro-batches of
`batch_size / k` examples come from the same shuffled order (`batching.epoch_order`), so update
`u` holds exactly the examples of batch `u` without accumulation, `k` consecutive slices of it.
Each micro-batch is padded (its own length bucket) or packed (its own rows) as the loop's
layout says; the `k` are then padded to their common shape (the widest bucket, or the most
rows) so they stack, and the step scans over them (`steps._accumulated_grads`): one update from
the real-example-weighted mean of their gradients. Padding added here is masked like any other:
padded rows get `attention_mask` 0, packed rows `segment_ids`/`token_mask` 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import numpy as np

from isojax.data import packing

# Fill values of the arrays a micro-batch may be padded along its token or row axis.
_FILL = {"attention_mask": 0, "token_type_ids": 0, "position_ids": 0, "segment_ids": 0,
         "token_mask": 0}  # fmt: skip


def _pad_axis(x: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths, constant_values=fill)


def stack(micro: list[dict], *, pad_id: int, process_index: int = 0) -> dict:
    """`k` micro-batches (this process's rows, padded or packed) -> one dict of `[k, ...]`
    arrays padded to their common width (padded) or row count (packed).

    Packed `cls_index[:, 0]` is a global row (`process_index * rows + row`), so it moves with
    the row count of this process's slice."""
    if packing.is_packed(micro[0]):
        rows = max(m["input_ids"].shape[0] for m in micro)
        out = []
        for m in micro:
            r = m["input_ids"].shape[0]
            m = {k: (_pad_axis(v, 0, rows, _FILL.get(k, pad_id)) if k in packing.ROW_KEYS else v)
                 for k, v in m.items()}  # fmt: skip
            cls_index = m["cls_index"].copy()
            cls_index[:, 0] += process_index * (rows - r)
            out.append(m | {"cls_index": cls_index})
    else:
        width = max(m["input_ids"].shape[1] for m in micro)
        keys = ("input_ids", "attention_mask", "token_type_ids")
        out = [
            {
                k: (_pad_axis(v, 1, width, _FILL.get(k, pad_id)) if k in keys else v)
                for k, v in m.items()
            }  # fmt: skip
            for m in micro
        ]
    return {key: np.stack([m[key] for m in out]) for key in out[0]}


def grouped(
    micro_batches: Iterable[dict], k: int, updates: int, *, pad_id: int, process_index: int = 0
) -> Iterator[dict]:
    """`updates` stacked batches of `k` consecutive micro-batches each (`stack`); micro-batches
    past the last full group are dropped."""
    it = iter(micro_batches)
    for _ in range(updates):
        group = list(itertools.islice(it, k))
        if len(group) < k:
            return
        yield stack(group, pad_id=pad_id, process_index=process_index)
