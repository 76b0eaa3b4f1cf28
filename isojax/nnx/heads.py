"""Sequence classification / regression head over an NNX encoder, the twin of the linen
`isojax.linen.SequenceClassifier`:

    s = pooler(h_[CLS]) or h_[CLS]        z = norm(s)        logits = W Dropout(z) + b

The wiring is the pure head function both front ends call (`isojax.models.heads.classify`, with
`encoder_options` and `check_head`); the normaliser is `isojax.nnx.make_normalizer` over the
linen registry's names and hyper-parameters (`none`: its identity module); the dropout is
`nnx.Dropout` (the linen head's is `nn.Dropout`, the same bernoulli masks). `num_labels=1`
is regression (STS-B).

    head = SequenceClassifier(encoder, num_labels=2, normalizer="isobn", rngs=nnx.Rngs(0))
    head.train(); logits, extras = head(ids, mask)            # IsoBN updates its BatchStats
    logits, _ = nnx.view(head, deterministic=True, use_running_average=True)(ids, mask)

Zhou, Lin, Ren, `IsoBN <https://arxiv.org/abs/2005.02178>`_, AAAI 2021, figure 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from isojax.models import heads as heads_lib
from isojax.nnx import norms as nnx_norms


class SequenceClassifier(nnx.Module):
    """Classifier or regressor on a sentence vector of `encoder`.

    Args:
      encoder: an `isojax.nnx.Encoder` (any NNX module called as the linen head's encoder,
        returning an `EncoderOutput`).
      num_labels: classes; 1 means regression.
      sentence: "pooled" (the pooler output, as the IsoBN reference) or "cls" (raw [CLS]).
      normalizer: a name of `isojax.core.normalizers.NORMALIZERS`; "none" is the identity.
      normalizer_kwargs: its hyper-parameters (e.g. momentum, beta), as in linen.
      dropout_rate: dropout before the linear layer.
      output_bias: the classifier's starting bias, as the linen head's.
      axis_name: mapped axis of the normaliser's batch statistics (inside `vmap`/`shard_map`).
      dtype: compute dtype of the normaliser; logits are always float32.
      param_dtype: float32.
      rngs: `params` for the classifier and normaliser, `dropout` for the head's dropout.

    Modes: the call's `deterministic` (dropout) and `use_running_average` (the normaliser;
    default `deterministic`), else the modules' attributes, None until `.train()`, `.eval()`
    or `nnx.view` sets them.
    """

    def __init__(
        self,
        encoder: nnx.Module,
        num_labels: int,
        *,
        sentence: str = "pooled",
        normalizer: str = "none",
        normalizer_kwargs: Mapping[str, Any] | None = None,
        dropout_rate: float = 0.1,
        output_bias: float = 0.0,
        axis_name: str | None = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        heads_lib.check_head(sentence, num_labels)
        hidden = encoder.config.hidden_size
        self.encoder = encoder
        self.num_labels, self.sentence, self.normalizer = num_labels, sentence, normalizer
        self.normalizer_kwargs = tuple(sorted(dict(normalizer_kwargs or {}).items()))
        self.dropout_rate, self.axis_name = dropout_rate, axis_name
        self.output_bias = output_bias
        self.dtype, self.param_dtype = dtype, param_dtype
        # "none" too (the identity), so that nnx.view(..., use_running_average=...) reaches it.
        self.norm = nnx_norms.make_normalizer(
            normalizer,
            hidden,
            rngs=rngs,
            dtype=dtype,
            param_dtype=param_dtype,
            axis_name=axis_name,
            **dict(self.normalizer_kwargs),
        )
        self.dropout = nnx.Dropout(dropout_rate, deterministic=None, rngs=rngs)
        self.classifier = nnx.Linear(
            hidden,
            num_labels,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            kernel_init=nnx.initializers.normal(0.02),
            bias_init=nnx.initializers.constant(output_bias),
            rngs=rngs,
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        cls_index: jax.Array | None = None,
        deterministic: bool | None = None,
        use_running_average: bool | None = None,
        example_mask: jax.Array | None = None,
        cls_only: bool = False,
    ) -> tuple[jax.Array, dict]:
        """Logits of a batch, one row per example, or of packed rows, one per `cls_index`
        entry; arguments and returns as the linen `SequenceClassifier`'s (`example_mask`
        leaves the last batch's fillers out of the normaliser's statistics)."""
        extra = heads_lib.encoder_options(self.encoder, position_ids, cls_index, cls_only)
        types = heads_lib.segment_ids(self.encoder, token_type_ids)
        out = self.encoder(input_ids, attention_mask, types, deterministic=deterministic, **extra)
        if use_running_average is None:
            use_running_average = deterministic
        return heads_lib.classify(
            out,
            self.sentence,
            lambda s: self.norm(s, use_running_average, mask=example_mask),
            lambda z: self.dropout(z, deterministic=deterministic),
            self.classifier,
        )
