"""BERT-family encoders (BERT, RoBERTa, DistilBERT, ALBERT) as native Flax NNX modules.

The twin of the linen `isojax.linen.Encoder`, over the same maths: the embeddings
(`transformer.embed`), the attention with its `cls_only` branch (`transformer.attention_context`),
the post-LN layer's wiring (`transformer.transformer_layer`), ALBERT's layer sharing
(`transformer.layer_calls`), the stack, sentence tokens and pooler (`transformer.encode`), the
input checks (`transformer.check_inputs`) and the dropout masks
(`isojax.models.dropout.dropout`). This file holds only the NNX modules: their parameters and
modes.

    enc = Encoder(models.VARIANTS["tiny"], rngs=nnx.Rngs(0))
    out = enc(ids, mask, deterministic=True)          # EncoderOutput, as linen's
    enc.train(); out = enc(ids, mask)                 # dropout from the 'dropout' stream

NNX conventions: the configuration and `rngs` at construction, `dtype` (compute) and
`param_dtype` (float32) as in linen, weights as `nnx.Param` in `nnx.Linear` / `nnx.Embed` /
`nnx.LayerNorm` under the linen names (`embeddings/word/embedding`, `layers/0/attention/query/
kernel`, ALBERT's `groups/0/0/...`), so one path rule (`isojax.nnx.pretrained.linen_path`)
maps them to the linen tree and the Hugging Face tables. The dropout mode is the call's
`deterministic`, else each `Dropout`'s attribute, None by default: `.train()`, `.eval()` and
`nnx.view(model, deterministic=...)` (the `set_view` hook) set it, and with neither the call
raises. Dropout keys come from the `'dropout'` stream of the `rngs` given at construction (an
`nnx.RngStream` per dropout, its counter a Variable, so graph and tree mode both carry it).

Sharding: with `fsdp=True` and a mesh set (`jax.set_mesh(mesh)`, a `"data"` axis), every
parameter carries `out_sharding` metadata from linen's FSDP rule (`isojax.training.distributed`:
each
leaf of at least 1024 elements split along its largest axis the data axis divides), so the
variables are created sharded and `nnx.get_partition_spec(nnx.state(model))` gives the
`PartitionSpec`s of `distributed.state_sharding(..., fsdp=True)`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models import config as config_lib
from isojax.models import dropout as dropout_lib
from isojax.models import modernbert, sharding, transformer
from isojax.models.transformer import EncoderOutput

__all__ = ["Dropout", "Embeddings", "Encoder", "EncoderOutput", "SelfAttention", "TransformerLayer"]


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


def _probs_dropout(dropout: Dropout, deterministic: bool | None):
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


class _Build:
    """What every layer is built with: the config, dtypes, rngs and the sharding switch."""

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

    def __init__(self, build: _Build):
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
            _probs_dropout(self.dropout, deterministic),
            cls_only,
            cls_index,
            self.attention_backend,
        )
        return self.out(context)


class TransformerLayer(nnx.Module):
    """The post-LN layer shared by the four families (`transformer.transformer_layer`)."""

    def __init__(self, build: _Build):
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

    def __init__(self, build: _Build):
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


class ModernBertAttention(nnx.Module):
    """ModernBERT's attention (`modernbert.attention_context`), then `out` and its dropout."""

    def __init__(self, build: _Build):
        cfg = build.cfg
        h = cfg.hidden_size
        self.num_heads, self.attention_backend = cfg.num_heads, cfg.attention_backend
        self.qkv = build.linear(h, 3 * h, cfg.attention_bias)
        self.out = build.linear(h, h, cfg.attention_bias)
        self.dropout = build.dropout(cfg.attention_dropout)

    def __call__(self, x, mask, rope, window, deterministic=None) -> jax.Array:
        def drop(y):
            return self.dropout(y, deterministic=deterministic)

        context = modernbert.attention_context(
            x,
            self.qkv,
            mask,
            rope,
            window,
            self.num_heads,
            _probs_dropout(self.dropout, deterministic),
            self.attention_backend,
        )
        return drop(self.out(context))


class ModernBertLayer(nnx.Module):
    """ModernBERT's pre-LN layer (`modernbert.layer`); layer 0 (`first`) has no
    `attention_norm`."""

    def __init__(self, build: _Build, first: bool):
        cfg = build.cfg
        self.config = cfg
        self.attention = ModernBertAttention(build)
        self.attention_norm = None if first else build.norm(cfg.hidden_size, cfg.norm_bias)
        self.mlp_norm = build.norm(cfg.hidden_size, cfg.norm_bias)
        self.mlp_in = build.linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias)
        self.mlp_out = build.linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)
        self.dropout = build.dropout(cfg.mlp_dropout)

    def __call__(self, x, mask, rope, window, deterministic=None) -> jax.Array:
        return modernbert.layer(
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

    def __init__(self, build: _Build):
        cfg = build.cfg
        self.word = build.embed(cfg.vocab_size)
        self.norm = build.norm(cfg.hidden_size, cfg.norm_bias)
        self.dropout = build.dropout(cfg.hidden_dropout)

    def __call__(self, input_ids, deterministic=None) -> jax.Array:
        return self.dropout(self.norm(self.word(input_ids)), deterministic=deterministic)


class ModernBertHead(nnx.Module):
    """ModernBERT's prediction head, `norm(act(dense(x)))` (`modernbert.head_vector`)."""

    def __init__(self, build: _Build):
        cfg = build.cfg
        self.config = cfg
        self.dense = build.linear(cfg.hidden_size, cfg.hidden_size, cfg.classifier_bias)
        self.norm = build.norm(cfg.hidden_size, cfg.norm_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return modernbert.head_vector(self.config, x, self.dense, self.norm)


class Encoder(nnx.Module):
    """A BERT-family encoder (family from `config.family`), the NNX twin of
    `isojax.linen.Encoder`, called the same way:

        encoder(input_ids [b, t], attention_mask [b, t] or [b, 1, t, t], token_type_ids=None,
                *, position_ids=None, cls_index=None, deterministic=None, cls_only=False)
            -> EncoderOutput(hidden_states, cls, pooled)

    (packed rows: the pairwise `segment_attention_mask`, 0-based `position_ids` within each
    example, `cls_index` `[m, 2]` (row, position) of each example's first token; `cls_only`:
    the last layer at the first tokens only, `hidden_states` then empty).

    Args:
      config: the frozen `EncoderConfig`.
      dtype: compute dtype (float32, or bfloat16 for mixed precision).
      param_dtype: parameter dtype (float32).
      remat: recompute each layer call's activations in the backward pass (`nnx.remat`).
      fsdp: FSDP `out_sharding` metadata over the current mesh (module docstring).
      rngs: `params` keys the initialisers; `dropout` (if any) keys the dropout masks.

    Attributes: `embeddings`, `embedding_projection` (ALBERT, else None), `layers`
    (`nnx.List`; ALBERT: `groups`, an `nnx.List` of `nnx.List`s of shared layers), `pooler`
    (None for DistilBERT).
    """

    def __init__(
        self,
        config: config_lib.EncoderConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        remat: bool = False,
        fsdp: bool = False,
        rngs: nnx.Rngs,
    ):
        build = _Build(config, dtype, param_dtype, rngs, fsdp)
        self.config, self.dtype, self.param_dtype, self.remat = config, dtype, param_dtype, remat
        self.attention_backend = config.attention_backend  # "auto", "xla" or "cudnn"
        if config.family == "modernbert":
            self._init_modernbert(build)
            return
        self.embeddings = Embeddings(build)
        albert = config.family == "albert"
        self.embedding_projection = (
            build.linear(config.embed_dim, config.hidden_size) if albert else None
        )
        if albert:
            self.groups = nnx.List(
                nnx.List(TransformerLayer(build) for _ in range(config.inner_group_num))
                for _ in range(config.num_hidden_groups)
            )
        else:
            self.layers = nnx.List(TransformerLayer(build) for _ in range(config.num_layers))
        self.pooler = (
            build.linear(config.hidden_size, config.hidden_size) if config.has_pooler else None
        )

    def _init_modernbert(self, build: _Build) -> None:
        cfg = build.cfg
        self.embeddings = ModernBertEmbeddings(build)
        self.embedding_projection = None
        self.layers = nnx.List(ModernBertLayer(build, i == 0) for i in range(cfg.num_layers))
        self.final_norm = build.norm(cfg.hidden_size, cfg.norm_bias)
        self.pooler = ModernBertHead(build)

    def _modernbert(self, input_ids, attention_mask, position_ids, cls_index, deterministic):
        def call(layer, y, mask, rope, window):
            return layer(y, mask, rope, window, deterministic)

        if self.remat:  # the window is static: it changes the mask's construction
            call = nnx.remat(call, static_argnums=(4,))
        x = self.embeddings(input_ids, deterministic)
        stack = [functools.partial(call, layer) for layer in self.layers]
        return modernbert.encode(
            self.config,
            x,
            attention_mask,
            position_ids,
            stack,
            self.final_norm,
            self.pooler,
            cls_index,
        )

    def _layer(self, g: int, j: int) -> TransformerLayer:
        return self.groups[g][j] if self.config.family == "albert" else self.layers[g]

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        cls_index: jax.Array | None = None,
        deterministic: bool | None = None,
        cls_only: bool = False,
    ) -> EncoderOutput:
        cfg = self.config
        transformer.check_inputs(
            cfg, input_ids, attention_mask, token_type_ids, position_ids, cls_index
        )
        if cfg.family == "modernbert":
            return self._modernbert(
                input_ids, attention_mask, position_ids, cls_index, deterministic
            )
        x = self.embeddings(input_ids, token_type_ids, deterministic, position_ids)
        if self.embedding_projection is not None:  # ALBERT: [batch, len, E] -> [batch, len, H]
            x = self.embedding_projection(x)

        def call(layer, y, mask, last, index):
            return layer(y, mask, deterministic, last, index)

        if self.remat:  # `last` (cls_only) is static: it changes the layer's shapes
            call = nnx.remat(call, static_argnums=(3,))
        stack = [
            functools.partial(call, self._layer(g, j)) for g, j in transformer.layer_calls(cfg)
        ]
        return transformer.encode(cfg, x, attention_mask, stack, self.pooler, cls_only, cls_index)
