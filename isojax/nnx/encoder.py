"""`isojax.nnx.Encoder`: one NNX module for every family of `isojax.models.FAMILIES`, built and
called through its family's body (`BODIES`): `isojax.nnx.bert` (BERT, RoBERTa, DistilBERT,
ALBERT) or `isojax.nnx.modernbert`, as `isojax.models.transformer` and
`isojax.models.modernbert` hold their maths. The twin of `isojax.linen.encoder`.

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
each leaf of at least 1024 elements split along its largest axis the data axis divides), so the
variables are created sharded and `nnx.get_partition_spec(nnx.state(model))` gives the
`PartitionSpec`s of `distributed.state_sharding(..., fsdp=True)`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models import config as config_lib
from isojax.models import transformer
from isojax.models.transformer import EncoderOutput
from isojax.nnx import bert, modernbert

__all__ = ["BODIES", "Encoder", "EncoderOutput"]

# A family's modules (`init`, on the encoder) and call (`encode`): one per name of
# `isojax.models.FAMILIES`.
BODIES = {
    **dict.fromkeys(config_lib.BERT_FAMILIES, (bert.init_bert, bert.encode_bert)),
    "modernbert": (modernbert.init_modernbert, modernbert.encode_modernbert),
}
assert tuple(BODIES) == config_lib.FAMILIES


class Encoder(nnx.Module):
    """An encoder of any family of `isojax.models.FAMILIES` (from `config.family`): BERT,
    RoBERTa, DistilBERT, ALBERT (`isojax.nnx.bert`) or ModernBERT (`isojax.nnx.modernbert`),
    the NNX twin of `isojax.linen.Encoder`, called the same way:

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
    (None for DistilBERT; ModernBERT's prediction head), ModernBERT's `final_norm`. ModernBERT
    refuses `token_type_ids` and `cls_only=True` in one line each, as linen's.
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
        build = bert.Build(config, dtype, param_dtype, rngs, fsdp)
        self.config, self.dtype, self.param_dtype, self.remat = config, dtype, param_dtype, remat
        self.attention_backend = config.attention_backend  # "auto", "xla" or "cudnn"
        init, _ = BODIES[config.family]
        init(self, build)

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
        _, encode = BODIES[cfg.family]
        return encode(
            self,
            input_ids,
            attention_mask,
            token_type_ids,
            position_ids=position_ids,
            cls_index=cls_index,
            deterministic=deterministic,
            cls_only=cls_only,
        )
