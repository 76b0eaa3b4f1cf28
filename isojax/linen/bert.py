"""The BERT family in Flax linen: BERT, RoBERTa, DistilBERT and ALBERT (`isojax.linen.Encoder`
for these families builds its body here; ModernBERT's is `isojax.linen.modernbert`).

The four families share one post-LayerNorm transformer layer,

    a = LN(x + Dropout(Attention(x)))        h = LN(a + Dropout(W2 act(W1 a)))

and differ only in their embeddings and in the switches of `EncoderConfig` (RoBERTa's
position offset, DistilBERT's missing segment embeddings, pooler and attention-output dropout,
ALBERT's factorised embedding and cross-layer weight sharing). Numerics follow transformers'
PyTorch classes: exact-erf GELU for "gelu", padded keys masked with the float32 minimum, the
softmax in float32 whatever the compute dtype.

Speed (issue 13; profile and measured ratios in `experiments/bench/train_speed.py`): the query,
key and value projections run as one `[hidden, 3 hidden]` matmul whose kernel is concatenated
from the three checkpoint kernels inside the call (the parameter tree is unchanged); the exact
GELU is computed as 0.5 x (1 + erf(x / sqrt 2)), torch's formula, instead of `jax.nn.gelu`'s
erfc form (three XLA:CPU loop fusions); dropout masks compare 16-bit random integers, four per
threefry hash (`isojax.models.dropout`), instead of one float uniform per hash. A training step
whose loss reads only the sentence vector computes the last layer at the [CLS] tokens alone
(`cls_only`: XLA does not narrow a matmul to the rows its consumers read; MiniLM-L6 at
32 x 128: 2.80e11 -> 2.41e11 flops per train step).

Packed rows (`isojax.data.packing`): several examples share one row; the same code path takes
a pairwise `[batch, 1, len, len]` attention mask (`segment_attention_mask`: a token attends
only to the tokens of its own example), explicit `position_ids` (0-based within each example;
the family's offset is added here) and `cls_index` (where each example's [CLS] sits), so every
example is encoded as it would be alone in an unpacked row.

This file holds the linen modules: parameter names, shapes, initialisers and modes (the
checkpoint layout; `tests/linen/test_param_tree.py` pins it). Their maths is
`isojax.models.transformer`'s pure functions, which the NNX modules (`isojax.nnx.bert`) call
too. Parameters are float32 (`param_dtype`); `dtype` is the compute dtype of every matmul.
`Dropout` and `probs_dropout` serve ModernBERT too.

References:
  Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_, eq. 1.
  Devlin et al., `BERT <https://arxiv.org/abs/1810.04805>`_, NAACL 2019, section 3.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.models import config as config_lib
from isojax.models import dropout as dropout_lib
from isojax.models.transformer import (
    EncoderOutput,
    attention_context,
    embed,
    encode,
    layer_calls,
    sinusoidal_init,
    transformer_layer,
)

__all__ = ["Dropout", "Embeddings", "SelfAttention", "TransformerLayer", "encode_bert"]


class Dropout(nn.Module):
    """Inverted dropout (`isojax.models.dropout.dropout`) drawn from the `'dropout'` rng;
    identity when `deterministic` or `rate` is 0."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        return dropout_lib.dropout(x, self.rate, self.make_rng("dropout"))


class DenseParams(nn.Module):
    """The parameters of an `nn.Dense(features)` on `in_features` inputs, same names, shapes
    and initialisers (`kernel` `[in, out]` N(0, initializer_range), `bias` zeros), returned
    instead of applied: lets `SelfAttention` fuse several projections into one matmul while
    the parameter tree (the checkpoint layout) stays that of separate `nn.Dense` layers."""

    config: config_lib.EncoderConfig
    in_features: int
    features: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        init = nn.initializers.normal(self.config.initializer_range)
        kernel = self.param("kernel", init, (self.in_features, self.features), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
        return kernel, bias


def _dense(cfg: config_lib.EncoderConfig, features: int, name: str, dtype, param_dtype):
    return nn.Dense(
        features,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=nn.initializers.normal(cfg.initializer_range),
        name=name,
    )


def _layer_norm(cfg: config_lib.EncoderConfig, name: str, dtype, param_dtype):
    # Two-pass variance, as torch's LayerNorm: E[x^2] - E[x]^2 loses digits on BERT's
    # large-magnitude outlier dimensions.
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps,
        dtype=dtype,
        param_dtype=param_dtype,
        use_fast_variance=False,
        name=name,
    )


def probs_dropout(drop: Dropout, rate: float, deterministic: bool):
    """The attention probabilities' dropout, or None when it is the identity (evaluation, or
    rate 0): `transformer.attend` then takes `jax.nn.dot_product_attention`."""
    if deterministic or rate == 0.0:
        return None
    return lambda p: drop(p, deterministic=False)


class SelfAttention(nn.Module):
    """Multi-head self-attention: query/key/value/out projections, `[batch, len, hidden]`
    (`attention_context`, then the `out` projection).

    The query, key and value projections are one `[hidden, 3 hidden]` matmul (their kernels
    concatenated in the call, kept as three `nn.Dense`-shaped parameters `query`, `key`,
    `value`). With `cls_only` the output is `[examples, 1, hidden]`, equal to those rows of the
    full output.
    """

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        deterministic: bool,
        cls_only: bool = False,
        cls_index: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        h = x.shape[-1]
        projections = [
            DenseParams(cfg, h, h, self.param_dtype, name=n)() for n in ("query", "key", "value")
        ]
        kernels, biases = zip(*projections, strict=True)
        drop = Dropout(cfg.attention_dropout)
        context = attention_context(
            x,
            kernels,
            biases,
            mask,
            cfg.num_heads,
            self.dtype,
            probs_dropout(drop, cfg.attention_dropout, deterministic),
            cls_only,
            cls_index,
            cfg.attention_backend,
        )
        return _dense(cfg, h, "out", self.dtype, self.param_dtype)(context)


class TransformerLayer(nn.Module):
    """Post-LN transformer layer shared by the four families (`[batch, len, hidden]`).

    With `cls_only`, the layer is computed at each example's first token only (keys and values
    from every token): `[examples, 1, hidden]`, the rows `sentence_queries` picks of the full
    output. The last layer runs so when nothing reads its other tokens.
    """

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array,
        deterministic: bool,
        cls_only: bool = False,
        cls_index: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        dense = functools.partial(_dense, cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        norm = functools.partial(_layer_norm, cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        attention = SelfAttention(cfg, self.dtype, self.param_dtype, name="attention")
        # Constructed in this order, so the dropouts keep their names (Dropout_0, Dropout_1)
        # and their rngs.
        drop_a = Dropout(cfg.hidden_dropout) if cfg.attention_output_dropout else None
        attention_norm = norm(name="attention_norm")
        mlp_in = dense(cfg.intermediate_size, name="mlp_in")
        mlp_out = dense(cfg.hidden_size, name="mlp_out")
        drop_f = Dropout(cfg.hidden_dropout) if cfg.ffn_output_dropout else None
        return transformer_layer(
            cfg,
            x,
            lambda y: attention(y, mask, deterministic, cls_only, cls_index),
            attention_norm,
            mlp_in,
            mlp_out,
            norm(name="output_norm"),
            lambda y: drop_a(y, deterministic=deterministic),
            lambda y: drop_f(y, deterministic=deterministic),
            cls_only,
            cls_index,
        )


class Embeddings(nn.Module):
    """Token + position (+ segment) embeddings, LayerNorm, dropout: `[batch, len, E]`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, deterministic: bool, positions=None) -> jax.Array:
        cfg = self.config
        embed_layer = functools.partial(
            nn.Embed,
            features=cfg.embed_dim,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(cfg.initializer_range),
        )
        token_type = None
        if cfg.type_vocab_size:
            token_type = embed_layer(cfg.type_vocab_size, name="token_type")
        pos_init = {"embedding_init": sinusoidal_init} if cfg.sinusoidal_pos_embds else {}
        drop = Dropout(cfg.hidden_dropout)
        return embed(
            cfg,
            input_ids,
            token_type_ids,
            positions,
            embed_layer(cfg.vocab_size, name="word"),
            token_type,
            embed_layer(cfg.max_position_embeddings, name="position", **pos_init),
            _layer_norm(cfg, "norm", self.dtype, self.param_dtype),
            lambda y: drop(y, deterministic=deterministic),
        )


def encode_bert(
    encoder: nn.Module,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    token_type_ids: jax.Array | None,
    *,
    position_ids: jax.Array | None,
    cls_index: jax.Array | None,
    deterministic: bool,
    cls_only: bool,
) -> EncoderOutput:
    """The body of `isojax.linen.Encoder` for the BERT family, run inside its `@nn.compact`
    call (the submodules are `encoder`'s: `embeddings`, ALBERT's `embedding_projection`,
    `layer_i` or ALBERT's `group_g_layer_j`, `pooler`); the arguments are the `Encoder`'s."""
    cfg, dtype, pdtype = encoder.config, encoder.dtype, encoder.param_dtype
    x = Embeddings(cfg, dtype, pdtype, name="embeddings")(
        input_ids, token_type_ids, deterministic, position_ids
    )
    if cfg.family == "albert":  # [batch, len, E] -> [batch, len, H]
        x = _dense(cfg, cfg.hidden_size, "embedding_projection", dtype, pdtype)(x)

    # static_argnums counts self: (self, x, mask, deterministic, cls_only, cls_index).
    layer = nn.remat(TransformerLayer, static_argnums=(3, 4)) if encoder.remat else TransformerLayer
    kw = dict(config=cfg, dtype=dtype, param_dtype=pdtype)
    if cfg.family == "albert":
        groups = [
            [layer(**kw, name=f"group_{g}_layer_{j}") for j in range(cfg.inner_group_num)]
            for g in range(cfg.num_hidden_groups)
        ]
    else:
        groups = [[layer(**kw, name=f"layer_{i}")] for i in range(cfg.num_layers)]
    stack = [
        # positional: remat's static args
        functools.partial(lambda m, y, mask, c, ci: m(y, mask, deterministic, c, ci), groups[g][j])
        for g, j in layer_calls(cfg)
    ]
    pooler = _dense(cfg, cfg.hidden_size, "pooler", dtype, pdtype) if cfg.has_pooler else None
    return encode(cfg, x, attention_mask, stack, pooler, cls_only, cls_index)
