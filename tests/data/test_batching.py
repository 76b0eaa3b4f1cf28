"""Tokenisation against the transformers tokenizer; batches: coverage, order, buckets, shards."""

import numpy as np
import pytest
import tokenizers
import transformers

from isojax.data import batching, glue, packing


@pytest.fixture(scope="module")
def hf_tokenizer(minilm_dir):
    return transformers.AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="module")
def rust_tokenizer(minilm_dir):
    return tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def rte_dev(glue_dir, rust_tokenizer):
    return batching.encode(glue.load_tsv(glue_dir, "rte", "dev"), rust_tokenizer, max_length=128)


def _rows(encoded):
    return [
        (encoded.token_ids[a:b], encoded.type_ids[a:b])
        for a, b in zip(encoded.offsets[:-1], encoded.offsets[1:], strict=True)
    ]


@pytest.mark.parametrize("task, max_length", [("rte", 48), ("mrpc", 128), ("cola", 16)])
def test_encode_matches_transformers(glue_dir, hf_tokenizer, rust_tokenizer, task, max_length):
    examples = glue.load_tsv(glue_dir, task, "dev")[:150]
    texts = [e.text_a for e in examples]
    pairs = [e.text_b for e in examples] if examples[0].text_b is not None else None
    ref = hf_tokenizer(texts, pairs, truncation="longest_first", max_length=max_length)
    for tokenizer in (hf_tokenizer, rust_tokenizer):
        encoded = batching.encode(examples, tokenizer, max_length)
        rows = _rows(encoded)
        assert [ids.tolist() for ids, _ in rows] == ref["input_ids"]
        assert [types.tolist() for _, types in rows] == ref["token_type_ids"]
        assert encoded.lengths.max() <= max_length
        assert encoded.pad_id == 0 and len(encoded) == len(examples)
        np.testing.assert_array_equal(encoded.labels, [e.label for e in examples])
        assert encoded.labels.dtype == np.int32 and encoded.token_ids.dtype == np.int32
    if task == "rte":  # 48 tokens is short for RTE: truncation did happen.
        assert (encoded.lengths == max_length).sum() > 50
    # The caller's tokenizer keeps its own settings (MiniLM's tokenizer.json pads to 128).
    assert rust_tokenizer.padding["length"] == 128 and rust_tokenizer.truncation is not None


def test_encode_regression_labels_and_bad_input(glue_dir, rust_tokenizer):
    examples = glue.load_tsv(glue_dir, "stsb", "dev")[:10]
    encoded = batching.encode(examples, rust_tokenizer, 64)
    assert encoded.labels.dtype == np.float32
    np.testing.assert_allclose(encoded.labels, [e.label for e in examples])
    with pytest.raises(ValueError, match="mix of single sentences and sentence pairs"):
        batching.encode([examples[0], examples[1]._replace(text_b=None)], rust_tokenizer, 64)
    with pytest.raises(ValueError, match="at least one example"):
        batching.encode([], rust_tokenizer, 64)
    with pytest.raises(TypeError, match="fast tokenizer"):
        batching.encode(examples, object(), 64)


def test_resolve_buckets():
    assert batching.resolve_buckets((32, 64, 128), 128) == (32, 64, 128)
    assert batching.resolve_buckets((128, 32, 64), 256) == (32, 64, 128, 256)
    assert batching.resolve_buckets((32, 64, 128), 100) == (32, 64, 100)
    assert batching.resolve_buckets(None, 128) == (128,)
    with pytest.raises(ValueError, match="positive"):
        batching.resolve_buckets((0, 32), 64)


@pytest.mark.parametrize(
    "batch_size, process_count",
    [(1, 1), (7, 1), (32, 1), (277, 1), (300, 1), (4, 4), (32, 4), (100, 4), (300, 4)],
)
def test_every_dev_example_once(rte_dev, batch_size, process_count):
    n = len(rte_dev)
    seen, labels, filler = [], [], 0
    for p in range(process_count):
        for batch in batching.batches(
            rte_dev, batch_size=batch_size, process_index=p, process_count=process_count
        ):
            real = batch["example_mask"] == 1
            seen += batch["idx"][real].tolist()
            labels += batch["labels"][real].tolist()
            filler += int((~real).sum())
            assert (batch["idx"][~real] == -1).all()
            assert batch["input_ids"].shape[0] == batch_size // process_count
    assert sorted(seen) == list(range(n))
    np.testing.assert_array_equal(np.array(labels)[np.argsort(seen)], rte_dev.labels)
    assert filler == batching.num_batches(n, batch_size) * batch_size - n


def test_batch_contents_are_the_encoded_rows(rte_dev):
    rows = _rows(rte_dev)
    for batch in batching.batches(rte_dev, batch_size=64, shuffle=True, seed=3):
        assert {k: v.dtype for k, v in batch.items()} == {
            "input_ids": np.int32, "attention_mask": np.int32, "token_type_ids": np.int32,
            "labels": np.int32, "example_mask": np.int32, "idx": np.int64,
        }  # fmt: skip
        width = batch["input_ids"].shape[1]
        first = batch["idx"][0]
        for i in range(len(batch["idx"])):
            row = batch["idx"][i] if batch["example_mask"][i] else first  # filler: a copy
            ids, types = rows[row]
            n = len(ids)
            assert batch["labels"][i] == rte_dev.labels[row]
            np.testing.assert_array_equal(batch["input_ids"][i, :n], ids)
            np.testing.assert_array_equal(batch["token_type_ids"][i, :n], types)
            assert (batch["input_ids"][i, n:] == rte_dev.pad_id).all()
            assert (batch["token_type_ids"][i, n:] == 0).all()
            np.testing.assert_array_equal(batch["attention_mask"][i], np.arange(width) < n)


def _epoch(encoded, **kwargs):
    return list(batching.batches(encoded, batch_size=16, **kwargs))


def _same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


def test_shuffle_is_deterministic_per_seed_and_epoch(rte_dev):
    first = _epoch(rte_dev, shuffle=True, seed=1, epoch=0)
    assert _same(first, _epoch(rte_dev, shuffle=True, seed=1, epoch=0))
    other_epoch = _epoch(rte_dev, shuffle=True, seed=1, epoch=1)
    other_seed = _epoch(rte_dev, shuffle=True, seed=2, epoch=0)
    order = [np.concatenate([b["idx"] for b in e]) for e in (first, other_epoch, other_seed)]
    assert not np.array_equal(order[0], order[1]) and not np.array_equal(order[0], order[2])
    assert all(sorted(o[o >= 0]) == list(range(len(rte_dev))) for o in order)
    unshuffled = np.concatenate([b["idx"] for b in _epoch(rte_dev)])
    assert unshuffled[: len(rte_dev)].tolist() == list(range(len(rte_dev)))


@pytest.mark.parametrize("buckets", [(32, 64, 128), (16, 32, 48, 64, 96), None])
def test_bucketing_bounds_the_number_of_shapes(glue_dir, rust_tokenizer, buckets):
    encoded = batching.encode(glue.load_tsv(glue_dir, "mrpc", "dev"), rust_tokenizer, 128)
    sizes = batching.resolve_buckets(buckets, 128)
    shapes = set()
    for batch in batching.batches(encoded, batch_size=8, buckets=buckets, shuffle=True):
        width = batch["input_ids"].shape[1]
        shapes.add(batch["input_ids"].shape)
        longest = int(batch["attention_mask"].sum(1).max())
        assert width == min(s for s in sizes if s >= longest)  # the smallest bucket that fits
        assert {v.shape[:2] for k, v in batch.items() if v.ndim == 2} == {(8, width)}
    assert len(shapes) <= len(sizes)
    if buckets is not None:
        assert len(shapes) > 1  # MRPC pairs span 32 < length <= 128: bucketing is exercised


def test_processes_slice_the_same_global_batch(rte_dev):
    kwargs = dict(batch_size=32, shuffle=True, seed=5, epoch=2, drop_remainder=False)
    whole = _epoch_all(rte_dev, 1, **kwargs)[0]
    shards = _epoch_all(rte_dev, 4, **kwargs)
    for k, batch in enumerate(whole):
        for key, value in batch.items():
            np.testing.assert_array_equal(
                np.concatenate([shards[p][k][key] for p in range(4)]), value
            )


def _epoch_all(encoded, process_count, **kwargs):
    return [
        list(batching.batches(encoded, process_index=p, process_count=process_count, **kwargs))
        for p in range(process_count)
    ]


def test_resume_mid_epoch_and_drop_remainder(rte_dev):
    kwargs = dict(batch_size=32, shuffle=True, seed=0, epoch=3)
    full = list(batching.batches(rte_dev, **kwargs))
    assert len(full) == batching.num_batches(len(rte_dev), 32) == 9
    assert _same(list(batching.batches(rte_dev, start_batch=5, **kwargs)), full[5:])
    assert list(batching.batches(rte_dev, start_batch=9, **kwargs)) == []
    dropped = list(batching.batches(rte_dev, drop_remainder=True, **kwargs))
    assert len(dropped) == batching.num_batches(len(rte_dev), 32, drop_remainder=True) == 8
    assert all(b["example_mask"].all() for b in dropped) and _same(dropped, full[:8])


@pytest.mark.parametrize("epoch_batches", [batching.batches, packing.packed_batches])
def test_bad_batching_arguments(rte_dev, epoch_batches):
    for size in (0, 6):
        with pytest.raises(ValueError, match=f"batch_size {size} must be a positive multiple"):
            next(epoch_batches(rte_dev, batch_size=size, process_count=4))
    with pytest.raises(ValueError, match=r"process_index 4 not in \[0, 4\)"):
        next(epoch_batches(rte_dev, batch_size=8, process_index=4, process_count=4))
    with pytest.raises(ValueError, match=r"start_batch 10 not in \[0, 9\]"):
        next(epoch_batches(rte_dev, batch_size=32, start_batch=10))


def test_packing_refuses_rows_longer_than_max_length(rte_dev):
    short = batching.Encoded(**{**rte_dev._asdict(), "max_length": int(rte_dev.lengths.max()) - 1})
    with pytest.raises(ValueError, match=f"more than max_length {short.max_length}"):
        next(packing.packed_batches(short, batch_size=32))
