r"""isojax's Flax linen front end: the normalisers, IsoScore* and the encoders as ``nn.Module``\ s.

The same names as :mod:`isojax.nnx` where the two front ends share a concept, over the same pure
functions of :mod:`isojax.core` and :mod:`isojax.models`: the normalisers
(:mod:`~isojax.linen.norms`), IsoScore* (:mod:`~isojax.linen.istar`), the encoders
(:mod:`~isojax.linen.encoder`; one family a file: :mod:`~isojax.linen.bert` for BERT, RoBERTa,
DistilBERT, ALBERT, :mod:`~isojax.linen.modernbert` for ModernBERT), the classifier
(:mod:`~isojax.linen.heads`) and Hugging Face checkpoints in and out
(:mod:`~isojax.linen.pretrained`: ``load_pretrained``, ``export_pretrained``).
Running statistics live in the ``'batch_stats'`` collection, in float32 whatever the compute
dtype; ``use_running_average`` chooses the batch's statistics (and updates them) or the running
ones, as ``flax.linen.BatchNorm`` does. IsoBN inside your own model:

>>> import flax.linen as nn, jax, jax.numpy as jnp
>>> import isojax.linen as ijl
>>> class Head(nn.Module):
...     num_labels: int
...
...     @nn.compact
...     def __call__(self, sentence, *, train: bool, mask=None):
...         x = ijl.IsoBN(momentum=0.95)(sentence, use_running_average=not train, mask=mask)
...         return nn.Dense(self.num_labels)(x)
>>> x = jax.random.normal(jax.random.key(0), (16, 8))
>>> variables = Head(2).init(jax.random.key(1), x, train=False)
>>> logits, updates = Head(2).apply(variables, x, train=True, mutable=["batch_stats"])
>>> variables = {**variables, **updates}              # IsoBN's running cov and std moved
>>> int(variables["batch_stats"]["IsoBN_0"]["count"])
1
>>> logits = Head(2).apply(variables, x, train=False)  # evaluation: the running statistics

I-STAR with a running ``C0`` (the ``ema`` stabiliser) as a loss term of your own step:

>>> istar = ijl.make_isoscore_star("ema", zeta=0.2)
>>> stats = ijl.init_batch_stats(istar, 8)
>>> hidden = jax.random.normal(jax.random.key(2), (2, 4, 6, 8))   # [layers, batch, len, d]
>>> penalty, stats = ijl.penalty_and_update(istar, stats, hidden, jnp.ones((4, 6)))
>>> bool(0.0 <= penalty <= 1.0)
True
"""

from isojax.core.normalizers import NORMALIZERS
from isojax.linen.encoder import Encoder, init_params
from isojax.linen.heads import SequenceClassifier, init_variables
from isojax.linen.istar import (
    IsoScoreStar,
    init_batch_stats,
    make_isoscore_star,
    penalty_and_update,
)
from isojax.linen.norms import (
    CLASSES,
    BatchNorm,
    Identity,
    IsoBN,
    IterNorm,
    LayerNorm,
    Recenter,
    Whiten,
    make_normalizer,
)
from isojax.linen.pretrained import Pretrained, export_pretrained, load_pretrained
from isojax.models.transformer import EncoderOutput

__all__ = [
    "CLASSES",
    "NORMALIZERS",
    "BatchNorm",
    "Encoder",
    "EncoderOutput",
    "Identity",
    "IsoBN",
    "IsoScoreStar",
    "IterNorm",
    "LayerNorm",
    "Pretrained",
    "Recenter",
    "SequenceClassifier",
    "Whiten",
    "export_pretrained",
    "init_batch_stats",
    "init_params",
    "init_variables",
    "load_pretrained",
    "make_isoscore_star",
    "make_normalizer",
    "penalty_and_update",
]
