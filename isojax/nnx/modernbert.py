"""ModernBERT as native Flax NNX modules: the body `isojax.nnx.Encoder` builds for
`family="modernbert"` (the BERT family's is `isojax.nnx.bert`), the twin of
`isojax.linen.modernbert` over the same pure maths (`isojax.models.modernbert`), under the linen
names (`embeddings/word`, `layers/i/attention/qkv`, `final_norm`, `pooler/dense`, ...).

ModernBERT has no token type embeddings and its pooling and sliding windows read every token:
the encoder refuses `token_type_ids` and `cls_only=True` in one line each
(`isojax.models.modernbert.check_unread`), as linen's does.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from isojax.models import modernbert as pure
from isojax.models.transformer import EncoderOutput
from isojax.nnx.bert import Build, probs_dropout

__all__ = ["ModernBertAttention", "ModernBertEmbeddings", "ModernBertHead", "ModernBertLayer"]
__all__ += ["encode_modernbert", "init_modernbert"]


class ModernBertAttention(nnx.Module):
    """ModernBERT's attention (`isojax.models.modernbert.attention_context`), then `out` and
    its dropout."""

    def __init__(self, build: Build):
        cfg = build.cfg
        h = cfg.hidden_size
        self.num_heads, self.attention_backend = cfg.num_heads, cfg.attention_backend
        self.qkv = build.linear(h, 3 * h, cfg.attention_bias)
        self.out = build.linear(h, h, cfg.attention_bias)
        self.dropout = build.dropout(cfg.attention_dropout)

    def __call__(self, x, mask, rope, window, deterministic=None) -> jax.Array:
        def drop(y):
            return self.dropout(y, deterministic=deterministic)

        context = pure.attention_context(
            x,
            self.qkv,
            mask,
            rope,
            window,
            self.num_heads,
            probs_dropout(self.dropout, deterministic),
            self.attention_backend,
        )
        return drop(self.out(context))


class ModernBertLayer(nnx.Module):
    """ModernBERT's pre-LN layer (`isojax.models.modernbert.layer`); layer 0 (`first`) has no
    `attention_norm`."""

    def __init__(self, build: Build, first: bool):
        cfg = build.cfg
        self.config = cfg
        self.attention = ModernBertAttention(build)
        self.attention_norm = None if first else build.norm(cfg.hidden_size, cfg.norm_bias)
        self.mlp_norm = build.norm(cfg.hidden_size, cfg.norm_bias)
        self.mlp_in = build.linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.mlp_out = build.linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.dropout = build.dropout(cfg.mlp_dropout)

    def __call__(self, x, mask, rope, window, deterministic=None) -> jax.Array:
        return pure.layer(
            self.config,
            x,
            lambda y: self.attention(y, mask, rope, window, deterministic),
            self.attention_norm,
            self.mlp_norm,
            self.mlp_in,
            self.mlp_out,
            lambda y: self.dropout(y, deterministic=deterministic),
        )


class ModernBertEmbeddings(nnx.Module):
    """ModernBERT's token embeddings, bias-free LayerNorm, dropout."""

    def __init__(self, build: Build):
        cfg = build.cfg
        self.word = build.embed(cfg.vocab_size)
        self.norm = build.norm(cfg.hidden_size, cfg.norm_bias)
        self.dropout = build.dropout(cfg.hidden_dropout)

    def __call__(self, input_ids, deterministic=None) -> jax.Array:
        return self.dropout(self.norm(self.word(input_ids)), deterministic=deterministic)


class ModernBertHead(nnx.Module):
    """ModernBERT's prediction head, `norm(act(dense(x)))`
    (`isojax.models.modernbert.head_vector`)."""

    def __init__(self, build: Build):
        cfg = build.cfg
        self.config = cfg
        self.dense = build.linear(cfg.hidden_size, cfg.hidden_size, cfg.classifier_bias)
        self.norm = build.norm(cfg.hidden_size, cfg.norm_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return pure.head_vector(self.config, x, self.dense, self.norm)


def init_modernbert(encoder: nnx.Module, build: Build) -> None:
    """ModernBERT's modules on `encoder`: `embeddings`, `embedding_projection` (None), `layers`
    (`nnx.List`), `final_norm`, `pooler` (the prediction head)."""
    cfg = build.cfg
    encoder.embeddings = ModernBertEmbeddings(build)
    encoder.embedding_projection = None
    encoder.layers = nnx.List(ModernBertLayer(build, i == 0) for i in range(cfg.num_layers))
    encoder.final_norm = build.norm(cfg.hidden_size, cfg.norm_bias)
    encoder.pooler = ModernBertHead(build)


def encode_modernbert(
    encoder: nnx.Module,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    token_type_ids: jax.Array | None,
    *,
    position_ids: jax.Array | None,
    cls_index: jax.Array | None,
    deterministic: bool | None,
    cls_only: bool,
) -> EncoderOutput:
    """The call of `isojax.nnx.Encoder` for ModernBERT, on the modules of `init_modernbert`;
    the arguments are the `Encoder`'s, `token_type_ids` None and `cls_only` False
    (`isojax.models.modernbert.check_unread`)."""
    pure.check_unread(token_type_ids, cls_only)

    def call(layer, y, mask, rope, window):
        return layer(y, mask, rope, window, deterministic)

    if encoder.remat:  # the window is static: it changes the mask's construction
        call = nnx.remat(call, static_argnums=(4,))
    x = encoder.embeddings(input_ids, deterministic)
    stack = [functools.partial(call, layer) for layer in encoder.layers]
    return pure.encode(
        encoder.config,
        x,
        attention_mask,
        position_ids,
        stack,
        encoder.final_norm,
        encoder.pooler,
        cls_index,
    )
