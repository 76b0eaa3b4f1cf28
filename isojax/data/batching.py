"""Tokenise GLUE examples once, then cut fixed-shape, bucketed, shardable batches.

    encoded = batching.encode(examples, tokenizer, max_length=128)
    for batch in batching.batches(encoded, batch_size=32, shuffle=True, seed=0, epoch=epoch):
        ...   # dict of numpy arrays, see `batches`

Shapes: a batch is `[batch_size // process_count, bucket]`, where the bucket is the smallest of
`resolve_buckets(buckets, max_length)` that holds the longest row of the *global* batch, so
every process pads to the same length and a jitted step compiles once per bucket. The last
batch is filled up to `batch_size` with copies of a real row whose `example_mask` is 0, so
evaluation sees every example exactly once and one shape per bucket serves the whole run.

Order: `numpy.random.default_rng((seed, epoch)).permutation(n)`: the same on every process,
another order each epoch, and batch `k` is known without producing batches `0..k-1`
(`start_batch=k` resumes mid-epoch).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from isojax.data import tasks

if TYPE_CHECKING:
    import tokenizers

DEFAULT_BUCKETS = (32, 64, 96, 128, 192, 256)
# The shortest row a pair can be encoded in: [CLS] a [SEP] b [SEP] less one of its tokens.
MIN_LENGTH = 4


class Encoded(NamedTuple):
    """A tokenised split, rows of different lengths concatenated (no padding).

    Row `i` is `token_ids[offsets[i]:offsets[i + 1]]`, with `[CLS] a [SEP] (b [SEP])` special
    tokens already in, truncated longest-first to at most `max_length` tokens.
    """

    token_ids: np.ndarray  # [total] int32
    type_ids: np.ndarray  # [total] int8, segment ids (0: text_a, 1: text_b)
    offsets: np.ndarray  # [n + 1] int64
    labels: np.ndarray  # [n] int32 (class ids) or float32 (regression)
    idx: np.ndarray  # [n] int64, `Example.idx`
    max_length: int
    pad_id: int

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def lengths(self) -> np.ndarray:
        """`[n]` int64 number of tokens of each row, special tokens included."""
        return np.diff(self.offsets)


def _backend(tokenizer) -> tokenizers.Tokenizer:
    import tokenizers  # the 'hf' extra

    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer):
        return backend
    raise TypeError(
        "encode needs a `tokenizers.Tokenizer` or a transformers fast tokenizer (with "
        f"`backend_tokenizer`), got {type(tokenizer).__name__}"
    )


def _pad_id(tokenizer, backend: tokenizers.Tokenizer) -> int | None:
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is not None:
        return int(pad_id)
    if backend.padding is not None:
        return int(backend.padding["pad_id"])
    for token in ("[PAD]", "<pad>"):
        if backend.token_to_id(token) is not None:
            return backend.token_to_id(token)
    return None


def encode(
    examples: Sequence[tasks.Example],
    tokenizer,
    max_length: int,
    *,
    pad_id: int | None = None,
) -> Encoded:
    """Tokenise examples in one batched call of the Rust tokenizer.

    Sentence pairs get segment ids 0/1 from the tokenizer's post-processor; pairs longer than
    `max_length` lose tokens from the longer sentence first (`longest_first`, as
    `tokenizer(a, b, truncation=True, max_length=...)`). The tokenizer is copied: its own
    padding and truncation settings (MiniLM's `tokenizer.json` pads to 128) are not used and
    not changed.

    Args:
      examples: `tasks.Example`s, all single sentences or all pairs.
      tokenizer: a `tokenizers.Tokenizer` or a transformers fast tokenizer.
      max_length: most tokens per row, special tokens included.
      pad_id: padding token id; default: the tokenizer's (`pad_token_id`, its padding
        settings, or the id of "[PAD]"/"<pad>").

    Returns:
      `Encoded`; labels int32, or float32 where the labels are floats (STS-B).
    """
    if not examples:
        raise ValueError("encode needs at least one example")
    pairs = {example.text_b is not None for example in examples}
    if len(pairs) != 1:
        raise ValueError("encode got a mix of single sentences and sentence pairs")
    backend = _backend(tokenizer)
    pad_id = _pad_id(tokenizer, backend) if pad_id is None else pad_id
    if pad_id is None:
        raise ValueError("the tokenizer has no padding token; pass pad_id")
    own = type(backend).from_str(backend.to_str())  # a tokenizers.Tokenizer
    own.no_padding()
    own.enable_truncation(max_length, strategy="longest_first")

    if pairs == {True}:
        inputs = [(example.text_a, example.text_b) for example in examples]
    else:
        inputs = [example.text_a for example in examples]
    # encode_batch_fast (tokenizers >= 0.20) skips character offsets, which are not needed here.
    encode_batch = getattr(own, "encode_batch_fast", own.encode_batch)
    encodings = encode_batch(inputs, add_special_tokens=True)

    lengths = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
    total = int(lengths.sum())
    token_ids = np.fromiter(
        itertools.chain.from_iterable(e.ids for e in encodings), np.int32, total
    )
    type_ids = np.fromiter(
        itertools.chain.from_iterable(e.type_ids for e in encodings), np.int8, total
    )
    offsets = np.zeros(len(encodings) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    regression = any(isinstance(example.label, float) for example in examples)
    labels = np.asarray(
        [example.label for example in examples], np.float32 if regression else np.int32
    )
    return Encoded(
        token_ids=token_ids,
        type_ids=type_ids,
        offsets=offsets,
        labels=labels,
        idx=np.asarray([example.idx for example in examples], np.int64),
        max_length=int(max_length),
        pad_id=int(pad_id),
    )


def resolve_buckets(buckets: Sequence[int] | None, max_length: int) -> tuple[int, ...]:
    """Sorted sequence lengths a batch may take: `buckets` below `max_length`, then `max_length`.

    `None` gives the single fixed shape `(max_length,)`. E.g. `(32, 64, 128)` with
    `max_length=256` -> `(32, 64, 128, 256)`; with `max_length=100` -> `(32, 64, 100)`.
    """
    if buckets is None:
        return (int(max_length),)
    if any(int(b) < 1 for b in buckets):
        raise ValueError(f"buckets must be positive lengths, got {tuple(buckets)}")
    return (*sorted({int(b) for b in buckets if int(b) < max_length}), int(max_length))


def num_batches(num_examples: int, batch_size: int, *, drop_remainder: bool = False) -> int:
    """Batches per epoch: `ceil(n / batch_size)`, or `floor` with `drop_remainder`."""
    if drop_remainder:
        return num_examples // batch_size
    return -(-num_examples // batch_size)


def epoch_order(num_examples: int, *, shuffle: bool, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """`[n]` int64 row order of one epoch: a permutation drawn from (seed, epoch), or `arange`."""
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.default_rng((seed, epoch)).permutation(num_examples).astype(np.int64)


def checked_num_batches(
    num_examples: int,
    batch_size: int,
    process_index: int,
    process_count: int,
    start_batch: int,
    drop_remainder: bool,
) -> int:
    """`num_batches` of an epoch's batches (`batches`, `packing.packed_batches`), after a
    `ValueError` naming the argument that cannot be: a global batch that does not split evenly
    over the processes, a process out of range, or a start past the epoch's last batch."""
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"batch_size {batch_size} must be a positive multiple of process_count {process_count}"
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    total_batches = num_batches(num_examples, batch_size, drop_remainder=drop_remainder)
    if not 0 <= start_batch <= total_batches:
        raise ValueError(f"start_batch {start_batch} not in [0, {total_batches}]")
    return total_batches


def batches(
    encoded: Encoded,
    *,
    batch_size: int,
    buckets: Sequence[int] | None = DEFAULT_BUCKETS,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    start_batch: int = 0,
    drop_remainder: bool = False,
) -> Iterator[dict[str, np.ndarray]]:
    """One epoch of padded batches: this process's slice of each global batch.

    Global batch `k` holds rows `order[k * batch_size:(k + 1) * batch_size]` of `epoch_order`;
    process `p` of `P` takes slots `[p * b, (p + 1) * b)` of it, `b = batch_size // P`. Every
    process computes the same order and the same bucket, so the slices stack into one global
    batch (e.g. `jax.make_array_from_process_local_data`).

    Args:
      encoded: from `encode`.
      batch_size: global batch size, a multiple of `process_count`.
      buckets: candidate sequence lengths (see `resolve_buckets`); None pads to `max_length`.
      shuffle: draw the order from (seed, epoch); False keeps file order (evaluation).
      seed, epoch: the shuffle's key: the same pair gives the same batches.
      process_index, process_count: this process and the number of processes.
      start_batch: first batch to yield (resume mid-epoch after `start_batch` batches).
      drop_remainder: skip the last, incomplete batch (training); default pads it (evaluation).

    Yields:
      dict of numpy arrays, `b = batch_size // process_count`, `t` the batch's bucket:
        input_ids [b, t] int32 (padding: `pad_id`), attention_mask [b, t] int32,
        token_type_ids [b, t] int32, labels [b] int32 or float32,
        example_mask [b] int32 (1 real example, 0 filler that must not count),
        idx [b] int64 (`Example.idx`; -1 for filler).
      Filler rows copy the global batch's first example, so every row is a valid input.
    """
    n = len(encoded)
    total_batches = checked_num_batches(
        n, batch_size, process_index, process_count, start_batch, drop_remainder
    )
    sizes = resolve_buckets(buckets, encoded.max_length)
    order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)
    lengths = encoded.lengths
    local = batch_size // process_count
    slots = np.arange(process_index * local, (process_index + 1) * local)

    for k in range(start_batch, total_batches):
        rows = order[k * batch_size : (k + 1) * batch_size]  # [<= batch_size] global batch
        width = sizes[int(np.searchsorted(sizes, lengths[rows].max()))]
        real = slots < len(rows)  # [b]
        chosen = np.where(real, rows[np.minimum(slots, len(rows) - 1)], rows[0])  # [b]
        row_len = lengths[chosen]  # [b]
        pos = np.arange(width)  # [t]
        valid = pos[None, :] < row_len[:, None]  # [b, t]
        src = encoded.offsets[chosen][:, None] + np.minimum(pos[None, :], row_len[:, None] - 1)
        yield {
            "input_ids": np.where(valid, encoded.token_ids[src], encoded.pad_id).astype(np.int32),
            "attention_mask": valid.astype(np.int32),
            "token_type_ids": np.where(valid, encoded.type_ids[src], 0).astype(np.int32),
            "labels": encoded.labels[chosen],
            "example_mask": real.astype(np.int32),
            "idx": np.where(real, encoded.idx[chosen], -1),
        }
