"""The BERT-family encoder's maths as pure functions: one copy for both front ends.

The linen modules (`isojax.linen.bert`) and the NNX modules (`isojax.nnx.bert`) hold only
parameters and modes; they call these functions with their layers as callables, so the two
front ends cannot drift apart. Every family runs the same post-LayerNorm layer,

    a = LN(x + Dropout(Attention(x)))        h = LN(a + Dropout(W2 act(W1 a)))

(`transformer_layer`), over `embed`'s token + position (+ segment) embeddings, with
`attention_context`'s fused query/key/value projection and float32 softmax (`attention_probs`),
ALBERT's shared layers (`layer_calls`) and the stack, sentence tokens and pooler (`encode`).

Shapes: rows `[batch, len, hidden]`; masks `[batch, len]` (keys) or pairwise
`[batch, 1, len, len]` (packed rows, `segment_attention_mask`); `cls_index` `[examples, 2]`
(row, position) of each example's first token. Numerics follow transformers' PyTorch classes:
exact-erf GELU for "gelu", disallowed keys at the float32 minimum, softmax in float32.

References:
  Vaswani et al., `Attention Is All You Need <https://arxiv.org/abs/1706.03762>`_, eq. 1.
  Devlin et al., `BERT <https://arxiv.org/abs/1810.04805>`_, NAACL 2019, section 3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from isojax.models import attention as attention_lib
from isojax.models import config as config_lib


def gelu_exact(x: jax.Array) -> jax.Array:
    r"""The exact (erf) GELU, in `x`'s dtype, as transformers' "gelu" (torch's formula).

    .. math:: \mathrm{GELU}(x) = \tfrac12 x \left(1 + \mathrm{erf}(x / \sqrt 2)\right)

    Same function as `jax.nn.gelu(x, approximate=False)`, whose erfc form XLA:CPU expands into
    three loop fusions with an exponential; erf is one rational polynomial (measured: the MiniLM
    forward GELU costs about a third less). Hendrycks & Gimpel, `GELUs
    <https://arxiv.org/abs/1606.08415>`_, section 2.
    """
    return 0.5 * x * (1.0 + jax.lax.erf(x * np.sqrt(0.5).astype(x.dtype)))


_ACTIVATIONS = {
    "gelu": gelu_exact,  # HF "gelu" is the erf form
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),  # tanh form
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "tanh": jnp.tanh,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation a Hugging Face config names ("gelu" is the exact erf form)."""
    return _ACTIVATIONS[name]


@flax.struct.dataclass
class EncoderOutput:
    """What every encoder returns.

    Attributes:
      hidden_states: one `[batch, len, hidden]` array per transformer layer call (the
        embedding output is not included), in the compute dtype; empty with `cls_only`.
      cls: `[batch, hidden]` the last layer's first token of each row; with `cls_index`,
        `[examples, hidden]` the last layer's token at each example's (row, start).
      pooled: `[batch or examples, hidden]` tanh(W cls + b), or None for families without a
        pooler.
    """

    hidden_states: tuple[jax.Array, ...]
    cls: jax.Array
    pooled: jax.Array | None


def segment_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """`[batch, 1, len, len]` bool: query q may attend to key k of the same row iff both carry
    the same nonzero segment (example) id; segment 0 is padding and is never attended to.

    Args:
      segment_ids: `[batch, len]` int, one id per example packed in the row (0: padding).
    """
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [batch, q_len, k_len]
    return (same & (segment_ids[:, None, :] != 0))[:, None]


def pairwise_mask(mask: jax.Array) -> jax.Array:
    """The encoder's attention mask as bool: a `[batch, k_len]` key mask -> `[batch, 1, 1,
    k_len]`; a `[batch, 1, q_len, k_len]` pairwise mask stays as it is."""
    keep = mask.astype(bool)
    return keep[:, None, None, :] if keep.ndim == 2 else keep


def attention_probs(query: jax.Array, key: jax.Array, mask: jax.Array) -> jax.Array:
    r"""Scaled dot-product attention weights over the allowed keys, in float32.

    .. math:: P = \mathrm{softmax}(Q K^\top / \sqrt{d_k} + M), \quad M_{bqk} = \min_{f32}
       \text{ where query } q \text{ of row } b \text{ may not see key } k.

    A query that may see no key at all (padding of a packed row) gets uniform weights: finite,
    and never read.

    Args:
      query: `[batch, q_len, heads, head_dim]`, any float dtype.
      key: `[batch, k_len, heads, head_dim]`.
      mask: `[batch, k_len]` nonzero for real tokens, or `[batch, 1, q_len, k_len]` pairwise
        (e.g. `segment_attention_mask`).

    Returns:
      `[batch, heads, q_len, k_len]` float32 probabilities (rows sum to 1).
    """
    scale = query.shape[-1] ** -0.5
    scores = jnp.einsum("bqnd,bknd->bnqk", query, key, preferred_element_type=jnp.float32)
    scores = scores.astype(jnp.float32) * scale
    keep = pairwise_mask(mask)  # [batch, 1, 1 or q_len, k_len]
    scores = jnp.where(keep, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.softmax(scores, axis=-1)


def sentence_queries(x: jax.Array, cls_index: jax.Array | None) -> jax.Array:
    """`[examples, 1, ...]` each example's first token: `x[:, :1]` of `[batch, len, ...]` rows,
    or, with `cls_index` `[examples, 2]` (row, position), the token at each (row, position)."""
    if cls_index is None:
        return x[:, :1]
    return x[cls_index[:, 0], cls_index[:, 1]][:, None]


def example_rows(x: jax.Array, cls_index: jax.Array) -> jax.Array:
    """`[examples, len, ...]` the row of each example (`cls_index[:, 0]`) of `[batch, len, ...]`.

    A one-hot matmul rather than a gather: its backward pass is a matmul too (a gather's is a
    scatter-add, serial on XLA:CPU), and it is exact, every output being one input times 1
    (HIGHEST precision, so TPUs do not round float32 rows to bfloat16).
    """
    one_hot = jax.nn.one_hot(cls_index[:, 0], x.shape[0], dtype=x.dtype)  # [examples, batch]
    return jnp.einsum("mb,b...->m...", one_hot, x, precision=jax.lax.Precision.HIGHEST)


def attention_context(
    x: jax.Array,
    kernels: tuple[jax.Array, jax.Array, jax.Array],
    biases: tuple[jax.Array, jax.Array, jax.Array],
    mask: jax.Array,
    num_heads: int,
    dtype: Any,
    dropout: Callable[[jax.Array], jax.Array] | None,
    cls_only: bool = False,
    cls_index: jax.Array | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Multi-head self-attention before its output projection: `[batch, len, hidden]` ->
    `[batch, len, hidden]` context (`[examples, 1, hidden]` with `cls_only`).

    The one implementation, called by the linen `SelfAttention` and by
    `isojax.nnx.bert.SelfAttention`. The query, key and value projections run as one
    `[hidden, 3 hidden]` matmul, their kernels concatenated here. With `cls_only` only each
    example's first token queries (`sentence_queries`): keys and values are still projected
    for every token, and with `cls_index` each example attends within its own row.

    Args:
      x: `[batch, len, hidden]`.
      kernels, biases: the query, key and value projections' `[hidden, hidden]` kernels and
        `[hidden]` biases.
      mask: the encoder's `[batch, 1, 1 or len, len]` bool mask (`pairwise_mask`).
      num_heads: attention heads (hidden is a multiple).
      dtype: compute dtype of the projections.
      dropout: applied to the `[batch, heads, queries, len]` float32 probabilities; None:
        none (`attend`'s fused path).
      cls_only, cls_index: as `Encoder`'s.
      backend: `EncoderConfig.attention_backend` (`attend`).
    """
    b, t, h = x.shape
    split = (num_heads, h // num_heads)
    kernel = jnp.concatenate(kernels, axis=1).astype(dtype)  # [hidden, 3 hidden]
    bias = jnp.concatenate(biases).astype(dtype)
    x = x.astype(dtype)
    if not cls_only:
        qkv = jnp.dot(x, kernel) + bias
        q, k, v = (qkv[..., i * h : (i + 1) * h].reshape(b, t, *split) for i in range(3))
    else:
        queries = sentence_queries(x, cls_index)  # [m, 1, hidden]
        q = (jnp.dot(queries, kernel[:, :h]) + bias[:h]).reshape(-1, 1, *split)
        kv = jnp.dot(x, kernel[:, h:]) + bias[h:]  # [b, t, 2 hidden]
        if cls_index is None:
            mask = mask[:, :, :1]  # [b, 1, 1, t]: the first query's keys
        else:  # each example attends within its own row: [m, t, 2 hidden], [m, 1, 1, t]
            kv = example_rows(kv, cls_index)
            at = cls_index[:, 1] if mask.shape[2] > 1 else 0
            mask = mask[cls_index[:, 0], :, at][:, :, None]
        k, v = (kv[..., i * h : (i + 1) * h].reshape(*kv.shape[:2], *split) for i in range(2))
    # q: [batch or m, queries, heads, head_dim]; k, v: [batch or m, len, heads, head_dim]
    packed = mask.shape[2] > 1 or cls_index is not None  # segment masks, or rows of examples
    return attend(q, k, v, mask, dropout, backend=backend, packed=packed).reshape(*q.shape[:2], h)


def window_mask(q_len: int, k_len: int, half: int) -> jax.Array:
    """`[1, 1, q_len, k_len]` bool: query q sees key k iff |q - k| <= `half` (a sliding window
    of 2 half + 1 tokens, ModernBERT's local layers: transformers'
    `sliding_window_bidirectional_overlay(local_attention // 2)`)."""
    distance = jnp.arange(q_len)[:, None] - jnp.arange(k_len)[None, :]
    return (jnp.abs(distance) <= half)[None, None]


def attend_reference(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    window: int | None = None,
) -> jax.Array:
    """`attend` written out: the einsum scores, the float32 softmax (`attention_probs`),
    `dropout` on the probabilities, the einsum with the values. The path of a training step
    with attention dropout (`jax.nn.dot_product_attention` has none), and the tests'
    reference for `attend`."""
    mask = pairwise_mask(mask)
    if window is not None:
        mask = mask & window_mask(query.shape[1], key.shape[1], window)
    probs = attention_probs(query, key, mask)  # [batch, heads, q_len, k_len] float32
    if dropout is not None:
        probs = dropout(probs)
    return jnp.einsum("bnqk,bknd->bqnd", probs.astype(value.dtype), value)


def attend(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    window: int | None = None,
    *,
    backend: str = "auto",
    packed: bool | None = None,
) -> jax.Array:
    """`softmax(Q K^T / sqrt(d) + M) V`: `[batch, q_len, heads, head_dim]` in `value`'s dtype.

    Which kernel runs is `attention.choose(backend, ...)`'s answer at trace time
    (`isojax.models.attention`, whose table says which rule sends a call where):
    - XLA: `jax.nn.dot_product_attention(implementation="xla")`, scores and softmax in float32
      whatever the compute dtype (as `attention_probs`). In the installed JAX
      `implementation=None` is this same path: it never picks cuDNN. Always on CPU and TPU,
      on ModernBERT's sliding-window layers, for packed rows, and with attention dropout.
    - cuDNN: `attend_cudnn`, the fused kernel, where `backend` is "auto" or "cudnn" and every
      rule passes (a GPU, bfloat16 or float16, a supported head size, no attention dropout in
      this step, a `[batch, keys]` right-padding mask, a global layer).
    With `dropout` (which the fused calls have not), or float16 on the CPU (no float16 x
    float16 -> float32 dot there), `attend_reference`. A query that may see no key gets
    uniform weights (finite, never read) on the XLA paths.

    Args:
      query: `[batch, q_len, heads, head_dim]`; key, value: `[batch, k_len, heads, head_dim]`.
      mask: `[batch, k_len]` or pairwise `[batch, 1, 1 or q_len, k_len]`, nonzero where seen.
      dropout: applied to the float32 `[batch, heads, q_len, k_len]` probabilities; None: none.
      window: a query sees only keys within `window` positions of its own (`window_mask`;
        the call's `local_window_size=(window, window)`); None: every allowed key.
      backend: "auto", "xla" or "cudnn" (`attention.BACKENDS`); "cudnn" where it cannot run
        raises `attention.Refused`.
      packed: packed rows (the mask's keys are not each row's right padding); None: a
        pairwise `[batch, 1, q_len > 1, k_len]` mask is packed.
    """
    pairwise = mask.ndim == 4 and mask.shape[2] > 1
    call = attention_lib.Call(
        platform=jax.default_backend(),
        dtype=jnp.dtype(query.dtype).name,
        head_dim=query.shape[-1],
        dropout=dropout is not None,
        lengths=not pairwise,
        local=window is not None,
        packed=pairwise if packed is None else packed,
    )
    chosen, reason = attention_lib.choose(backend, call, query.shape)
    attention_lib.logger.debug("attend %s: %s (%s)", query.shape, chosen, reason)
    if chosen == "cudnn":
        return attend_cudnn(query, key, value, mask)
    cpu_half = query.dtype == jnp.float16 and call.platform == "cpu"
    if dropout is not None or cpu_half:
        return attend_reference(query, key, value, mask, dropout, window)
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=pairwise_mask(mask),
        local_window_size=None if window is None else (window, window),
        implementation="xla",
    ).astype(value.dtype)


def attend_cudnn(query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
    """`attend` through cuDNN's fused kernel, `jax.nn.dot_product_attention(implementation=
    "cudnn")`, the `[batch, k_len]` (or `[batch, 1, 1, k_len]`) key mask given as
    `key_value_seq_lengths` (its real tokens, right padding; at least 1, so that a row of
    padding stays finite); every query row is computed, as on the XLA path. A row whose mask
    is not right padding (its keys are not the first `length`) gets NaN: never a silently
    wrong answer."""
    keys = pairwise_mask(mask)[:, 0, 0, :]  # [batch, k_len]
    lengths = keys.sum(axis=-1, dtype=jnp.int32)
    right = jnp.all(keys == (jnp.arange(keys.shape[-1]) < lengths[:, None]), axis=-1)
    out = jax.nn.dot_product_attention(
        query, key, value, key_value_seq_lengths=jnp.maximum(lengths, 1), implementation="cudnn"
    )
    return jnp.where(right[:, None, None, None], out, jnp.nan).astype(value.dtype)


def transformer_layer(
    cfg: config_lib.EncoderConfig,
    x: jax.Array,
    attention: Callable[[jax.Array], jax.Array],
    attention_norm: Callable[[jax.Array], jax.Array],
    mlp_in: Callable[[jax.Array], jax.Array],
    mlp_out: Callable[[jax.Array], jax.Array],
    output_norm: Callable[[jax.Array], jax.Array],
    attention_dropout: Callable[[jax.Array], jax.Array],
    ffn_dropout: Callable[[jax.Array], jax.Array],
    cls_only: bool = False,
    cls_index: jax.Array | None = None,
) -> jax.Array:
    """The post-LN layer's wiring, `a = LN(x + Dropout(Attention(x)))`,
    `h = LN(a + Dropout(W2 act(W1 a)))`, with the family's dropout switches; the one
    implementation, called by the linen `TransformerLayer` and `isojax.nnx.bert`'s.

    `attention(x)` is the attention block's output (`[examples, 1, hidden]` with `cls_only`,
    whose residual is then `sentence_queries(x, cls_index)`); the other callables are the
    layer's norms, projections and dropouts.
    """
    a = attention(x)
    if cfg.attention_output_dropout:
        a = attention_dropout(a)
    if cls_only:
        x = sentence_queries(x, cls_index)
    a = attention_norm(x + a)
    f = mlp_in(a)  # [batch, len, intermediate]
    f = mlp_out(_ACTIVATIONS[cfg.hidden_act](f))
    if cfg.ffn_output_dropout:
        f = ffn_dropout(f)
    return output_norm(a + f)


def sinusoidal_init(key, shape, dtype=jnp.float32) -> jax.Array:
    """DistilBERT's fixed sinusoidal position table, `[positions, dim]` (Vaswani et al. 3.5)."""
    del key
    n_pos, dim = shape
    angle = np.arange(n_pos)[:, None] / np.power(10000, 2 * (np.arange(dim) // 2) / dim)
    table = np.where(np.arange(dim) % 2 == 0, np.sin(angle), np.cos(angle))
    return jnp.asarray(table, dtype)


def position_ids(
    cfg: config_lib.EncoderConfig, input_ids: jax.Array, given: jax.Array | None = None
) -> jax.Array:
    """`[batch, len]` int32 rows of the position table.

    Without `given`: 0..t-1, or RoBERTa's padding_idx+1.. with padding at padding_idx
    (computed from `input_ids != pad_token_id`, as transformers does). With `given` (0-based
    position of each token within its own example, e.g. packed rows): `given` plus the
    family's offset (RoBERTa: padding_idx + 1, so an example's first token reads the same row
    as in an unpacked batch).
    """
    if given is not None:
        return given.astype(jnp.int32) + cfg.position_offset
    t = input_ids.shape[1]
    if cfg.family != "roberta":
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), input_ids.shape)
    real = (input_ids != cfg.pad_token_id).astype(jnp.int32)
    return jnp.cumsum(real, axis=1) * real + cfg.pad_token_id


def embed(
    cfg: config_lib.EncoderConfig,
    input_ids: jax.Array,
    token_type_ids: jax.Array | None,
    positions: jax.Array | None,
    word: Callable[[jax.Array], jax.Array],
    token_type: Callable[[jax.Array], jax.Array] | None,
    position: Callable[[jax.Array], jax.Array],
    norm: Callable[[jax.Array], jax.Array],
    dropout: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """Token + position (+ segment) embeddings, LayerNorm, dropout: `[batch, len, E]`; the one
    implementation, called by the linen `Embeddings` and `isojax.nnx.bert.Embeddings`.

    `word`, `token_type` (None for families without segments) and `position` look rows up;
    absent `token_type_ids` are segment 0; positions come from `position_ids(cfg, input_ids,
    positions)` (packed rows: `positions` within each example).
    """
    x = word(input_ids)
    if cfg.type_vocab_size:
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        x = x + token_type(token_type_ids)
    x = x + position(position_ids(cfg, input_ids, positions))
    return dropout(norm(x))


def check_inputs(
    cfg: config_lib.EncoderConfig,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    token_type_ids: jax.Array | None,
    position_ids: jax.Array | None,
    cls_index: jax.Array | None,
) -> None:
    """Raises `ValueError`, naming the argument and its shape, unless the encoder's inputs
    fit together and fit `cfg`'s position table (see `Encoder`'s call)."""
    b, t = input_ids.shape if input_ids.ndim == 2 else (None, None)
    if b is None or attention_mask.shape not in ((b, t), (b, 1, t, t)):
        raise ValueError(
            f"input_ids {input_ids.shape} must be [batch, len] and attention_mask "
            f"{attention_mask.shape} [batch, len] or [batch, 1, len, len]"
        )
    for name, given in (("token_type_ids", token_type_ids), ("position_ids", position_ids)):
        if given is not None and given.shape != input_ids.shape:
            raise ValueError(f"{name} {given.shape} must match input_ids {input_ids.shape}")
    if cls_index is not None and (cls_index.ndim != 2 or cls_index.shape[1] != 2):
        raise ValueError(f"cls_index {cls_index.shape} must be [examples, 2] (row, position)")
    if input_ids.shape[1] + cfg.position_offset > cfg.max_position_embeddings:
        raise ValueError(
            f"sequence length {input_ids.shape[1]} exceeds the {cfg.family} model's "
            f"max_position_embeddings {cfg.max_position_embeddings} "
            f"(position offset {cfg.position_offset})"
        )


def layer_calls(cfg: config_lib.EncoderConfig) -> list[tuple[int, int]]:
    """The weights each layer call uses, in call order: `(layer, 0)` per layer, or ALBERT's
    `(group, inner)`: layer call i runs the inner layers of group int(i / (L / G))."""
    if cfg.family != "albert":
        return [(i, 0) for i in range(cfg.num_layers)]
    per_group = cfg.num_layers / cfg.num_hidden_groups
    return [
        (int(i / per_group), j) for i in range(cfg.num_layers) for j in range(cfg.inner_group_num)
    ]


def encode(
    cfg: config_lib.EncoderConfig,
    x: jax.Array,
    attention_mask: jax.Array,
    stack: Sequence[Callable[..., jax.Array]],
    pooler: Callable[[jax.Array], jax.Array] | None,
    cls_only: bool = False,
    cls_index: jax.Array | None = None,
) -> EncoderOutput:
    """The layer stack over the embeddings `x`, the sentence tokens and the pooler: the one
    implementation, called by the linen `Encoder` and `isojax.nnx.encoder.Encoder`.

    Args:
      x: `[batch, len, hidden]` (after ALBERT's projection).
      attention_mask: `[batch, len]` or pairwise `[batch, 1, len, len]`.
      stack: the layer calls in order, each `layer(x, mask, cls_only, cls_index)`.
      pooler: the pooler's dense layer (None: no pooler).
      cls_only, cls_index: as `Encoder`'s.
    """
    mask = pairwise_mask(attention_mask)  # [b, 1, 1 or t, t] bool, for every layer
    hidden_states = []
    for layer in stack[:-1] if cls_only else stack:
        x = layer(x, mask, False, None)
        hidden_states.append(x)
    if cls_only:
        cls = stack[-1](x, mask, True, cls_index)[:, 0]
        hidden_states = []
    else:
        cls = sentence_queries(x, cls_index)[:, 0]
    pooled = None if pooler is None else jnp.tanh(pooler(cls))
    return EncoderOutput(hidden_states=tuple(hidden_states), cls=cls, pooled=pooled)


def model_inputs(batch: Mapping) -> dict:
    """Keyword arguments of `SequenceClassifier` / `Encoder` for a packed or unpacked batch
    (jit-able): `input_ids`, `attention_mask`, `token_type_ids`, and for packed rows the
    pairwise `[r, 1, t, t]` segment mask, `position_ids` and `cls_index`. Add
    `example_mask=batch["example_mask"]` for the normaliser."""
    if "segment_ids" not in batch:  # a padded batch (isojax.data.batching)
        return {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "token_type_ids": batch["token_type_ids"],
        }
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": segment_attention_mask(jnp.asarray(batch["segment_ids"])),
        "token_type_ids": batch["token_type_ids"],
        "position_ids": batch["position_ids"],
        "cls_index": batch["cls_index"],
    }
