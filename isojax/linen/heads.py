"""The linen sequence classification / regression head over any BERT-family encoder.

    s = pooler(h_[CLS]) or h_[CLS]        z = norm(s)        logits = W Dropout(z) + b

The module holds the parameters and modes (`classifier`, the normaliser's `norm`, the
encoder's `encoder`); the maths is `isojax.models.heads`' (`classify`), which the NNX head
(`isojax.nnx.heads`) calls too. The IsoBN reference places its normaliser exactly there
(encoder -> pooler -> IsoBN -> dropout -> linear, SPEC.md section 1); with `normalizer="none"`
and `sentence="pooled"` the head is transformers' `BertForSequenceClassification`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.linen import norms
from isojax.models import heads
from isojax.models.heads import check_head, classify, encoder_options

__all__ = ["SequenceClassifier", "folded_classifier", "init_variables"]


def _make_normalizer(head: SequenceClassifier, dtype) -> nn.Module:
    return norms.make_normalizer(
        head.normalizer,
        dtype=dtype,
        param_dtype=head.param_dtype,
        axis_name=head.axis_name,
        **dict(head.normalizer_kwargs),
    )


class SequenceClassifier(nn.Module):
    """Classifier or regressor on a sentence vector of `encoder`.

    Packed batches (`isojax.data.packing`): with `cls_index` the sentence vectors are the
    `[examples, hidden]` [CLS] (or pooled) vectors gathered at each example's (row, start), in
    the order of the unpacked batch, and `example_mask` `[examples]` masks the normaliser's
    statistics over exactly the vectors the unpacked batch would give it.

    Attributes:
      encoder: any linen module called as `encoder(input_ids, attention_mask, token_type_ids,
        deterministic=...)` that returns an `EncoderOutput` (its params sit under 'encoder');
        for packed batches also with `position_ids=` and `cls_index=` (`isojax.linen.Encoder`).
      num_labels: classes; 1 means regression.
      sentence: "pooled" (the pooler output, as the IsoBN reference) or "cls" (raw [CLS]).
      normalizer: a name of `isojax.core.normalizers.NORMALIZERS`; "none" is the identity.
      normalizer_kwargs: hyper-parameters for `norms.make_normalizer` (e.g. momentum, beta).
      dropout_rate: dropout before the linear layer (HF: classifier_dropout or hidden dropout).
      output_bias: the classifier's starting bias (every output). The loop sets a regression
        head's to the training labels' mean (`label_mean_bias`): a head that centres its input
        cannot learn that mean through its weights.
      axis_name: mapped axis over which the normaliser's batch statistics are reduced.
      dtype: compute dtype of the normaliser; logits are always float32.
      param_dtype: float32.
    """

    encoder: nn.Module
    num_labels: int
    sentence: str = "pooled"
    normalizer: str = "none"
    normalizer_kwargs: Mapping[str, Any] = flax.core.FrozenDict()
    dropout_rate: float = 0.1
    output_bias: float = 0.0
    axis_name: str | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def setup(self):
        check_head(self.sentence, self.num_labels)
        self.norm = None if self.normalizer == "none" else _make_normalizer(self, self.dtype)
        self.dropout = nn.Dropout(self.dropout_rate)
        self.classifier = nn.Dense(
            self.num_labels,
            dtype=jnp.float32,
            param_dtype=self.param_dtype,
            kernel_init=nn.initializers.normal(0.02),
            bias_init=nn.initializers.constant(self.output_bias),
        )

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        token_type_ids: jax.Array | None = None,
        *,
        position_ids: jax.Array | None = None,
        cls_index: jax.Array | None = None,
        deterministic: bool = True,
        use_running_average: bool | None = None,
        example_mask: jax.Array | None = None,
        cls_only: bool = False,
    ) -> tuple[jax.Array, dict]:
        """Logits of a batch, one row per example, or of packed rows, one logit row per
        `cls_index` entry.

        Args:
          input_ids, token_type_ids: `[batch, len]`.
          attention_mask: `[batch, len]`, or `[batch, 1, len, len]` for packed rows
            (`isojax.models.transformer.segment_attention_mask`).
          position_ids: `[batch, len]` 0-based position within each example (packed rows).
          cls_index: `[examples, 2]` (row, position) of each example's [CLS] (packed rows).
          deterministic: no dropout (evaluation).
          use_running_average: the normaliser uses (and does not update) its running
            statistics; defaults to `deterministic`. Training with it False needs
            `mutable=['batch_stats']`.
          example_mask: `[batch]` (`[examples]` with `cls_index`) 1 for real examples, 0 for
            the fillers of the last batch, which the normaliser then leaves out of its batch
            statistics.
          cls_only: the encoder computes its last layer at the [CLS] tokens only
            (`isojax.linen.Encoder`): the same logits for less work, and no
            `hidden_states`. Training steps without a token penalty use it; an encoder whose
            call has no `cls_only` parameter computes every token as before.

        Returns:
          `logits [batch, num_labels]` float32 and `{'encoder': EncoderOutput, 'sentence':
          [batch, hidden] before the normaliser, 'pre_logits': [batch, hidden] after it}`
          (`[examples, ...]` with `cls_index`).
        """
        extra = encoder_options(self.encoder, position_ids, cls_index, cls_only)
        types = heads.segment_ids(self.encoder, token_type_ids)
        out = self.encoder(input_ids, attention_mask, types, deterministic=deterministic, **extra)
        if use_running_average is None:
            use_running_average = deterministic
        norm = None
        if self.norm is not None:
            norm = lambda s: self.norm(s, use_running_average, mask=example_mask)  # noqa: E731
        return classify(
            out,
            self.sentence,
            norm,
            lambda z: self.dropout(z, deterministic=deterministic),
            self.classifier,
        )


def init_variables(
    head: SequenceClassifier,
    rng: jax.Array,
    encoder_params: Mapping | None = None,
    *,
    seq_len: int = 8,
) -> dict:
    """Fresh variables for `head` (`{'params': ..., 'batch_stats': ...}` as the normaliser
    needs), with the encoder's parameters replaced by `encoder_params` (e.g.
    `load_pretrained(...).params`) when given."""
    ids = jnp.zeros((2, seq_len), jnp.int32)
    variables = flax.core.unfreeze(head.init(rng, ids, jnp.ones_like(ids)))
    if encoder_params is not None:
        shapes = jax.tree.map(jnp.shape, variables["params"]["encoder"])
        given = jax.tree.map(jnp.shape, dict(encoder_params))
        if shapes != given:
            raise ValueError("encoder_params do not match the head's encoder parameter tree")
        variables["params"]["encoder"] = encoder_params
    return variables


def folded_classifier(head: SequenceClassifier, variables: Mapping) -> tuple[jax.Array, jax.Array]:
    r"""The classifier with the inference-time normaliser folded in: `(kernel [h, n], bias [n])`.

    At inference the normaliser uses running statistics only; when it is affine,
    `norm(x) = x R + c`, the logits `norm(x) W + b = x (R W) + (c W + b)`
    (`isojax.models.heads.fold_affine`).

    Args:
      head: the `SequenceClassifier`.
      variables: its variables, `{'params': ..., 'batch_stats': ...}` (or the params alone
        for a stateless normaliser).

    Raises:
      ValueError: the normaliser is not affine at inference (layer norm).
    """
    params = variables["params"] if "params" in variables else variables
    kernel = jnp.asarray(params["classifier"]["kernel"], jnp.float32)
    bias = jnp.asarray(params["classifier"]["bias"], jnp.float32)
    if head.normalizer == "none":
        return kernel, bias
    collections = variables if "params" in variables else {"params": variables}
    norm_vars = {name: tree["norm"] for name, tree in collections.items() if "norm" in tree}
    norm = _make_normalizer(head, jnp.float32)
    apply = jax.jit(lambda x: norm.apply(norm_vars, x, use_running_average=True))
    return heads.fold_affine(apply, kernel, bias, head.normalizer)
