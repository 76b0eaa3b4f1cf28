"""`cls_only`: the encoder's last layer computed at the [CLS] tokens alone gives the logits, the
loss, every gradient and the normaliser's `batch_stats` update of the full encoder (to float
rounding): packed for BERT and ALBERT, padded for BERT (tiny random configs); the train step
uses it exactly when no token penalty reads the tokens.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LENGTHS, both_layouts, shared_head

from isojax import linen
from isojax.data import packing
from isojax.models import transformer
from isojax.training import specs


def loss_and_grads(head, variables, batch, *, cls_only, dropout_key=None):
    """`(loss, logits, batch_stats update, hidden_states), grads`; a smooth loss of every logit of
    the real examples, so that every logit's error reaches the gradients."""

    def loss_fn(params):
        (logits, out), updates = head.apply(
            {**variables, "params": params},
            **transformer.model_inputs(batch),
            deterministic=dropout_key is None,
            use_running_average=False,
            example_mask=batch["example_mask"],
            mutable=["batch_stats"],
            cls_only=cls_only,
            rngs={} if dropout_key is None else {"dropout": dropout_key},
        )
        loss = jnp.sum(jnp.sin(logits) * batch["example_mask"][:, None])
        return loss, (logits, updates, out["encoder"].hidden_states)

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(variables["params"])


def assert_close_to_scale(actual, expected, rel=2e-6):
    """|actual - expected| <= rel * max|expected| leaf by leaf (float32 rounding of sums over
    differently blocked matmuls)."""
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        scale = max(float(jnp.abs(e).max()), 1.0)
        np.testing.assert_allclose(a, e, rtol=0, atol=rel * scale)


@pytest.mark.parametrize(
    "family, layout",
    # Packed rows (the gathered queries, the example_rows keys and values, pairwise masks) for
    # BERT and for ALBERT (shared layers: the last call of a shared layer runs at [CLS] only);
    # padded rows (a static slice of each row's first token) for BERT. RoBERTa and DistilBERT
    # differ only below the layers (positions, embeddings, pooler), which cls_only leaves as
    # they are.
    [("bert", "packed"), ("albert", "packed"), ("bert", "padded")],
)
def test_cls_only_equals_the_full_last_layer(family, layout):
    cfg, head, variables = shared_head(family, "isobn")
    batch = dict(zip(("padded", "packed"), both_layouts(cfg, LENGTHS), strict=True))[layout]
    assert packing.is_packed(batch) == (layout == "packed")
    (loss0, (logits0, stats0, hidden0)), grads0 = loss_and_grads(
        head, variables, batch, cls_only=False
    )
    (loss1, (logits1, stats1, hidden1)), grads1 = loss_and_grads(
        head, variables, batch, cls_only=True
    )
    assert len(hidden0) == cfg.num_layers * cfg.inner_group_num and hidden1 == ()
    np.testing.assert_allclose(logits1, logits0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-5)
    assert_close_to_scale(grads1, grads0)
    assert_close_to_scale(stats1, stats0)
    # The last layer's parameters get their gradient through the [CLS] rows only, and it is
    # not zero: the check above compares real numbers.
    last = "layer_1" if family != "albert" else "group_0_layer_0"
    kernel = grads1["encoder"][last]["mlp_in"]["kernel"]
    assert float(jnp.abs(kernel).max()) > 1e-3


def test_cls_only_in_train_mode_with_remat():
    """Dropout draws the same masks with and without remat, so the two agree; and the result
    differs from eval mode (dropout is on in the last layer too)."""
    cfg, head, variables = shared_head("bert", "batchnorm")
    remat_head = head.clone(encoder=linen.Encoder(cfg, remat=True), dropout_rate=0.1)
    head = head.clone(dropout_rate=0.1)
    _, packed = both_layouts(cfg, LENGTHS)
    key = jax.random.key(3)
    (loss0, (logits0, _, _)), grads0 = loss_and_grads(
        head, variables, packed, cls_only=True, dropout_key=key
    )
    (loss1, (logits1, _, _)), grads1 = loss_and_grads(
        remat_head, variables, packed, cls_only=True, dropout_key=key
    )
    np.testing.assert_allclose(logits1, logits0, rtol=0, atol=1e-5)
    assert_close_to_scale(grads1, grads0, rel=1e-5)  # remat's program rounds differently
    (_, (logits_eval, _, _)), _ = loss_and_grads(head, variables, packed, cls_only=True)
    assert float(jnp.abs(logits_eval - logits0).max()) > 1e-3


def test_the_train_step_skips_tokens_only_without_a_token_penalty():
    assert not specs.ObjectiveSpec().reads_tokens
    assert specs.ObjectiveSpec(penalty="istar", istar=specs.IStarSpec(weight=0.0)).reads_tokens
    assert specs.ObjectiveSpec(penalty="cosreg").reads_tokens  # a metric still at weight 0


class EveryTokenEncoder(linen.Encoder):
    """A user's encoder whose call has no `cls_only` parameter."""

    def __call__(self, input_ids, attention_mask, token_type_ids=None, **kwargs):
        return super().__call__(input_ids, attention_mask, token_type_ids, **kwargs)


def test_an_encoder_without_the_option_computes_every_token():
    cfg, head, variables = shared_head("bert", "none")
    custom = head.clone(encoder=EveryTokenEncoder(cfg))
    _, packed = both_layouts(cfg, LENGTHS)
    (_, (logits, _, hidden)), _ = loss_and_grads(custom, variables, packed, cls_only=True)
    (_, (expected, _, _)), _ = loss_and_grads(head, variables, packed, cls_only=False)
    assert len(hidden) == cfg.num_layers  # every token of every layer: the option was not passed
    np.testing.assert_array_equal(logits, expected)
