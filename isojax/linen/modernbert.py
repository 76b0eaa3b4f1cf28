"""ModernBERT in Flax linen (`isojax.linen.Encoder` for `family="modernbert"` builds its body
here; the BERT family's is `isojax.linen.bert`).

The modules hold the parameter names, shapes and initialisers (`embeddings/word`,
`embeddings/norm`, `layer_i` (`attention/qkv`, `attention/out`, `attention_norm` from layer 1,
`mlp_norm`, `mlp_in`, `mlp_out`), `final_norm`, `pooler/dense`, `pooler/norm`: the Hugging
Face table's layout); the maths is `isojax.models.modernbert`'s pure functions, which the NNX
modules (`isojax.nnx.modernbert`) call too.

ModernBERT has no token type embeddings, and its sentence vector may be the mean of every token
(`classifier_pooling="mean"`) through sliding-window layers, so the encoder refuses
`token_type_ids` and `cls_only=True` in one line each rather than ignore them
(the heads pass neither to it: `isojax.models.heads.segment_ids`, `encoder_options`).
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.linen.bert import Dropout, probs_dropout
from isojax.models import config as config_lib
from isojax.models import modernbert as pure
from isojax.models.transformer import EncoderOutput

__all__ = ["ModernBertAttention", "ModernBertEmbeddings", "ModernBertHead", "ModernBertLayer"]
__all__ += ["encode_modernbert"]


def _dense(cfg: config_lib.EncoderConfig, features: int, bias: bool, name: str, dtype, pdtype):
    return nn.Dense(
        features,
        use_bias=bias,
        dtype=dtype,
        param_dtype=pdtype,
        kernel_init=nn.initializers.normal(cfg.initializer_range),
        name=name,
    )


def _norm(cfg: config_lib.EncoderConfig, name: str, dtype, param_dtype):
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps,
        use_bias=cfg.norm_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        use_fast_variance=False,
        name=name,
    )


class ModernBertAttention(nn.Module):
    """ModernBERT's attention (`isojax.models.modernbert.attention_context`: fused `qkv`,
    RoPE, the window), then `out` and its dropout: `[batch, len, hidden]`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, rope, window, deterministic: bool) -> jax.Array:
        cfg = self.config
        h = x.shape[-1]
        dense = functools.partial(_dense, cfg, dtype=self.dtype, pdtype=self.param_dtype)
        drop = Dropout(cfg.attention_dropout)
        context = pure.attention_context(
            x,
            dense(3 * h, cfg.attention_bias, "qkv"),
            mask,
            rope,
            window,
            cfg.num_heads,
            probs_dropout(drop, cfg.attention_dropout, deterministic),
            cfg.attention_backend,
        )
        return drop(dense(h, cfg.attention_bias, "out")(context), deterministic=deterministic)


class ModernBertLayer(nn.Module):
    """ModernBERT's pre-LN layer (`isojax.models.modernbert.layer`); layer 0 (`first`) has no
    `attention_norm`."""

    config: config_lib.EncoderConfig
    first: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, mask, rope, window, deterministic: bool) -> jax.Array:
        cfg = self.config
        dense = functools.partial(_dense, cfg, dtype=self.dtype, pdtype=self.param_dtype)
        norm = functools.partial(_norm, cfg, dtype=self.dtype, param_dtype=self.param_dtype)
        attention = ModernBertAttention(cfg, self.dtype, self.param_dtype, name="attention")
        drop = Dropout(cfg.mlp_dropout)
        return pure.layer(
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
        x = _norm(cfg, "norm", self.dtype, self.param_dtype)(word(input_ids))
        return Dropout(cfg.hidden_dropout)(x, deterministic=deterministic)


class ModernBertHead(nn.Module):
    """ModernBERT's prediction head on the pooled vector, `norm(act(dense(x)))`
    (`isojax.models.modernbert.head_vector`): `dense`, `norm`; the encoder's `pooler`."""

    config: config_lib.EncoderConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dense = _dense(
            cfg, cfg.hidden_size, cfg.classifier_bias, "dense", self.dtype, self.param_dtype
        )
        return pure.head_vector(cfg, x, dense, _norm(cfg, "norm", self.dtype, self.param_dtype))


def encode_modernbert(
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
    """The body of `isojax.linen.Encoder` for ModernBERT (`isojax.models.modernbert`), run
    inside its `@nn.compact` call: `embeddings/word`, `embeddings/norm`, `layer_i`,
    `final_norm`, `pooler/dense` and `pooler/norm` (the prediction head); the arguments are the
    `Encoder`'s, `token_type_ids` None and `cls_only` False
    (`isojax.models.modernbert.check_unread`)."""
    pure.check_unread(token_type_ids, cls_only)
    cfg, dtype, pdtype = encoder.config, encoder.dtype, encoder.param_dtype
    x = ModernBertEmbeddings(cfg, dtype, pdtype, name="embeddings")(input_ids, deterministic)
    # static_argnums counts self: (self, x, mask, rope, window, deterministic).
    layer = nn.remat(ModernBertLayer, static_argnums=(4, 5)) if encoder.remat else ModernBertLayer
    stack = [
        functools.partial(
            lambda m, y, mask, rope, window: m(y, mask, rope, window, deterministic),
            layer(cfg, i == 0, dtype, pdtype, name=f"layer_{i}"),
        )
        for i in range(cfg.num_layers)
    ]
    head = ModernBertHead(cfg, dtype, pdtype, name="pooler")
    final_norm = _norm(cfg, "final_norm", dtype, pdtype)
    return pure.encode(cfg, x, attention_mask, position_ids, stack, final_norm, head, cls_index)
