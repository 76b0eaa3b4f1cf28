"""`transformer.attend` (`jax.nn.dot_product_attention`) against its einsum reference
(`attend_reference`), in float32: padding masks, packed segments, windows, every family."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import LENGTHS, TINY_HF, both_layouts, shared_head

from isojax import linen
from isojax.models import config as config_lib
from isojax.models import transformer


def _qkv(b=3, q_len=20, k_len=20, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = 2.0 * jax.random.normal(keys[0], (b, q_len, 4, 8))
    k, v = (2.0 * jax.random.normal(key, (b, k_len, 4, 8)) for key in keys[1:])
    return q, k, v


def _masks(b=3, t=20):
    lengths = np.array([t, 13, 4])[:b]
    padded = jnp.asarray(np.arange(t)[None] < lengths[:, None])
    segments = np.zeros((b, t), np.int32)
    segments[0, :7], segments[0, 7:15], segments[1, :12], segments[2, 2:5] = 1, 2, 1, 1
    return {"padded": padded, "segments": transformer.segment_attention_mask(segments)}


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("kind", ["padded", "segments"])
def test_attend_equals_the_einsum_reference(kind, window):
    q, k, v = _qkv()
    mask = _masks()[kind]
    got = jax.jit(transformer.attend, static_argnums=(4, 5))(q, k, v, mask, None, window)
    want = transformer.attend_reference(q, k, v, mask, None, window)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_one_query_rows_equal_the_reference():
    """`cls_only`'s shapes: one query per example against its row's keys."""
    q, k, v = _qkv(q_len=1)
    mask = _masks()["padded"][:, None, None, :]
    np.testing.assert_allclose(
        transformer.attend(q, k, v, mask), transformer.attend_reference(q, k, v, mask), atol=1e-6
    )


@functools.cache  # one head for both layouts
def _modernbert_head():
    hf = {"model_type": "modernbert", "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
          "intermediate_size": 48, "num_hidden_layers": 3, "local_attention": 4,
          "max_position_embeddings": 64, "pad_token_id": 0}  # fmt: skip
    cfg = config_lib.EncoderConfig.from_hf(hf)
    head = linen.SequenceClassifier(linen.Encoder(cfg), num_labels=3, dropout_rate=0.0)
    return cfg, head, linen.init_variables(head, jax.random.key(0))


@pytest.mark.parametrize("family", [*TINY_HF, "modernbert"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_family_is_unchanged(family, layout, monkeypatch):
    """Every hidden state and the logits of a padded and a packed batch: the fused path
    within 1e-6 of the einsum one."""
    if family == "modernbert":
        cfg, head, variables = _modernbert_head()
    else:
        cfg, head, variables = shared_head(family, "none")
    batch = dict(zip(("padded", "packed"), both_layouts(cfg, LENGTHS), strict=True))[layout]
    inputs = transformer.model_inputs(batch)
    if not cfg.type_vocab_size:
        inputs["token_type_ids"] = None

    def run():
        return jax.jit(lambda v, i: head.apply(v, **i))(variables, inputs)

    logits, extras = run()

    def reference(*args, backend="auto", packed=None):  # attend's keywords, the einsum path
        return transformer.attend_reference(*args)

    monkeypatch.setattr(transformer, "attend", reference)
    want_logits, want = run()
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-6)
    for got, ref in zip(
        extras["encoder"].hidden_states, want["encoder"].hidden_states, strict=True
    ):
        scale = max(1.0, float(jnp.abs(ref).max()))
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * scale)
