"""ModernBERT's maths as pure functions: one copy for the linen and the NNX encoders.

ModernBERT (Warner et al. 2024) is a pre-LayerNorm encoder without biases (by default):

    x0 = LN(E[ids])
    a  = x + Wo Attention_RoPE(attn_norm(x))        (attn_norm: the identity on layer 0)
    h  = a + W2 (GELU(u) * g),  [u, g] = W1 mlp_norm(a)          (GeGLU)
    out = final_norm(h_L)

Its attention projects query, key and value with one fused `Wqkv` `[hidden, 3 hidden]` matmul,
rotates query and key by their positions (RoPE, Su et al. 2021: base `rope_theta` 160 000 on
the full-attention layers, `local_rope_theta` 10 000 on the sliding ones) and, on the
`sliding_attention` layers, lets a token see only the tokens within `local_attention // 2`
positions (`transformer.window_mask`). The classifier head pools the final tokens (the first
token, "cls", or the mean over the real tokens, "mean"), then `norm(act(dense(pooled)))`
(transformers' `ModernBertPredictionHead`): that vector is `EncoderOutput.pooled`, what
isojax's head normalises and classifies.

Packed rows (`isojax.data.packing`): RoPE reads `position_ids` (0-based within each example),
the pairwise segment mask is and-ed with the window (a window never crosses an example), and
the mean pooling of an example reads the tokens its first token may attend to.

`hidden_states` are the L layers' outputs, the last one after `final_norm`: transformers'
`output_hidden_states[1:]`.

References:
  Warner et al., `Smarter, Better, Faster, Longer: A Modern Bidirectional Encoder
  <https://arxiv.org/abs/2412.13663>`_, 2024, section 2.1.
  Su et al., `RoFormer <https://arxiv.org/abs/2104.09864>`_, 2021, eq. 34.
  Shazeer, `GLU Variants Improve Transformer <https://arxiv.org/abs/2002.05202>`_, 2020.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from isojax.models import config as config_lib
from isojax.models import transformer, xla_cpu
from isojax.models.transformer import EncoderOutput

Fn = Callable[[jax.Array], jax.Array]


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    r"""`(cos, sin)`, each `[batch, len, head_dim]` float32, of the rotary embedding:
    angle `p / theta^{2i / d}` for frequency i < d / 2, repeated over the two halves (the
    "rotate half" layout of transformers' `ModernBertRotaryEmbedding`)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [b, t, d / 2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    r"""Rotates `x` `[batch, len, heads, head_dim]` by the angles of `cos`, `sin`
    `[batch, len, head_dim]`: :math:`x \cos + \mathrm{rot}(x) \sin` with
    `rot([x1, x2]) = [-x2, x1]`, in float32, returned in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None] + rotated * sin[:, :, None]
    return out.astype(x.dtype)


def attention_context(
    x: jax.Array,
    qkv: Fn,
    mask: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    window: int | None,
    num_heads: int,
    dropout: Fn,
    backend: str = "auto",
) -> jax.Array:
    """Multi-head self-attention before `Wo`: the fused `[hidden, 3 hidden]` projection `qkv`
    (query, key, value in that order, as `Wqkv`), RoPE on query and key, the float32 softmax
    over the keys `mask` allows and, when `window` is set, only within `window` positions
    (`transformer.attend`, through `backend`: `EncoderConfig.attention_backend`; a sliding
    layer always on XLA). `[batch, len, hidden]` -> `[batch, len, hidden]`."""
    b, t, h = x.shape
    projected = qkv(x)
    q, k, v = (projected[..., i * h : (i + 1) * h].reshape(b, t, num_heads, -1) for i in range(3))
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    return transformer.attend(q, k, v, mask, dropout, window, backend=backend).reshape(b, t, h)


def layer(
    cfg: config_lib.EncoderConfig,
    x: jax.Array,
    attention: Fn,
    attention_norm: Fn | None,
    mlp_norm: Fn,
    mlp_in: Fn,
    mlp_out: Fn,
    mlp_dropout: Fn,
) -> jax.Array:
    """The pre-LN layer, `a = x + attention(attn_norm(x))`, `h = a + W2 drop(act(u) * g)` with
    `[u, g] = W1 mlp_norm(a)`; `attention` includes `Wo` and its dropout, `attention_norm`
    None is layer 0's identity."""
    a = x + attention(x if attention_norm is None else attention_norm(x))
    u, gate = jnp.split(mlp_in(mlp_norm(a)), 2, axis=-1)
    act = transformer.activation(cfg.hidden_act)
    return a + mlp_out(mlp_dropout(act(u) * gate))


def mean_pool(x: jax.Array, attention_mask: jax.Array, cls_index: jax.Array | None) -> jax.Array:
    """`[batch or examples, hidden]` float32 mean of the final tokens each example's first token
    may attend to: its row's real tokens (`[batch, len]` mask), or with a pairwise mask and
    `cls_index` (packed rows) the tokens of its own example."""
    keys = transformer.pairwise_mask(attention_mask)  # [b, 1, 1 or t, t]
    x = x.astype(jnp.float32)
    if cls_index is None:
        weights = keys[:, 0, 0]  # [b, t]: a padded row's keys are the same for every query
    else:
        at = cls_index[:, 1] if keys.shape[2] > 1 else 0
        weights = keys[cls_index[:, 0], 0, at]  # [m, t]
        x = transformer.example_rows(x, cls_index)  # [m, t, hidden]
    weights = weights.astype(jnp.float32)
    total = jnp.einsum("mt,mth->mh", weights, x, precision=jax.lax.Precision.HIGHEST)
    return total / jnp.maximum(weights.sum(axis=1, keepdims=True), 1.0)


def head_vector(cfg: config_lib.EncoderConfig, pooled: jax.Array, dense: Fn, norm: Fn) -> jax.Array:
    """transformers' `ModernBertPredictionHead`: `norm(act(dense(pooled)))`."""
    return norm(transformer.activation(cfg.classifier_activation)(dense(pooled)))


def layer_window(cfg: config_lib.EncoderConfig, index: int) -> int | None:
    """The half window of layer `index`: `local_attention // 2` on a sliding layer, else None."""
    sliding = cfg.layer_types[index] == "sliding_attention"
    return cfg.local_attention // 2 if sliding else None


def check_unread(token_type_ids: jax.Array | None, cls_only: bool) -> None:
    """Raises ValueError (one line) for what ModernBERT cannot read: `token_type_ids` (it has
    no token type embeddings) or `cls_only=True` (its mean pooling and sliding windows read
    every token). Both front ends' encoders run it."""
    if token_type_ids is not None:
        raise ValueError(
            f"token_type_ids {tuple(token_type_ids.shape)} given to a ModernBERT encoder, which "
            "has no token type embeddings: pass None"
        )
    if cls_only:
        raise ValueError(
            "cls_only=True given to a ModernBERT encoder, which computes every token (mean "
            "pooling and sliding windows read them): pass False"
        )


def encode(
    cfg: config_lib.EncoderConfig,
    x: jax.Array,
    attention_mask: jax.Array,
    position_ids: jax.Array | None,
    stack: Sequence[Callable[..., jax.Array]],
    final_norm: Fn,
    head: Fn | None,
    cls_index: jax.Array | None = None,
) -> EncoderOutput:
    """The stack over the embeddings `x` `[batch, len, hidden]`, the final norm, the sentence
    tokens and the pooled head vector; the one implementation, called by both front ends.

    Args:
      stack: layer i's call `(x, mask, rope, window) -> x`.
      head: the prediction head (`head_vector` with its weights), or None (`pooled` None).
      position_ids: `[batch, len]` positions within each example (None: 0..len-1).
    """
    b, t = x.shape[:2]
    positions = position_ids
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    head_dim = cfg.hidden_size // cfg.num_heads
    ropes = {
        "full_attention": rope_tables(positions, head_dim, cfg.rope_theta),
        "sliding_attention": rope_tables(positions, head_dim, cfg.local_rope_theta),
    }
    mask = transformer.pairwise_mask(attention_mask)
    hidden_states = []
    for i, call in enumerate(stack):
        x = xla_cpu.residual_boundary(
            call(x, mask, ropes[cfg.layer_types[i]], layer_window(cfg, i))
        )
        hidden_states.append(x)
    x = final_norm(x)
    hidden_states[-1] = x
    cls = transformer.sentence_queries(x, cls_index)[:, 0]
    pooled = None
    if head is not None:
        if cfg.classifier_pooling == "mean":
            pooled_in = mean_pool(x, attention_mask, cls_index).astype(x.dtype)
        else:
            pooled_in = cls
        pooled = head(pooled_in)
    return EncoderOutput(hidden_states=tuple(hidden_states), cls=cls, pooled=pooled)
