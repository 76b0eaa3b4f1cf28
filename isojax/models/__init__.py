"""The encoders' front-end-free half: configs (`EncoderConfig`), the pure transformer and
ModernBERT maths, dropout masks, the head's maths, and Hugging Face weights in and out as pure
functions over the parameter tree; both front ends (`isojax.linen`, `isojax.nnx`) build their
modules over them.

Both take padded rows (one example per row) or packed rows (`isojax.data.packing`: a
pairwise `segment_attention_mask`, per-example `position_ids` and a `cls_index` gather).
"""

from isojax.models.config import FAMILIES, VARIANTS, EncoderConfig
from isojax.models.hf_import import LoadReport
from isojax.models.transformer import EncoderOutput, segment_attention_mask

__all__ = [
    "FAMILIES",
    "VARIANTS",
    "EncoderConfig",
    "EncoderOutput",
    "LoadReport",
    "segment_attention_mask",
]
