"""Audit findings on the NNX front end: an evaluation view (`nnx.view(head,
deterministic=True)`) freezes the normaliser's running statistics as linen's
`apply(deterministic=True)` does (finding 10); the head against its linen twin with the same
weights, bit for bit, in float32, bfloat16 and float16 with an all-padding row, a batch of 1,
remat and packed rows (held probes 2-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_encoder_config

from isojax.linen import encoder as linen_encoder
from isojax.nnx import encoder as nnx_encoder
from isojax.nnx import export as nnx_export
from isojax.nnx import heads as nnx_heads
from isojax.nnx import pretrained

TINY = tiny_encoder_config()
IDS = jax.random.randint(jax.random.key(1), (4, 12), 3, 100)


def _head(normalizer: str, dtype=jnp.float32, remat: bool = False):
    encoder = nnx_encoder.Encoder(TINY, dtype=dtype, remat=remat, rngs=nnx.Rngs(0))
    return nnx_heads.SequenceClassifier(
        encoder, 2, normalizer=normalizer, dropout_rate=0.0, dtype=dtype, rngs=nnx.Rngs(1)
    )


@pytest.mark.parametrize("normalizer", ["isobn", "batchnorm", "whiten"])
def test_a_deterministic_view_freezes_the_running_statistics(normalizer):
    """Finding 10: a view giving only `deterministic` sets the normaliser's mode to it; and
    `.eval()` freezes them too (`whiten`: a held probe of the turn-5 audit, issue 50)."""
    head, mask = _head(normalizer), jnp.ones_like(IDS)
    # Each call one program (nnx.jit writes the statistics back through the view), not op by op.
    call = nnx.jit(lambda m: m(IDS, mask))
    head.train()
    before = nnx.state(head, nnx.BatchStat)
    call(nnx.view(head, deterministic=True))
    assert int(head.norm.count[...]) == 0
    jax.tree.map(np.testing.assert_array_equal, nnx.state(head, nnx.BatchStat), before)
    call(nnx.view(head, deterministic=False))  # a training view moves them
    assert int(head.norm.count[...]) == 1
    # An explicit use_running_average still wins over deterministic.
    call(nnx.view(head, deterministic=True, use_running_average=False))
    assert int(head.norm.count[...]) == 2
    moved = nnx.state(head, nnx.BatchStat)
    head.eval()
    call(head)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(head, nnx.BatchStat), moved)


def _batch(kind: str) -> tuple[jax.Array, dict]:
    """`padded`: 4 rows, the last all padding (a filler row); `one`: a batch of 1; `packed`:
    two packed rows holding three examples and a padded third row, one filler example."""
    if kind == "padded":
        mask = jnp.ones((4, 12), jnp.int32).at[1, 7:].set(0).at[3].set(0)
        return IDS, dict(attention_mask=mask, example_mask=jnp.array([1.0, 1.0, 1.0, 0.0]))
    if kind == "one":
        return IDS[:1], dict(attention_mask=jnp.ones((1, 12), jnp.int32))
    segments = jnp.array([[1] * 5 + [2] * 7, [1] * 12, [1] * 6 + [0] * 6, [0] * 12])
    positions = jnp.array([[*range(5), *range(7)], [*range(12)], [*range(6)] + [0] * 6, [0] * 12])
    return IDS, dict(
        attention_mask=linen_encoder.segment_attention_mask(segments),
        position_ids=positions,
        cls_index=jnp.array([[0, 0], [0, 5], [1, 0], [2, 0], [3, 0]]),
        example_mask=jnp.array([1.0, 1.0, 1.0, 1.0, 0.0]),
    )


CASES = [  # (dtype, normalizer, remat, batch)
    ("float32", "isobn", False, "padded"),
    ("bfloat16", "isobn", False, "padded"),
    ("float16", "isobn", False, "padded"),
    ("bfloat16", "batchnorm", False, "padded"),
    ("bfloat16", "batchnorm", False, "one"),
    ("bfloat16", "isobn", True, "padded"),
    ("bfloat16", "isobn", False, "packed"),
    ("float16", "isobn", False, "packed"),
]


@pytest.mark.parametrize("dtype, normalizer, remat, kind", CASES)
def test_nnx_head_is_linen_bit_for_bit(dtype, normalizer, remat, kind):
    """Probes 2-5: train-mode logits and running statistics after one call, then eval-mode
    logits and hidden states, identical to linen's (a batch of 1 is skipped and counted by
    both)."""
    head = _head(normalizer, jnp.dtype(dtype), remat)
    module, variables = nnx_export.to_linen(head)
    ids, batch = _batch(kind)

    @jax.jit
    def linen(variables):
        (train, _), state = module.apply(
            variables, ids, **batch, deterministic=False, mutable=["batch_stats"]
        )
        logits, out = module.apply({**variables, **state}, ids, **batch, deterministic=True)
        return train, state, logits, out["encoder"].hidden_states

    @nnx.jit
    def nnx_calls(head):
        train, _ = head(ids, **batch, deterministic=False)
        logits, out = head(ids, **batch, deterministic=True)
        return train, logits, out["encoder"].hidden_states

    want_train, state, want_logits, want_hidden = linen(variables)
    got_train, got_logits, got_hidden = nnx_calls(head)
    np.testing.assert_array_equal(got_train, want_train)
    np.testing.assert_array_equal(got_logits, want_logits)
    jax.tree.map(np.testing.assert_array_equal, got_hidden, want_hidden)
    got_stats = pretrained.linen_variables(head).get("batch_stats", {})
    jax.tree.map(np.testing.assert_array_equal, got_stats, dict(state).get("batch_stats", {}))
    if kind == "one" and normalizer != "none":
        assert (int(head.norm.count[...]), int(head.norm.skipped[...])) == (0, 1)
