"""Hugging Face checkpoints out: an encoder's or a classifier's weights as a folder transformers
loads, pure functions over the linen parameter tree.

    isojax.linen.export_pretrained("out/rte", head, variables, tokenizer=pre.tokenizer)
    # transformers.AutoModelForSequenceClassification.from_pretrained("out/rte")

Export writes `config.json` + `model.safetensors`, which transformers' `AutoModel` /
`Auto*ForSequenceClassification` load as they are; the names come from the same tables as
loading (`hf_import.state_dict_from_params`). The front ends (`isojax.linen.pretrained`,
`isojax.nnx.pretrained`) decide what a module is and fold its normaliser; this module names the
weights and writes the folder. A classifier head that transformers' classes cannot reproduce (a
layer-norm normaliser, or one that reads the raw [CLS] vector) exports its encoder alone, and
says why in a warning of the "isojax" logger.
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from isojax.models import config as config_lib
from isojax.models import hf_import

logger = logging.getLogger(__name__)


class UnservableHead(ValueError):
    """A classifier head that transformers' `<Family>ForSequenceClassification` cannot compute."""


def check_servable(cfg: config_lib.EncoderConfig, sentence: str) -> None:
    """Raises `UnservableHead` unless a head reading the `sentence` vector of a `cfg` encoder is
    one transformers' sequence classifiers compute (they read the pooler output)."""
    if sentence != "pooled" or not cfg.has_pooler:
        raise UnservableHead(
            f"transformers' {cfg.family} sequence classifier reads the pooler output; this head "
            f"uses sentence={sentence!r}"
        )


def classifier_state_dict(
    cfg: config_lib.EncoderConfig, encoder_params: Mapping, kernel, bias
) -> tuple[dict, str]:
    """A classifier's weights in the names of transformers' `<Family>ForSequenceClassification`,
    and that class name: the encoder's `'params'` tree and the linear layer `kernel [hidden,
    labels]`, `bias [labels]` with any affine normaliser already folded in
    (`isojax.models.heads.fold_affine`; RoBERTa's pooler becomes `classifier.dense`)."""
    kernel, bias = np.asarray(kernel, np.float32), np.asarray(bias, np.float32)
    encoder_sd = hf_import.state_dict_from_params(cfg, encoder_params)
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


def encoder_export(cfg: config_lib.EncoderConfig, params: Mapping) -> tuple[dict, dict]:
    """An encoder's state dict and its `config.json` as `<Family>Model`."""
    hf = cfg.to_hf()
    hf["architectures"] = [hf_import.BASE_CLASS[cfg.family]]
    return hf_import.state_dict_from_params(cfg, params), hf


def classifier_config(
    cfg: config_lib.EncoderConfig,
    architecture: str,
    num_labels: int,
    label_names: Sequence[str] | None = None,
) -> dict:
    """`config.json` of a `<Family>ForSequenceClassification` with `num_labels` outputs named by
    `label_names` (`id2label`, `label2id`; default transformers' `LABEL_<i>`); one output is
    regression."""
    if label_names is not None and len(label_names) != num_labels:
        raise ValueError(
            f"label_names {list(label_names)} do not name the head's {num_labels} outputs"
        )
    hf = cfg.to_hf()
    hf.pop("id2label", None), hf.pop("label2id", None)
    hf["num_labels"] = num_labels  # transformers derives id2label from it
    if label_names is not None:
        hf["id2label"] = {str(i): name for i, name in enumerate(label_names)}
        hf["label2id"] = {name: i for i, name in enumerate(label_names)}
    hf["problem_type"] = "regression" if num_labels == 1 else "single_label_classification"
    hf["architectures"] = [architecture]
    return hf


def write_folder(
    folder: str | pathlib.Path, state_dict: Mapping, hf: Mapping, tokenizer: Any = None
) -> pathlib.Path:
    """Writes `config.json` (`hf`) + `model.safetensors` (`state_dict`, float32 NumPy) and the
    tokenizer, if any, into `folder` (created if absent); returns the folder."""
    from safetensors import numpy as safetensors_numpy

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    safetensors_numpy.save_file(
        dict(state_dict), folder / "model.safetensors", metadata={"format": "pt"}
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder
