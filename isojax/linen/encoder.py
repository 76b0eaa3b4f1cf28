"""`isojax.linen.Encoder`: one linen module for every family of `isojax.models.FAMILIES`, whose
call checks the inputs and runs its family's body, `isojax.linen.bert.encode_bert` (BERT,
RoBERTa, DistilBERT, ALBERT) or `isojax.linen.modernbert.encode_modernbert` (`BODIES`), as
`isojax.models.transformer` and `isojax.models.modernbert` hold their maths. The bodies build
their submodules inside the `Encoder`'s compact call, so the parameter paths (the checkpoint
layout, `tests/linen/test_param_tree.py`, and the Hugging Face name tables) sit directly under
the encoder. The NNX twin is `isojax.nnx.encoder`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.linen.bert import encode_bert
from isojax.linen.modernbert import encode_modernbert
from isojax.models import config as config_lib
from isojax.models.transformer import EncoderOutput, check_inputs, segment_attention_mask

__all__ = ["BODIES", "Encoder", "EncoderOutput", "fresh_params", "init_params"]
__all__ += ["segment_attention_mask"]

# A family's body, run inside `Encoder.__call__`: one per name of `isojax.models.FAMILIES`.
BODIES = {
    **dict.fromkeys(config_lib.BERT_FAMILIES, encode_bert),
    "modernbert": encode_modernbert,
}
assert tuple(BODIES) == config_lib.FAMILIES


class Encoder(nn.Module):
    """An encoder of any family of `isojax.models.FAMILIES` (from `config.family`): BERT,
    RoBERTa, DistilBERT, ALBERT (`isojax.linen.bert`) or ModernBERT (`isojax.linen.modernbert`).

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
      values from every token (`isojax.linen.bert.TransformerLayer`): the same `cls` and
      `pooled` (to float rounding; dropout draws other masks, of the smaller shapes) for about
      5/6 of the last layer's work, and `hidden_states` is then empty. For training steps
      whose loss reads only the sentence vector (no token penalty).

    ModernBERT takes neither `token_type_ids` nor `cls_only=True` (no token type embeddings;
    its pooling and windows read every token): it refuses them in one line
    (`isojax.models.modernbert.check_unread`).

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
        return BODIES[cfg.family](
            self,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids=position_ids,
            cls_index=cls_index,
            deterministic=deterministic,
            cls_only=cls_only,
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
