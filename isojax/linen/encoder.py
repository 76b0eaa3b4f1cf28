"""BERT-family encoders in Flax linen: BERT, RoBERTa, DistilBERT and ALBERT.

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
`isojax.models.transformer`'s pure functions, which the NNX modules (`isojax.nnx.encoder`)
call too. Parameters are float32 (`param_dtype`); `dtype` is the
compute dtype of every matmul.

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
from isojax.models import modernbert
from isojax.models.transformer import (
    EncoderOutput,
    attention_context,
    check_inputs,
    embed,
    encode,
    layer_calls,
    segment_attention_mask,
    sinusoidal_init,
    transformer_layer,
)

__all__ = ["Dropout", "Embeddings", "Encoder", "EncoderOutput", "SelfAttention"]
__all__ += ["TransformerLayer", "init_params", "segment_attention_mask"]


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


def _probs_dropout(drop: Dropout, rate: float, deterministic: bool):
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
            _probs_dropout(drop, cfg.attention_dropout, deterministic),
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


def _mb_dense(cfg: config_lib.EncoderConfig, features: int, bias: bool, name: str, dtype, pdtype):
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=pdtype,
        kernel_init=nn.initializers.normal(cfg.initializer_range),
        name=name,
    )


def _mb_norm(cfg: config_lib.EncoderConfig, name: str, dtype, param_dtype):
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps,
        use_bias=cfg.norm_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        use_fast_variance=False,
        name=name,
    )


class ModernBertAttention(nn.Module):
    """ModernBERT's attention (`modernbert.attention_context`: fused `qkv`, RoPE, the window),
    then `out` and its dropout: `[batch, len, hidden]`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, rope, window, deterministic: bool) -> jax.Array:
        cfg = self.config
        h = x.shape[-1]
        dense = functools.partial(_mb_dense, cfg, dtype=self.dtype, pdtype=self.param_dtype)
        drop = Dropout(cfg.attention_dropout)
        context = modernbert.attention_context(
            x,
            dense(3 * h, cfg.attention_bias, "qkv"),
            mask,
            rope,
            window,
            cfg.num_heads,
            _probs_dropout(drop, cfg.attention_dropout, deterministic),
            cfg.attention_backend,
        )
        return drop(dense(h, cfg.attention_bias, "out")(context), deterministic=deterministic)


class ModernBertLayer(nn.Module):
    """ModernBERT's pre-LN layer (`modernbert.layer`); layer 0 (`first`) has no
    `attention_norm`."""

    config: config_lib.EncoderConfig
    first: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, rope, window, deterministic: bool) -> jax.Array:
        cfg = self.config
        dense = functools.partial(_mb_dense, cfg, dtype=self.dtype, pdtype=self.param_dtype)
        norm = functools.partial(_mb_norm, cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        attention = ModernBertAttention(cfg, self.dtype, self.param_dtype, name="attention")
        drop = Dropout(cfg.mlp_dropout)
        return modernbert.layer(
            cfg,
            x,
            lambda y: attention(y, mask, rope, window, deterministic),
            None if self.first else norm(name="attention_norm"),
            norm(name="mlp_norm"),
            dense(2 * cfg.intermediate_size, cfg.mlp_bias, "mlp_in"),
            dense(cfg.hidden_size, cfg.mlp_bias, "mlp_out"),
            lambda y: drop(y, deterministic=deterministic),
        )


class ModernBertEmbeddings(nn.Module):
    """ModernBERT's token embeddings, bias-free LayerNorm, dropout: `word`, `norm`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool) -> jax.Array:
        cfg = self.config
        word = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=nn.initializers.normal(cfg.initializer_range),
            name="word",
        )
        x = _mb_norm(cfg, "norm", self.dtype, self.param_dtype)(word(input_ids))
        return Dropout(cfg.hidden_dropout)(x, deterministic=deterministic)


class ModernBertHead(nn.Module):
    """ModernBERT's prediction head on the pooled vector, `norm(act(dense(x)))`
    (`modernbert.head_vector`): `dense`, `norm`; the encoder's `pooler`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = _mb_dense(
            cfg, cfg.hidden_size, cfg.classifier_bias, "dense", self.dtype, self.param_dtype
        )
        return modernbert.head_vector(
            cfg, x, dense, _mb_norm(cfg, "norm", self.dtype, self.param_dtype)
        )


class Encoder(nn.Module):
    """A BERT-family encoder (family from `config.family`), or ModernBERT.

    Attributes:
      config: the frozen `EncoderConfig`.
      dtype: compute dtype (float32, or bfloat16 for mixed precision).
      param_dtype: parameter dtype (float32).
      remat: recompute each layer's activations in the backward pass (`nn.remat`): memory
        O(L) layer inputs instead of every intermediate, at about one extra forward.

    Call: `(input_ids [b, t] int, attention_mask, token_type_ids [b, t] | None, *,
    position_ids=None, cls_index=None, deterministic=True, cls_only=False) -> EncoderOutput`,
    where

    - `attention_mask` is `[b, t]` (1 real, 0 padding), or the pairwise `[b, 1, t, t]` mask of
      packed rows (`segment_attention_mask(segment_ids)`);
    - `position_ids` `[b, t]` are 0-based positions within each example (None: 0..t-1 per
      row, RoBERTa's padding-aware count); the family offset is added here;
    - `cls_index` `[m, 2]` int (row, position) of each example's first token (None: token 0
      of every row); `cls` and `pooled` are then `[m, hidden]`, gathered with a static shape;
    - `cls_only` computes the last layer at each example's first token only, its keys and
      values from every token (`TransformerLayer`): the same `cls` and `pooled` (to float
      rounding; dropout draws other masks, of the smaller shapes) for about 5/6 of the last
      layer's work, and `hidden_states` is then empty. For training steps whose loss reads only
      the sentence vector (no token penalty).

    Dropout, when `deterministic=False`, draws from the `'dropout'` rng. Token ids are not
    checked here: an id at or beyond `vocab_size` embeds as NaN (`nn.Embed`'s gather fills
    out-of-range rows with NaN; `isojax.training.build` refuses a tokenizer with more ids than the
    vocabulary). A `cls_index` outside the batch is clamped (JAX's gather).
    """

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    @property
    def attention_backend(self) -> str:  # "auto", "xla" or "cudnn" (isojax.models.attention)
        return self.config.attention_backend

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        cls_index: jax.Array | None = None,
        deterministic: bool = True,
        cls_only: bool = False,
    ) -> EncoderOutput:
        cfg = self.config
        check_inputs(cfg, input_ids, attention_mask, token_type_ids, position_ids, cls_index)
        if cfg.family == "modernbert":
            return self._modernbert(
                input_ids, attention_mask, position_ids, cls_index, deterministic
            )
        x = Embeddings(cfg, self.dtype, self.param_dtype, name="embeddings")(
            input_ids, token_type_ids, deterministic, position_ids
        )
        if cfg.family == "albert":  # [batch, len, E] -> [batch, len, H]
            x = _dense(cfg, cfg.hidden_size, "embedding_projection", self.dtype, self.param_dtype)(
                x
            )

        # static_argnums counts self: (self, x, mask, deterministic, cls_only, cls_index).
        layer = (
            nn.remat(TransformerLayer, static_argnums=(3, 4)) if self.remat else TransformerLayer
        )
        kw = dict(config=cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        if cfg.family == "albert":
            groups = [
                [layer(**kw, name=f"group_{g}_layer_{j}") for j in range(cfg.inner_group_num)]
                for g in range(cfg.num_hidden_groups)
            ]
        else:
            groups = [[layer(**kw, name=f"layer_{i}")] for i in range(cfg.num_layers)]
        stack = [
            # positional: remat's static args
            functools.partial(
                lambda m, y, mask, c, ci: m(y, mask, deterministic, c, ci), groups[g][j]
            )
            for g, j in layer_calls(cfg)
        ]
        pooler = None
        if cfg.has_pooler:
            pooler = _dense(cfg, cfg.hidden_size, "pooler", self.dtype, self.param_dtype)
        return encode(cfg, x, attention_mask, stack, pooler, cls_only, cls_index)

    def _modernbert(self, input_ids, attention_mask, position_ids, cls_index, deterministic):
        """ModernBERT (`isojax.models.modernbert`): `embeddings/word`, `embeddings/norm`,
        `layer_i`, `final_norm`, `pooler/dense` and `pooler/norm` (the prediction head)."""
        cfg, dtype, pdtype = self.config, self.dtype, self.param_dtype
        x = ModernBertEmbeddings(cfg, dtype, pdtype, name="embeddings")(input_ids, deterministic)
        # static_argnums counts self: (self, x, mask, rope, window, deterministic).
        layer = nn.remat(ModernBertLayer, static_argnums=(4, 5)) if self.remat else ModernBertLayer
        stack = [
            functools.partial(
                lambda m, y, mask, rope, window: m(y, mask, rope, window, deterministic),
                layer(cfg, i == 0, dtype, pdtype, name=f"layer_{i}"),
            )
            for i in range(cfg.num_layers)
        ]
        head = ModernBertHead(cfg, dtype, pdtype, name="pooler")
        final_norm = _mb_norm(cfg, "final_norm", dtype, pdtype)
        return modernbert.encode(
            cfg, x, attention_mask, position_ids, stack, final_norm, head, cls_index
        )


def init_params(encoder: Encoder, rng: jax.Array, seq_len: int = 8) -> dict:
    """Random parameters (the `'params'` collection) for `encoder`, as transformers
    initialises: N(0, initializer_range) weights, zero biases, unit LayerNorm scales."""
    ids = jnp.zeros((1, seq_len), jnp.int32)
    return encoder.init(rng, ids, jnp.ones_like(ids))["params"]


def fresh_params(cfg: config_lib.EncoderConfig, rng: jax.Array) -> dict:
    """`init_params` of a float32 `Encoder(cfg)` on one token: the `init` that
    `isojax.models.hf_import.load_weights` takes (the weights a checkpoint lacks, and the
    shapes it must have)."""
    return init_params(Encoder(cfg), rng, seq_len=1)
