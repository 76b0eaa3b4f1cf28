"""Packed batches: the same examples in the same order, and the same training, in fewer rows.

The model checks compare a packed batch with the unpacked batch of the same examples
(`batching.batches`): per-example logits, the loss (mean over real examples), every gradient,
the normaliser's `batch_stats` update, the token statistics (I-STAR, CosReg) and 5 AdamW steps,
for tiny random BERT, RoBERTa, DistilBERT and ALBERT configs (helpers.TINY_HF).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tokenizers
from helpers import LENGTHS, MAX_LENGTH, NUM_LABELS, TINY_HF, both_layouts, shared_head, synthetic

from isojax import linen, models
from isojax.core import penalties
from isojax.data import batching, glue, packing
from isojax.models import config as config_lib
from isojax.models import transformer


def example_tokens(batch, j):
    """`(input_ids, token_type_ids)` of slot `j` of a packed or unpacked host batch."""
    if packing.is_packed(batch):
        row, start = batch["cls_index"][j]
        keep = batch["segment_ids"][row] == j + 1
        assert keep.sum() and keep[start] and not keep[:start].any()
        return batch["input_ids"][row][keep], batch["token_type_ids"][row][keep]
    keep = batch["attention_mask"][j] == 1
    return batch["input_ids"][j][keep], batch["token_type_ids"][j][keep]


# ------------------------------------------------------------------------------------------
# Data: the same examples, in the same order, in few rows.
# ------------------------------------------------------------------------------------------


def test_first_fit_decreasing_places_every_sequence_once():
    lengths = np.array([16, 5, 9, 3, 16, 7, 2, 11, 4])
    row, start, used = packing.first_fit_decreasing(lengths, 16)
    assert used == 5  # 73 tokens need >= 5 rows of 16; FFD finds 5
    occupied = np.zeros((used, 16), int)
    for r, s, n in zip(row, start, lengths, strict=True):
        occupied[r, s : s + n] += 1
    assert occupied.max() == 1 and occupied.sum() == lengths.sum()
    again = packing.first_fit_decreasing(lengths, 16)
    np.testing.assert_array_equal(again[0], row)  # deterministic
    # Every sequence longer than half a row: one row each.
    assert packing.first_fit_decreasing(np.array([9, 12, 16, 10]), 16)[2] == 4
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 16\]"):
        packing.first_fit_decreasing(np.array([3, 17]), 16)


def test_resolve_row_buckets():
    assert packing.resolve_row_buckets(None, 32) == (4, 8, 12, 16, 20, 24, 28, 32)
    assert packing.resolve_row_buckets(None, 3) == (1, 2, 3)
    assert packing.resolve_row_buckets((2, 5, 40), 8) == (2, 5, 8)
    assert packing.resolve_row_buckets(None, 6, multiple=4) == (4, 8)
    assert packing.resolve_row_buckets((2, 5, 40), 8, multiple=2) == (2, 6, 8)
    with pytest.raises(ValueError, match="positive row counts"):
        packing.resolve_row_buckets((0, 4), 8)


@pytest.mark.parametrize("process_count", [1, 2])
def test_packed_batches_hold_the_unpacked_examples_in_order(process_count):
    cfg = config_lib.VARIANTS["tiny"]
    rng = np.random.default_rng(1)
    encoded = synthetic(cfg, rng.integers(2, MAX_LENGTH + 1, 45))
    kw = dict(batch_size=8, shuffle=True, seed=3, epoch=2, process_count=process_count)
    for p in range(process_count):
        packed = list(packing.packed_batches(encoded, process_index=p, **kw))
        plain = list(batching.batches(encoded, process_index=p, **kw))
        assert len(packed) == len(plain) == 6
        for pk, up in zip(packed, plain, strict=True):
            for key in ("labels", "example_mask", "idx"):
                np.testing.assert_array_equal(pk[key], up[key])
            rows = pk["input_ids"].shape[0]
            assert pk["cls_index"][:, 0].min() >= p * rows
            local = {**pk, "cls_index": pk["cls_index"] - [p * rows, 0]}
            for j in np.flatnonzero(up["example_mask"]):
                ids, types = example_tokens(local, j)
                want_ids, want_types = example_tokens(up, j)
                np.testing.assert_array_equal(ids, want_ids)
                np.testing.assert_array_equal(types, want_types)
                row, start = local["cls_index"][j]
                np.testing.assert_array_equal(
                    pk["position_ids"][row][pk["segment_ids"][row] == j + 1], np.arange(len(ids))
                )
            np.testing.assert_array_equal(pk["token_mask"], pk["segment_ids"] > 0)
            assert pk["token_mask"].sum() == packing.token_mask(up).sum()
            assert (pk["input_ids"][pk["token_mask"] == 0] == encoded.pad_id).all()
        # Every process of a global batch has the same row count.
        if p == 0:
            shapes = [b["input_ids"].shape for b in packed]
        assert [b["input_ids"].shape for b in packed] == shapes


def test_packed_eval_counts_every_example_once():
    cfg = config_lib.VARIANTS["tiny"]
    encoded = synthetic(cfg, np.random.default_rng(2).integers(2, MAX_LENGTH + 1, 29))
    seen = []
    for batch in packing.packed_batches(encoded, batch_size=8):
        assert batch["example_mask"].shape == (8,)
        seen.extend(batch["idx"][batch["example_mask"] == 1])
        # Filler examples own no token: they can never enter a statistic.
        fillers = np.flatnonzero(batch["example_mask"] == 0) + 1
        assert not np.isin(batch["segment_ids"], fillers).any()
    np.testing.assert_array_equal(seen, encoded.idx)  # each once, in file order
    assert batch["example_mask"].sum() == 29 - 3 * 8


@pytest.mark.parametrize("task", ["rte", "mrpc", "cola"])
def test_compiled_shapes_over_an_epoch_are_bounded(glue_dir, minilm_dir, task):
    """Real train lengths (MiniLM tokenizer, 128 tokens, batch 32): the row counts of an epoch
    are row buckets, at most `len(resolve_row_buckets(None, 32))` = 8 shapes (the train step
    compiles once per shape), and packing needs far fewer rows than one per example."""
    tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    encoded = batching.encode(glue.load_tsv(glue_dir, task, "train"), tokenizer, 128)
    bound = len(packing.resolve_row_buckets(None, 32))
    assert bound == 8
    shapes, rows = set(), 0
    for epoch in range(2):
        for batch in packing.packed_batches(
            encoded, batch_size=32, shuffle=True, epoch=epoch, drop_remainder=True
        ):
            shapes.add(batch["input_ids"].shape)
            rows += batch["input_ids"].shape[0]
            assert batch["cls_index"].shape == (32, 2)
    assert len(shapes) <= bound
    assert {s[0] for s in shapes} <= set(packing.resolve_row_buckets(None, 32))
    assert {s[1] for s in shapes} == {128}
    tokens = 2 * encoded.lengths.sum()
    assert rows * 128 >= tokens
    # Share of real tokens, epoch 0 (measured): packed RTE 0.86, MRPC 0.83, CoLA 0.71 (a
    # CoLA batch fills 3 rows, rounded up to 4); with the default length buckets 0.52, 0.55,
    # 0.35; padded to 128: 0.52, 0.42, 0.09.
    assert tokens / (rows * 128) > 0.6


def test_row_bucket_of_a_batch_needing_every_row():
    cfg = config_lib.VARIANTS["tiny"]
    encoded = synthetic(cfg, [9, 16, 12, 10, 16, 9])  # each longer than half a row
    (batch,) = packing.packed_batches(encoded, batch_size=6)
    assert batch["input_ids"].shape == (6, MAX_LENGTH)
    assert sorted(batch["cls_index"][:, 0]) == list(range(6))


# ------------------------------------------------------------------------------------------
# Models: the same logits, loss, gradients and statistics.
# ------------------------------------------------------------------------------------------

ALL_ROWS = [9, 16, 12, 10, 16, 9, 11, 14]  # every example needs its own row


def loss_and_stats(head, params, batch_stats, batch):
    """`(loss, (logits, hidden_states, sentence, batch_stats))` of a train-mode forward pass
    (no dropout) with the normaliser's statistics updated; loss = mean CE over real examples."""
    variables = {"params": params, **({"batch_stats": batch_stats} if batch_stats else {})}
    (logits, out), updates = head.apply(
        variables,
        **transformer.model_inputs(batch),
        deterministic=True,
        use_running_average=False,
        example_mask=batch["example_mask"],
        mutable=["batch_stats"],
    )
    weights = batch["example_mask"].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    loss = jnp.sum(ce * weights) / jnp.sum(weights)
    aux = (logits, out["encoder"].hidden_states, out["sentence"], updates.get("batch_stats", {}))
    return loss, aux


@functools.partial(jax.jit, static_argnums=0)  # one program, not op by op
def grad_step(head, params, batch_stats, batch):
    return jax.value_and_grad(functools.partial(loss_and_stats, head), has_aux=True)(
        params, batch_stats, batch
    )


def assert_trees_close(a, b, tol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=tol, atol=tol), a, b)


@pytest.mark.parametrize(
    "family, normalizer, lengths",
    [
        ("bert", "isobn", LENGTHS),
        ("roberta", "isobn", LENGTHS),
        ("distilbert", "batchnorm", LENGTHS),
        ("albert", "batchnorm", LENGTHS),
        ("roberta", "recenter", ALL_ROWS),  # every example in its own row
    ],
)
def test_packed_batch_gives_the_unpacked_logits_loss_gradients_and_stats(
    family, normalizer, lengths
):
    cfg, head, variables = shared_head(family, normalizer)
    plain, packed = both_layouts(cfg, lengths)
    rows = packed["input_ids"].shape[0]
    assert rows < 8 if lengths is LENGTHS else rows == 8  # ALL_ROWS: every row
    params, batch_stats = variables["params"], variables.get("batch_stats", {})
    # Compared on the host: slicing device arrays would compile each slice.
    (loss0, aux0), grads0 = jax.device_get(grad_step(head, params, batch_stats, plain))
    (loss1, aux1), grads1 = jax.device_get(grad_step(head, params, batch_stats, packed))
    logits0, hidden0, sentence0, stats0 = aux0
    logits1, hidden1, sentence1, stats1 = aux1
    real = plain["example_mask"] == 1
    assert logits1.shape == (8, NUM_LABELS)
    np.testing.assert_allclose(logits1[real], logits0[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sentence1[real], sentence0[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5, atol=1e-5)
    assert float(np.abs(grads0["encoder"]["embeddings"]["word"]["embedding"]).max()) > 0
    assert_trees_close(grads1, grads0)
    if normalizer != "recenter":
        assert jax.tree.leaves(stats0) and float(np.abs(stats0["norm"]["count"])) == 1
    assert_trees_close(stats1, stats0)

    # Token statistics see the same token vectors: every example's tokens, every layer.
    for h0, h1 in zip(hidden0, hidden1, strict=True):
        for j in np.flatnonzero(real):
            row, start = packed["cls_index"][j]
            n = int(plain["attention_mask"][j].sum())
            np.testing.assert_allclose(h1[row, start : start + n], h0[j, :n], atol=1e-5)
    mask0, mask1 = packing.token_mask(plain), packing.token_mask(packed)
    for penalty in (  # jitted: op by op, every operation compiled alone per layout
        jax.jit(functools.partial(penalties.istar_penalty, zeta=0.2)),
        jax.jit(lambda h, m: penalties.cosreg_penalty(h[-1], m)),
    ):
        np.testing.assert_allclose(
            penalty(hidden1, mask1), penalty(hidden0, mask0), rtol=1e-5, atol=1e-6
        )


def test_five_adamw_steps_packed_equal_unpacked():
    """Training on packed batches gives the parameters and IsoBN statistics of training on
    unpacked ones (5 AdamW steps over two batches with a filler each), to 1e-4.

    Adam's eps is 1e-6 here: the attention key bias has an exactly zero gradient (softmax
    ignores a shift of all scores), so its float32 gradient is rounding noise (~1e-10) whose
    pattern depends on the layout, and with eps 1e-8 Adam turns that noise into updates of up
    to 0.14 lr that differ between any two layouts (also between two unpacked bucket widths).
    """
    cfg, head, variables = shared_head("bert", "isobn")
    batches = [both_layouts(cfg, LENGTHS, seed=seed) for seed in (1, 2)]
    tx = optax.adamw(1e-3, eps=1e-6, weight_decay=0.01)

    @jax.jit
    def update(params, opt_state, batch_stats, batch):
        (_, aux), grads = grad_step(head, params, batch_stats, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux[3]

    results = []
    for layout in (0, 1):
        params, batch_stats = variables["params"], variables["batch_stats"]
        opt_state = tx.init(params)
        for step in range(5):
            batch = batches[step % 2][layout]
            params, opt_state, batch_stats = update(params, opt_state, batch_stats, batch)
        results.append((params, batch_stats))
    assert_trees_close(results[1], results[0], tol=1e-4)
    moved = jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max()), results[0][0], variables["params"]
    )
    assert (
        moved["classifier"]["kernel"] > 1e-3
        and moved["encoder"]["layer_0"]["mlp_in"]["kernel"] > 1e-3
    )
    assert float(results[0][1]["norm"]["count"]) == 5


def test_unpacked_call_unchanged_and_explicit_positions():
    """Explicit 0-based positions give today's positions (RoBERTa: offset padding_idx + 1);
    a `[b, 1, t, t]` mask that repeats the key mask gives the same values as the `[b, t]` one."""
    for family in ("bert", "roberta"):
        cfg = config_lib.EncoderConfig.from_hf(TINY_HF[family])
        encoder = linen.Encoder(cfg)
        params = linen.init_params(encoder, jax.random.key(0))
        ids = jnp.array([[2, 5, 6, 7, 8], [2, 9, 10, 11, 12]])
        mask = jnp.ones_like(ids)
        given = jnp.broadcast_to(jnp.arange(5), ids.shape)
        np.testing.assert_array_equal(
            models.transformer.position_ids(cfg, ids, given),
            models.transformer.position_ids(cfg, ids),
        )
        apply = jax.jit(encoder.apply)
        base = apply({"params": params}, ids, mask)
        pairwise = jnp.broadcast_to(mask[:, None, None, :], (2, 1, 5, 5))
        again = apply(
            {"params": params},
            ids,
            pairwise,
            position_ids=given,
            cls_index=jnp.array([[1, 0], [0, 0]]),
        )
        np.testing.assert_allclose(again.hidden_states[-1], base.hidden_states[-1], atol=1e-6)
        np.testing.assert_array_equal(again.cls, base.cls[::-1])
    with pytest.raises(ValueError, match=r"cls_index \(3,\) must be \[examples, 2\]"):
        encoder.apply({"params": params}, ids, mask, cls_index=jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="attention_mask"):
        encoder.apply({"params": params}, ids, jnp.ones((2, 5, 5)))


def test_segment_attention_mask():
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    mask = models.transformer.segment_attention_mask(seg)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == jnp.bool_
    want = np.zeros((6, 6), bool)
    want[:2, :2] = want[2:5, 2:5] = True
    np.testing.assert_array_equal(mask[0, 0], want)


def test_packed_rows_sharded_over_devices():
    """Rows sharded over the 4 test devices (`row_multiple=4`) and examples sharded likewise:
    the [CLS] gather across shards gives the single-device logits and IsoBN statistics."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg, head, variables = shared_head("bert", "isobn")
    encoded = synthetic(cfg, LENGTHS + [5, 6, 7, 8, 3, 2, 9, 4, 3], seed=4)
    (batch,) = packing.packed_batches(encoded, batch_size=16, row_multiple=4)
    batch = {k: v for k, v in batch.items() if k != "idx"}
    assert batch["input_ids"].shape[0] % 4 == 0

    @jax.jit
    def forward(variables, batch):
        return head.apply(
            variables,
            **transformer.model_inputs(batch),
            use_running_average=False,
            example_mask=batch["example_mask"],
            mutable=["batch_stats"],
        )

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",))
    sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
    (logits, _), stats = forward(variables, sharded)
    (want, _), want_stats = forward(variables, batch)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(stats, want_stats)
