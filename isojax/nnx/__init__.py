"""isojax's Flax NNX front end: native `nnx.Module` twins of the linen modules, over the same
pure functions (one copy of the maths; `isojax.core.normalizers`, `isojax.core.running`,
`isojax.core.istar`).

- `make_normalizer(name, num_features, *, rngs=None, **hparams)`: IsoBN, whitening, iterative
  normalisation, batch norm, layer norm, re-centring, none (`isojax.nnx.norms`), the names of
  `isojax.core.normalizers.NORMALIZERS`;
- `IsoScoreStar` with the `pass`, `epoch` and `ema` stabilisers, `install_c0` for the explicit
  pass's `C0`, and `penalty_and_update` (`isojax.nnx.istar`);
- `Encoder` (BERT, RoBERTa, DistilBERT, ALBERT in `isojax.nnx.bert`, ModernBERT in
  `isojax.nnx.modernbert`; packed inputs, `cls_only`) and `SequenceClassifier`
  (`isojax.nnx.encoder`, `isojax.nnx.heads`), over the pure functions of
  `isojax.models.transformer`, `isojax.models.modernbert` and `isojax.models.heads` (as the
  linen `isojax.linen.Encoder` and `SequenceClassifier`);
- `from_pretrained` (a Hugging Face folder or the weights package, through the one name
  table, with this front end's own initialisers) and `linen_variables` /
  `load_linen_variables`, its weights by their linen names (`isojax.nnx.pretrained`);
- `export_pretrained` (a folder transformers loads) and `from_linen` / `to_linen`, the linen
  twin in either direction (`isojax.nnx.export`, the one module here that imports
  `isojax.linen`).

Running statistics are float32 `nnx.BatchStat`s; the mode is the call argument or the
`use_running_average` attribute that `.train()`, `.eval()` and `nnx.view` set:

>>> import jax
>>> from flax import nnx
>>> import isojax.nnx as ijx
>>> norm = ijx.IsoBN(8, momentum=0.95, rngs=nnx.Rngs(0))
>>> x = jax.random.normal(jax.random.key(0), (16, 8))
>>> norm.train()
>>> y = norm(x)                      # the batch's statistics; the running ones move
>>> int(norm.count[...])
1
>>> norm.eval()
>>> y = norm(x)                      # the running statistics, frozen
>>> int(norm.count[...])
1
"""

from isojax.core.normalizers import NORMALIZERS
from isojax.nnx.encoder import Encoder, EncoderOutput
from isojax.nnx.export import export_pretrained, from_linen, to_linen
from isojax.nnx.heads import SequenceClassifier
from isojax.nnx.istar import IsoScoreStar, install_c0, make_isoscore_star, penalty_and_update
from isojax.nnx.norms import (
    CLASSES,
    BatchNorm,
    Identity,
    IsoBN,
    IterNorm,
    LayerNorm,
    Recenter,
    RunningModule,
    Whiten,
    make_normalizer,
)
from isojax.nnx.pretrained import (
    Pretrained,
    from_pretrained,
    linen_variables,
    load_linen_variables,
)

__all__ = [
    "CLASSES",
    "BatchNorm",
    "Encoder",
    "EncoderOutput",
    "Identity",
    "IsoBN",
    "IsoScoreStar",
    "IterNorm",
    "LayerNorm",
    "NORMALIZERS",
    "Recenter",
    "Pretrained",
    "RunningModule",
    "SequenceClassifier",
    "Whiten",
    "export_pretrained",
    "from_linen",
    "from_pretrained",
    "install_c0",
    "linen_variables",
    "load_linen_variables",
    "make_isoscore_star",
    "make_normalizer",
    "penalty_and_update",
    "to_linen",
]
