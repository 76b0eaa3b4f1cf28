"""A run's batches from its `specs.FeedSpec`: padded or packed, whole updates or micro-batches.

    for batch in feeds.update_batches(encoded, spec, epoch):   # this process's rows
        state, metrics = train_fn(state, distributed.global_batch(batch, mesh, stacked=k > 1))

`batches` chooses the layout (`spec.packing`: `data.packing.packed_batches`, else
`data.batching.batches` over `spec.buckets`); `train_batches` is an epoch's shuffled training
batches (seed, epoch) from a given batch on, the last incomplete one dropped; `update_batches`
groups them into `spec.grad_accum_steps` micro-batches per optimizer update (`grouped`).
Every process reads its own rows of the same global batches.

Gradient accumulation's batches: `k` micro-batches stacked into one `[k, ...]` update batch.

    spec = specs.FeedSpec.of(config)   # batch_size 32, grad_accum_steps 4: 4 micro-batches of 8
    for batch in feeds.update_batches(encoded, spec, epoch):   # input_ids [4, 8, t] ...
        state, metrics = run.train_fn(state, distributed.global_batch(batch, mesh, stacked=True))

`spec.batch_size` stays the examples per optimizer update. The epoch's micro-batches of
`batch_size / k` examples come from the same shuffled order (`batching.epoch_order`), so update
`u` holds exactly the examples of batch `u` without accumulation, `k` consecutive slices of it.
Each micro-batch is padded (its own length bucket) or packed (its own rows) as the loop's
layout says; the `k` are then padded to their common shape (the widest bucket, or the most
rows) so they stack (`stack`), and the step scans over them (`steps._accumulated_grads`): one
update from the real-example-weighted mean of their gradients. Padding added here is masked
like any other: padded rows get `attention_mask` 0, packed rows `segment_ids`/`token_mask` 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import jax
import numpy as np

from isojax.data import batching, packing
from isojax.training import specs


def batches(
    encoded: batching.Encoded,
    spec: specs.FeedSpec,
    *,
    batch_size: int,
    mesh: jax.sharding.Mesh | None = None,
    **kwargs,
) -> Iterator[dict]:
    """This process's rows of `encoded`'s batches: packed into rows of its `max_length`
    with `spec.packing` (`packing.packed_batches`, row counts a multiple of the mesh's local
    devices, default every local device), else padded to `spec.buckets`
    (`batching.batches`). `kwargs`: shuffle, seed, epoch, start_batch, drop_remainder."""
    where = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    if spec.packing:
        local_devices = jax.local_device_count() if mesh is None else mesh.local_mesh.size
        return packing.packed_batches(
            encoded,
            batch_size=batch_size,
            row_buckets=spec.row_buckets,
            row_multiple=local_devices,
            **where,
            **kwargs,
        )
    buckets = spec.buckets or None
    return batching.batches(encoded, batch_size=batch_size, buckets=buckets, **where, **kwargs)


def train_batches(
    encoded: batching.Encoded,
    spec: specs.FeedSpec,
    epoch: int,
    start: int = 0,
    *,
    mesh: jax.sharding.Mesh | None = None,
    batch_size: int | None = None,
) -> Iterator[dict]:
    """This process's rows of the training batches of `epoch` (shuffled by seed and epoch),
    from batch `start` on; the last incomplete batch is dropped (`batches`). `batch_size`:
    default `spec.batch_size`."""
    return batches(
        encoded,
        spec,
        batch_size=batch_size or spec.batch_size,
        mesh=mesh,
        shuffle=True,
        seed=spec.seed,
        epoch=epoch,
        start_batch=start,
        drop_remainder=True,
    )


def update_batches(
    encoded: batching.Encoded,
    spec: specs.FeedSpec,
    epoch: int,
    start: int = 0,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Iterator[dict]:
    """The batches of the optimizer updates of `epoch` from update `start` on: `train_batches`,
    or with `spec.grad_accum_steps = k > 1` each update's `k` micro-batches of
    `batch_size / k` examples stacked (`grouped`)."""
    k = spec.grad_accum_steps
    if k == 1:
        return train_batches(encoded, spec, epoch, start, mesh=mesh)
    micro = train_batches(
        encoded, spec, epoch, start * k, mesh=mesh, batch_size=spec.batch_size // k
    )
    updates = batching.num_batches(len(encoded), spec.batch_size, drop_remainder=True) - start
    return grouped(micro, k, updates, pad_id=encoded.pad_id, process_index=jax.process_index())


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
