"""BERT-family encoders (BERT, RoBERTa, DistilBERT, ALBERT) as native Flax NNX modules: the
body `isojax.nnx.Encoder` builds for these families (ModernBERT's is `isojax.nnx.modernbert`).

The twin of the linen `isojax.linen.bert`, over the same maths: the embeddings
(`transformer.embed`), the attention with its `cls_only` branch (`transformer.attention_context`),
the post-LN layer's wiring (`transformer.transformer_layer`), ALBERT's layer sharing
(`transformer.layer_calls`), the stack, sentence tokens and pooler (`transformer.encode`) and
the dropout masks (`isojax.models.dropout.dropout`). This file holds only the NNX modules: their
parameters (under the linen names) and modes; `Dropout`, `probs_dropout` and `Build` (the
layers' factory, with the FSDP `out_sharding` metadata of `isojax.nnx.encoder`'s docstring)
serve ModernBERT too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models import config as config_lib
from isojax.models import dropout as dropout_lib
from isojax.models import sharding, transformer
from isojax.models.transformer import EncoderOutput

__all__ = ["Build", "Dropout", "Embeddings", "SelfAttention", "TransformerLayer"]
__all__ += ["encode_bert", "init_bert", "probs_dropout"]


def _mode_error(owner: str) -> str:
    return (
        f"{owner}: no deterministic given; pass it to the call, call model.train() / "
        "model.eval(), or use nnx.view(model, deterministic=...)"
    )


class Dropout(nnx.Module):
    """Inverted dropout with isojax's 16-bit masks (`isojax.models.dropout.dropout`), keys
    from an `nnx.RngStream` forked off `rngs['dropout']`; identity when deterministic or at
    rate 0. The mode: the call's `deterministic`, else the attribute (None: raises)."""

    def __init__(
        self, rate: float, *, deterministic: bool | None = None, rngs: nnx.Rngs | None = None
    ):
        self.rate = rate
        self.deterministic = deterministic
        self.rngs = rngs["dropout"].fork() if rngs is not None and rate > 0 else nnx.data(None)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic is None:
            raise ValueError(_mode_error("Dropout"))
        if deterministic or self.rate == 0.0:
            return x
        if self.rate == 1.0:
            return jnp.zeros_like(x)
        if self.rngs is None:
            raise ValueError("Dropout: training needs rngs with a 'dropout' stream")
        return dropout_lib.dropout(x, self.rate, self.rngs())

    def set_view(self, deterministic: bool | None = None):
        """`nnx.view(model, deterministic=...)`: True disables the masks."""
        if deterministic is not None:
            self.deterministic = deterministic


def probs_dropout(dropout: Dropout, deterministic: bool | None):
    """The attention probabilities' dropout, or None when it is the identity (evaluation, or
    rate 0): `transformer.attend` then takes `jax.nn.dot_product_attention`. An unresolved
    mode keeps the call, which raises as every dropout does."""
    mode = dropout.deterministic if deterministic is None else deterministic
    if mode or dropout.rate == 0.0:
        return None
    return lambda p: dropout(p, deterministic=deterministic)


def _sharding(shape: tuple[int, ...], fsdp: bool) -> dict:
    """`out_sharding` metadata of linen's FSDP rule over the current mesh's data axis."""
    if not fsdp:
        return {}
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or sharding.DATA_AXIS not in mesh.axis_names:
        raise ValueError(
            f"fsdp=True needs a mesh with a {sharding.DATA_AXIS!r} axis set "
            "(jax.set_mesh(isojax.training.distributed.make_mesh()))"
        )
    spec = sharding.fsdp_spec(shape, mesh.shape[sharding.DATA_AXIS])
    return {"out_sharding": tuple(spec)} if len(spec) else {}


class Build:
    """What every layer is built with: the config, dtypes, rngs and the sharding switch (the
    ModernBERT modules are built with it too)."""

    def __init__(self, cfg: config_lib.EncoderConfig, dtype, param_dtype, rngs, fsdp: bool):
        self.cfg, self.dtype, self.param_dtype, self.rngs, self.fsdp = (
            cfg, dtype, param_dtype, rngs, fsdp,
        )  # fmt: skip

    def linear(self, n_in: int, n_out: int, use_bias: bool = True) -> nnx.Linear:
        return nnx.Linear(
            n_in,
            n_out,
            use_bias=use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=nnx.initializers.normal(self.cfg.initializer_range),
            kernel_metadata=_sharding((n_in, n_out), self.fsdp),
            bias_metadata=_sharding((n_out,), self.fsdp),
            rngs=self.rngs,
        )

    def norm(self, n: int, use_bias: bool = True) -> nnx.LayerNorm:
        # Two-pass variance, as torch's LayerNorm (and the linen encoder's).
        return nnx.LayerNorm(
            n,
            epsilon=self.cfg.layer_norm_eps,
            use_bias=use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_fast_variance=False,
            scale_metadata=_sharding((n,), self.fsdp),
            bias_metadata=_sharding((n,), self.fsdp),
            rngs=self.rngs,
        )

    def embed(self, n: int, init=None) -> nnx.Embed:
        return nnx.Embed(
            n,
            self.cfg.embed_dim,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            embedding_init=init or nnx.initializers.normal(self.cfg.initializer_range),
            embedding_metadata=_sharding((n, self.cfg.embed_dim), self.fsdp),
            rngs=self.rngs,
        )

    def dropout(self, rate: float) -> Dropout:
        return Dropout(rate, rngs=self.rngs)


class SelfAttention(nnx.Module):
    """Multi-head self-attention (`transformer.attention_context`, then `out`): `[batch, len,
    hidden]`, or `[examples, 1, hidden]` with `cls_only`."""

    def __init__(self, build: Build):
        h = build.cfg.hidden_size
        self.num_heads, self.dtype = build.cfg.num_heads, build.dtype
        self.attention_backend = build.cfg.attention_backend
        self.query, self.key, self.value = (build.linear(h, h) for _ in range(3))
        self.out = build.linear(h, h)
        self.dropout = build.dropout(build.cfg.attention_dropout)

    def __call__(self, x, mask, deterministic=None, cls_only=False, cls_index=None) -> jax.Array:
        projections = (self.query, self.key, self.value)
        context = transformer.attention_context(
            x,
            tuple(p.kernel[...] for p in projections),
            tuple(p.bias[...] for p in projections),
            mask,
            self.num_heads,
            self.dtype,
            probs_dropout(self.dropout, deterministic),
            cls_only,
            cls_index,
            self.attention_backend,
        )
        return self.out(context)


class TransformerLayer(nnx.Module):
    """The post-LN layer shared by the four families (`transformer.transformer_layer`)."""

    def __init__(self, build: Build):
        cfg = build.cfg
        self.config = cfg
        self.attention = SelfAttention(build)
        self.attention_norm = build.norm(cfg.hidden_size)
        self.mlp_in = build.linear(cfg.hidden_size, cfg.intermediate_size)
        self.mlp_out = build.linear(cfg.intermediate_size, cfg.hidden_size)
        self.output_norm = build.norm(cfg.hidden_size)
        self.dropout = build.dropout(cfg.hidden_dropout)

    def __call__(self, x, mask, deterministic=None, cls_only=False, cls_index=None) -> jax.Array:
        def drop(y):
            return self.dropout(y, deterministic=deterministic)

        return transformer.transformer_layer(
            self.config,
            x,
            lambda y: self.attention(y, mask, deterministic, cls_only, cls_index),
            self.attention_norm,
            self.mlp_in,
            self.mlp_out,
            self.output_norm,
            drop,
            drop,
            cls_only,
            cls_index,
        )


class Embeddings(nnx.Module):
    """Token + position (+ segment) embeddings, LayerNorm, dropout (`transformer.embed`)."""

    def __init__(self, build: Build):
        cfg = build.cfg
        self.config = cfg
        self.word = build.embed(cfg.vocab_size)
        self.token_type = build.embed(cfg.type_vocab_size) if cfg.type_vocab_size else None
        sinusoidal = transformer.sinusoidal_init if cfg.sinusoidal_pos_embds else None
        self.position = build.embed(cfg.max_position_embeddings, sinusoidal)
        self.norm = build.norm(cfg.embed_dim)
        self.dropout = build.dropout(cfg.hidden_dropout)

    def __call__(self, input_ids, token_type_ids, deterministic=None, positions=None):
        return transformer.embed(
            self.config,
            input_ids,
            token_type_ids,
            positions,
            self.word,
            self.token_type,
            self.position,
            self.norm,
            lambda y: self.dropout(y, deterministic=deterministic),
        )


def init_bert(encoder: nnx.Module, build: Build) -> None:
    """The BERT family's modules on `encoder`: `embeddings`, `embedding_projection` (ALBERT,
    else None), `layers` (`nnx.List`; ALBERT: `groups`, an `nnx.List` of `nnx.List`s of shared
    layers), `pooler` (None for DistilBERT)."""
    cfg = build.cfg
    encoder.embeddings = Embeddings(build)
    albert = cfg.family == "albert"
    encoder.embedding_projection = build.linear(cfg.embed_dim, cfg.hidden_size) if albert else None
    if albert:
        encoder.groups = nnx.List(
            nnx.List(TransformerLayer(build) for _ in range(cfg.inner_group_num))
            for _ in range(cfg.num_hidden_groups)
        )
    else:
        encoder.layers = nnx.List(TransformerLayer(build) for _ in range(cfg.num_layers))
    encoder.pooler = build.linear(cfg.hidden_size, cfg.hidden_size) if cfg.has_pooler else None


def encode_bert(
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
    """The call of `isojax.nnx.Encoder` for the BERT family, on the modules of `init_bert`; the
    arguments are the `Encoder`'s."""
    cfg = encoder.config
    x = encoder.embeddings(input_ids, token_type_ids, deterministic, position_ids)
    if encoder.embedding_projection is not None:  # ALBERT: [batch, len, E] -> [batch, len, H]
        x = encoder.embedding_projection(x)

    def call(layer, y, mask, last, index):
        return layer(y, mask, deterministic, last, index)

    if encoder.remat:  # `last` (cls_only) is static: it changes the layer's shapes
        call = nnx.remat(call, static_argnums=(3,))

    def layer(g: int, j: int) -> TransformerLayer:
        return encoder.groups[g][j] if cfg.family == "albert" else encoder.layers[g]

    stack = [functools.partial(call, layer(g, j)) for g, j in transformer.layer_calls(cfg)]
    return transformer.encode(cfg, x, attention_mask, stack, encoder.pooler, cls_only, cls_index)
