"""Hugging Face checkpoints out: an encoder or a classifier as a folder transformers loads.

    models.export_pretrained("out/rte", head, variables, tokenizer=pre.tokenizer)
    # transformers.AutoModelForSequenceClassification.from_pretrained("out/rte")

Export writes `config.json` + `model.safetensors`, which transformers' `AutoModel` /
`Auto*ForSequenceClassification` load as they are; the names come from the same tables as
loading (`hf_import.state_dict_from_params`). A classifier head that transformers' classes
cannot reproduce (a layer-norm normaliser, or one that reads the raw [CLS] vector) exports its
encoder alone, and says why in a warning of the "isojax" logger (`encoder_only_reason`).
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import numpy as np

from isojax.models import config as config_lib
from isojax.models import heads, hf_import

logger = logging.getLogger(__name__)


class UnservableHead(ValueError):
    """A classifier head that transformers' `<Family>ForSequenceClassification` cannot compute."""


def encoder_only_reason(head: heads.SequenceClassifier, variables: Mapping) -> str | None:
    """Why `export_pretrained` writes this classifier's encoder alone (`UnservableHead`'s
    message), or None when transformers' classes compute its head."""
    try:
        classifier_state_dict(head, variables)
    except UnservableHead as why:
        return str(why)
    return None


def classifier_state_dict(head: heads.SequenceClassifier, variables: Mapping) -> tuple[dict, str]:
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
    if head.sentence != "pooled" or not cfg.has_pooler:
        raise UnservableHead(
            f"transformers' {cfg.family} sequence classifier reads the pooler output; this head "
            f"uses sentence={head.sentence!r}"
        )
    try:
        kernel, bias = heads.folded_classifier(head, variables)  # [hidden, labels], [labels]
    except ValueError as err:  # its one documented error: the normaliser is not affine
        raise UnservableHead(str(err)) from None
    kernel, bias = np.asarray(kernel, np.float32), np.asarray(bias, np.float32)
    params = variables["params"] if "params" in variables else variables
    encoder_sd = hf_import.state_dict_from_params(cfg, params["encoder"])
    prefix = hf_import.ENCODER_PREFIX[cfg.family]
    out = {}
    for name, value in encoder_sd.items():
        if cfg.family == "roberta" and name.startswith("pooler.dense."):
            out["classifier.dense." + name.split(".")[-1]] = value
        elif cfg.family == "modernbert" and name.startswith("head."):
            out[name] = value  # the prediction head sits beside `model.`
        else:
            out[f"{prefix}.{name}"] = value
    linear = "classifier.out_proj" if cfg.family == "roberta" else "classifier"
    out[f"{linear}.weight"] = np.ascontiguousarray(kernel.T)
    out[f"{linear}.bias"] = bias
    return out, hf_import.BASE_CLASS[cfg.family].replace("Model", "ForSequenceClassification")


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
    from safetensors import numpy as safetensors_numpy

    folder = pathlib.Path(folder)
    if isinstance(module_or_config, heads.SequenceClassifier):
        state_dict, hf = _classifier_export(module_or_config, params, label_names, folder)
    else:
        cfg = getattr(module_or_config, "config", module_or_config)
        if not isinstance(cfg, config_lib.EncoderConfig):
            raise ValueError(
                f"export_pretrained takes an Encoder, EncoderConfig or SequenceClassifier, "
                f"not {type(module_or_config).__name__}"
            )
        state_dict, hf = _encoder_export(cfg, params)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    safetensors_numpy.save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def _encoder_export(cfg: config_lib.EncoderConfig, params: Mapping) -> tuple[dict, dict]:
    """An encoder's state dict and its `config.json` as `<Family>Model`."""
    hf = cfg.to_hf()
    hf["architectures"] = [hf_import.BASE_CLASS[cfg.family]]
    return hf_import.state_dict_from_params(cfg, params), hf


def _classifier_export(
    head: heads.SequenceClassifier,
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
        state_dict, hf = _encoder_export(cfg, tree["encoder"])
        logger.warning(
            "%s: exported the encoder alone (%s), without the classifier head: %s",
            folder,
            hf["architectures"][0],
            why,
        )
        return state_dict, hf
    if label_names is not None and len(label_names) != head.num_labels:
        raise ValueError(
            f"label_names {list(label_names)} do not name the head's {head.num_labels} outputs"
        )
    hf = cfg.to_hf()
    hf.pop("id2label", None), hf.pop("label2id", None)
    hf["num_labels"] = head.num_labels  # transformers derives id2label from it
    if label_names is not None:
        hf["id2label"] = {str(i): name for i, name in enumerate(label_names)}
        hf["label2id"] = {name: i for i, name in enumerate(label_names)}
    hf["problem_type"] = "regression" if head.num_labels == 1 else "single_label_classification"
    hf["architectures"] = [architecture]
    return state_dict, hf
