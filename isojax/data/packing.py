"""Packed batches: the examples of one batch laid end to end in few rows of `max_length` tokens.

    encoded = batching.encode(examples, tokenizer, max_length=128)
    for batch in packing.packed_batches(encoded, batch_size=32, shuffle=True, seed=0, epoch=e):
        logits, out = head.apply(
            variables, **transformer.model_inputs(batch), example_mask=batch["example_mask"]
        )

Same training, fewer rows. Global batch `k` holds exactly the examples, in exactly the order,
that `batching.batches` gives with the same arguments (same `epoch_order`, same process
slots, same fillers). Only their layout changes: each process packs its examples into rows of
`encoded.max_length` tokens by first-fit decreasing (longest first, ties in batch order, each
into the first row with room; deterministic), and pads the row count up to the next of a few
row buckets (`resolve_row_buckets`), so a jitted step compiles at most
`len(resolve_row_buckets(row_buckets, batch_size // process_count))` shapes (8 by default).

Each example keeps its own tokens, segment (token type) ids and positions (0 at its [CLS]);
`segment_ids` (the example's slot + 1, 0 for padding) give the attention mask that keeps
attention inside each example (`isojax.models.transformer.segment_attention_mask`), and `cls_index`
points at each example's [CLS], so the head gathers `[b, hidden]` sentence vectors in the
unpacked batch's order. Filler examples (`example_mask` 0, last batch) take no tokens.

What a step must see (identical to the unpacked batch, up to float summation order):
  - per-example arrays `labels`, `example_mask`, `idx` `[b]`: unchanged;
  - sentence vectors `[b, hidden]` gathered by `cls_index`: mask `example_mask`;
  - token statistics (I-STAR, CosReg, C0, dev-set token moments) over `[rows, len]`: mask
    `token_mask(batch)` (real tokens of real examples). Reference-parity `include_padding`
    has no packed equivalent: padding positions do not exist in packed rows.

References:
  Krell et al., `Efficient Sequence Packing without Cross-contamination
  <https://arxiv.org/abs/2107.02027>`_, 2021 (packing with per-sequence attention masks,
  position resets and per-sequence [CLS] gathers).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from isojax.data import batching

# Keys of a packed batch that a step moves to the devices (`idx` stays on the host).
ROW_KEYS = ("input_ids", "token_type_ids", "position_ids", "segment_ids", "token_mask")
EXAMPLE_KEYS = ("cls_index", "labels", "example_mask")
BATCH_KEYS = ROW_KEYS + EXAMPLE_KEYS
DEFAULT_ROW_PARTS = 8


def resolve_row_buckets(
    row_buckets: Sequence[int] | None, max_rows: int, multiple: int = 1
) -> tuple[int, ...]:
    """Sorted row counts a packed batch may take; the last is `max_rows` (every example in a
    row of its own, which always fits), each rounded up to a multiple of `multiple` (e.g. the
    number of local devices the rows are sharded over).

    `None` gives `DEFAULT_ROW_PARTS` evenly spaced counts, `ceil(max_rows * i / 8)` for
    `i = 1..8` (e.g. 4, 8, ..., 32 for 32 examples; duplicates merged for small batches).
    Given counts above `max_rows` are dropped. The length of the result bounds the number of
    compiled shapes of a step over any number of epochs.
    """
    if max_rows < 1 or multiple < 1:
        raise ValueError(f"max_rows {max_rows} and multiple {multiple} must be >= 1")
    if row_buckets is None:
        row_buckets = [math.ceil(max_rows * i / DEFAULT_ROW_PARTS) for i in range(1, 9)]
    if any(int(r) < 1 for r in row_buckets):
        raise ValueError(f"row_buckets must be positive row counts, got {tuple(row_buckets)}")
    top = -(-int(max_rows) // multiple) * multiple
    rounded = {-(-int(r) // multiple) * multiple for r in row_buckets if int(r) < max_rows}
    return (*sorted(rounded - {top}), top)


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Bin-pack sequences into rows of `capacity` tokens, longest first, each into the first
    row with room (ties in input order: deterministic). Uses at most `len(lengths)` rows and at
    most 11/9 OPT + 6/9 (Dósa 2007).

    Args:
      lengths: `[n]` tokens of each sequence, each in `[1, capacity]`.
      capacity: tokens per row.

    Returns:
      `(row [n] int64, start [n] int64, rows_used)`: sequence `i` occupies
      `[start[i], start[i] + lengths[i])` of row `row[i]`.
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(
            f"sequence lengths must lie in [1, {capacity}], got {lengths.min()}..{lengths.max()}"
        )
    n = len(lengths)
    free = np.full(n, capacity, np.int64)  # free tokens per row; n rows always suffice
    row = np.zeros(n, np.int64)
    start = np.zeros(n, np.int64)
    for i in np.argsort(-lengths, kind="stable"):
        r = int(np.argmax(free >= lengths[i]))  # first row with room (an empty row has room)
        row[i], start[i] = r, capacity - free[r]
        free[r] -= lengths[i]
    return row, start, int(row.max()) + 1 if n else 0


def packed_batches(
    encoded: batching.Encoded,
    *,
    batch_size: int,
    row_buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    start_batch: int = 0,
    drop_remainder: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """One epoch of packed batches: this process's share of each global batch.

    Arguments as `batching.batches` (minus `buckets`: rows are `encoded.max_length` long),
    plus `row_buckets` and `row_multiple` (see `resolve_row_buckets`, with `max_rows =
    batch_size // process_count`; `row_multiple`: the local devices a process's rows are
    sharded over). Every process packs every process's examples (cheap, on the host) and
    takes the largest row count, so all processes yield the same shapes and the slices stack
    into one global batch (`jax.make_array_from_process_local_data`).

    Yields:
      dict of numpy arrays, `b = batch_size // process_count` examples in `r` rows (`r` a row
      bucket) of `t = encoded.max_length` tokens:
        input_ids [r, t] int32 (padding `pad_id`), token_type_ids [r, t] int32,
        position_ids [r, t] int32 (0-based within each example, 0 on padding),
        segment_ids [r, t] int32 (example slot + 1; 0 padding),
        token_mask [r, t] int32 (1 on the tokens of real examples),
        cls_index [b, 2] int32 (global row `process_index * r + row`, start) of each
          example's [CLS]; a filler points at this process's first row, position 0,
        labels [b], example_mask [b] int32, idx [b] int64 (-1 filler): as `batching.batches`.
    """
    n = len(encoded)
    total_batches = batching.checked_num_batches(
        n, batch_size, process_index, process_count, start_batch, drop_remainder
    )
    width = encoded.max_length
    lengths = encoded.lengths
    if n and lengths.max() > width:
        raise ValueError(
            f"an encoded row has {lengths.max()} tokens, more than max_length {width}: "
            "encode with this max_length"
        )
    local = batch_size // process_count
    sizes = resolve_row_buckets(row_buckets, local, row_multiple)
    order = batching.epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)

    for k in range(start_batch, total_batches):
        rows = order[k * batch_size : (k + 1) * batch_size]  # [<= batch_size] global batch
        packs = [
            first_fit_decreasing(lengths[rows[q * local : (q + 1) * local]], width)
            for q in range(process_count)
        ]
        num_rows = sizes[int(np.searchsorted(sizes, max(used for _, _, used in packs)))]
        slots = np.arange(process_index * local, (process_index + 1) * local)
        real = slots < len(rows)  # [b]
        chosen = np.where(real, rows[np.minimum(slots, len(rows) - 1)], rows[0])  # [b]
        row, start, _ = packs[process_index]  # [k_real] for this process's real examples
        yield {
            **_pack_tokens(encoded, chosen[real], row, start, num_rows),
            "cls_index": np.stack(
                [
                    process_index * num_rows + np.where(real, _pad(row, local), 0),
                    np.where(real, _pad(start, local), 0),
                ],
                axis=1,
            ).astype(np.int32),
            "labels": encoded.labels[chosen],
            "example_mask": real.astype(np.int32),
            "idx": np.where(real, encoded.idx[chosen], -1),
        }


def _pad(values: np.ndarray, size: int) -> np.ndarray:
    """`values` (the real examples, which come first) zero-padded to `[size]`."""
    out = np.zeros(size, np.int64)
    out[: len(values)] = values
    return out


def _pack_tokens(
    encoded: batching.Encoded,
    examples: np.ndarray,
    row: np.ndarray,
    start: np.ndarray,
    num_rows: int,
) -> dict[str, np.ndarray]:
    """The `[num_rows, max_length]` arrays of `examples` (encoded row ids, real examples in
    slot order) placed at `(row, start)`."""
    width = encoded.max_length
    n_tok = encoded.lengths[examples]  # [k]
    first = np.repeat(np.cumsum(n_tok) - n_tok, n_tok)  # [total] first flat index of its example
    within = np.arange(int(n_tok.sum())) - first  # [total] position inside its example
    dest = np.repeat(row * width + start, n_tok) + within  # [total] flat index in the rows
    src = np.repeat(encoded.offsets[examples], n_tok) + within  # [total] index in token_ids
    shape = (num_rows, width)
    input_ids = np.full(shape, encoded.pad_id, np.int32)
    token_type_ids = np.zeros(shape, np.int32)
    position_ids = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    input_ids.flat[dest] = encoded.token_ids[src]
    token_type_ids.flat[dest] = encoded.type_ids[src]
    position_ids.flat[dest] = within
    segment_ids.flat[dest] = np.repeat(np.arange(1, len(examples) + 1), n_tok)
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "position_ids": position_ids,
        "segment_ids": segment_ids,
        "token_mask": (segment_ids > 0).astype(np.int32),
    }


def is_packed(batch: Mapping) -> bool:
    """True for a batch of `packed_batches`, False for one of `batching.batches`."""
    return "segment_ids" in batch


def token_mask(batch: Mapping):
    """`[rows, len]` the real tokens of real examples, the mask of every token statistic
    (I-STAR, CosReg, C0, dev-set token moments): `token_mask` of a packed batch, or
    `attention_mask * example_mask[:, None]` of an unpacked one (same token vectors)."""
    if is_packed(batch):
        return batch["token_mask"]
    return batch["attention_mask"] * batch["example_mask"][:, None]
