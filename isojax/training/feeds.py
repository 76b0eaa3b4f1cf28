"""A run's batches from its config: padded or packed, whole updates or micro-batches.

    for batch in feeds.update_batches(encoded, config, epoch):   # this process's rows
        state, metrics = train_fn(state, distributed.global_batch(batch, mesh, stacked=k > 1))

`batches` chooses the layout (`config.packing`: `data.packing.packed_batches`, else
`data.batching.batches` over `config.buckets`); `train_batches` is an epoch's shuffled training
batches (seed, epoch) from a given batch on, the last incomplete one dropped; `update_batches`
groups them into `config.grad_accum_steps` micro-batches per optimizer update
(`accumulation.grouped`). Every process reads its own rows of the same global batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import ml_collections

from isojax.data import batching, packing
from isojax.training import accumulation


def batches(
    encoded: batching.Encoded,
    config: ml_collections.ConfigDict,
    *,
    batch_size: int,
    mesh: jax.sharding.Mesh | None = None,
    **kwargs,
) -> Iterator[dict]:
    """This process's rows of `encoded`'s batches: packed into rows of `config.max_length`
    with `config.packing` (`packing.packed_batches`, row counts a multiple of the mesh's local
    devices, default every local device), else padded to `config.buckets`
    (`batching.batches`). `kwargs`: shuffle, seed, epoch, start_batch, drop_remainder."""
    where = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    if config.packing:
        local_devices = jax.local_device_count() if mesh is None else mesh.local_mesh.size
        row_buckets = None if config.row_buckets is None else tuple(config.row_buckets)
        return packing.packed_batches(
            encoded,
            batch_size=batch_size,
            row_buckets=row_buckets,
            row_multiple=local_devices,
            **where,
            **kwargs,
        )
    buckets = tuple(config.buckets) or None
    return batching.batches(encoded, batch_size=batch_size, buckets=buckets, **where, **kwargs)


def train_batches(
    encoded: batching.Encoded,
    config: ml_collections.ConfigDict,
    epoch: int,
    start: int = 0,
    *,
    mesh: jax.sharding.Mesh | None = None,
    batch_size: int | None = None,
) -> Iterator[dict]:
    """This process's rows of the training batches of `epoch` (shuffled by seed and epoch),
    from batch `start` on; the last incomplete batch is dropped (`batches`). `batch_size`:
    default `config.batch_size`."""
    return batches(
        encoded,
        config,
        batch_size=batch_size or config.batch_size,
        mesh=mesh,
        shuffle=True,
        seed=config.seed,
        epoch=epoch,
        start_batch=start,
        drop_remainder=True,
    )


def update_batches(
    encoded: batching.Encoded,
    config: ml_collections.ConfigDict,
    epoch: int,
    start: int = 0,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Iterator[dict]:
    """The batches of the optimizer updates of `epoch` from update `start` on: `train_batches`,
    or with `config.grad_accum_steps = k > 1` each update's `k` micro-batches of
    `batch_size / k` examples stacked (`accumulation.grouped`)."""
    k = config.grad_accum_steps
    if k == 1:
        return train_batches(encoded, config, epoch, start, mesh=mesh)
    micro = train_batches(
        encoded, config, epoch, start * k, mesh=mesh, batch_size=config.batch_size // k
    )
    updates = batching.num_batches(len(encoded), config.batch_size, drop_remainder=True) - start
    return accumulation.grouped(
        micro, k, updates, pad_id=encoded.pad_id, process_index=jax.process_index()
    )
