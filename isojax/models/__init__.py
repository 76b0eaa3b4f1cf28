"""BERT-family encoders (BERT, RoBERTa, DistilBERT, ALBERT), HF checkpoints, the task head."""

from isojax.models.checkpoints import (
    LoadReport,
    Pretrained,
    export_pretrained,
    load_pretrained,
)
from isojax.models.config import FAMILIES, VARIANTS, EncoderConfig
from isojax.models.encoder import Encoder, EncoderOutput, init_params
from isojax.models.heads import SequenceClassifier, init_variables

__all__ = [
    "FAMILIES",
    "VARIANTS",
    "Encoder",
    "EncoderConfig",
    "EncoderOutput",
    "LoadReport",
    "Pretrained",
    "SequenceClassifier",
    "export_pretrained",
    "init_params",
    "init_variables",
    "load_pretrained",
]
