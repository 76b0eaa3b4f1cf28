"""BERT-family encoders (BERT, RoBERTa, DistilBERT, ALBERT), HF checkpoints, the task head.

Both take padded rows (one example per row) or packed rows (`isojax.data.packing`: a
pairwise `segment_attention_mask`, per-example `position_ids` and a `cls_index` gather).
"""

from isojax.models.config import FAMILIES, VARIANTS, EncoderConfig
from isojax.models.encoder import Encoder, init_params
from isojax.models.heads import SequenceClassifier, init_variables
from isojax.models.hf_export import export_pretrained
from isojax.models.hf_import import LoadReport, Pretrained, load_pretrained
from isojax.models.transformer import EncoderOutput, segment_attention_mask

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
    "segment_attention_mask",
]
