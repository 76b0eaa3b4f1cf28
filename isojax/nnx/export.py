"""The NNX front end's way out to linen and to transformers: the one module of `isojax.nnx`
that imports `isojax.linen`.

- `to_linen` gives the linen twin of an NNX `Encoder` or `SequenceClassifier` with the same
  weights (`isojax.linen.Encoder` / `SequenceClassifier` and its `{'params', 'batch_stats'}`,
  by `isojax.nnx.pretrained.linen_path`); the parity tests compare against it;
- `from_linen` is its inverse for the module (fresh weights from `rngs`);
- `export_pretrained` writes a folder transformers loads, through
  `isojax.linen.export_pretrained` (over `isojax.models.hf_export`) on the linen twin.

    head = SequenceClassifier(encoder, num_labels=1, normalizer="isobn", rngs=nnx.Rngs(1))
    ...
    export_pretrained("out/stsb", head, tokenizer=tokenizer)
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

from flax import nnx

from isojax.linen import encoder as linen_encoder
from isojax.linen import heads as linen_heads
from isojax.linen import pretrained as linen_pretrained
from isojax.nnx import encoder as encoder_lib
from isojax.nnx import heads as heads_lib
from isojax.nnx.pretrained import linen_variables


def to_linen(model: nnx.Module) -> tuple[Any, dict]:
    """`(linen module, variables)`: the linen twin of an NNX `Encoder` or `SequenceClassifier`
    with the same weights (`isojax.linen.Encoder` / `SequenceClassifier` and its
    `{'params', 'batch_stats'}`)."""
    return _linen_module(model), linen_variables(model)


def _linen_module(model: nnx.Module):
    if isinstance(model, encoder_lib.Encoder):
        return linen_encoder.Encoder(
            model.config, dtype=model.dtype, param_dtype=model.param_dtype, remat=model.remat
        )
    if isinstance(model, heads_lib.SequenceClassifier):
        return linen_heads.SequenceClassifier(
            encoder=_linen_module(model.encoder),
            num_labels=model.num_labels,
            sentence=model.sentence,
            normalizer=model.normalizer,
            normalizer_kwargs=dict(model.normalizer_kwargs),
            dropout_rate=model.dropout_rate,
            output_bias=model.output_bias,
            axis_name=model.axis_name,
            dtype=model.dtype,
            param_dtype=model.param_dtype,
        )
    raise ValueError(
        f"no linen twin for {type(model).__name__}: an isojax.nnx Encoder or SequenceClassifier"
    )


def from_linen(module, *, fsdp: bool = False, rngs: nnx.Rngs) -> nnx.Module:
    """The NNX twin of a linen `isojax.linen.Encoder` or `SequenceClassifier` (the inverse of
    `to_linen`'s module): the same configuration, head settings and dtypes, fresh weights
    from `rngs` (`load_linen_variables` puts linen ones in)."""
    if isinstance(module, linen_encoder.Encoder):
        return encoder_lib.Encoder(
            module.config,
            dtype=module.dtype,
            param_dtype=module.param_dtype,
            remat=module.remat,
            fsdp=fsdp,
            rngs=rngs,
        )
    if isinstance(module, linen_heads.SequenceClassifier):
        return heads_lib.SequenceClassifier(
            from_linen(module.encoder, fsdp=fsdp, rngs=rngs),
            module.num_labels,
            sentence=module.sentence,
            normalizer=module.normalizer,
            normalizer_kwargs=module.normalizer_kwargs,
            dropout_rate=module.dropout_rate,
            output_bias=module.output_bias,
            axis_name=module.axis_name,
            dtype=module.dtype,
            param_dtype=module.param_dtype,
            rngs=rngs,
        )
    raise ValueError(
        f"no NNX twin for {type(module).__name__}: an isojax.linen Encoder or SequenceClassifier"
    )


def export_pretrained(
    folder: str | pathlib.Path,
    model: nnx.Module,
    *,
    tokenizer: Any = None,
    label_names: Sequence[str] | None = None,
) -> pathlib.Path:
    """Writes `config.json` + `model.safetensors` (+ the tokenizer) that transformers loads:
    an `Encoder` as `<Family>Model`, a `SequenceClassifier` as
    `<Family>ForSequenceClassification` with an affine normaliser folded into the linear
    layer, or its encoder alone (warning `EncoderOnlyExport`) when transformers' classes
    cannot compute the head; exactly `isojax.linen.export_pretrained` on `to_linen(model)`."""
    module, variables = to_linen(model)
    if isinstance(model, encoder_lib.Encoder):
        variables = variables["params"]
    return linen_pretrained.export_pretrained(
        folder, module, variables, tokenizer=tokenizer, label_names=label_names
    )
