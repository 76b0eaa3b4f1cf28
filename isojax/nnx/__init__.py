"""isojax's Flax NNX front end: native `nnx.Module` twins of the linen modules, over the same
pure functions (one copy of the maths; `isojax.norms`, `isojax.running`, `isojax.stabilizer`).

- `make_normalizer(name, num_features, *, rngs=None, **hparams)`: IsoBN, batch norm, layer
  norm, re-centring, none (`isojax.nnx.norms`), the names of `isojax.norms.NORMALIZERS`;
- `IsoScoreStar` with the `pass`, `epoch` and `ema` stabilisers, `install_c0` for the explicit
  pass's `C0`, and `istar_penalty` (`isojax.nnx.stabilizer`);
- `Encoder` (BERT, RoBERTa, DistilBERT, ALBERT; packed inputs, `cls_only`) and
  `SequenceClassifier` (`isojax.nnx.encoder`, `isojax.nnx.heads`), over the pure functions of
  `isojax.models.transformer` and `isojax.models.heads`;
- `from_pretrained` / `export_pretrained` (a Hugging Face folder or the weights package, through
  the linen name tables) and `from_linen` / `to_linen` / `linen_variables` /
  `load_linen_variables`, the twin in either direction (`isojax.nnx.pretrained`).

Running statistics are float32 `nnx.BatchStat`s; the mode is the call argument or the
`use_running_average` attribute that `.train()`, `.eval()` and `nnx.view` set.
"""

from isojax.nnx.encoder import Encoder, EncoderOutput
from isojax.nnx.heads import SequenceClassifier
from isojax.nnx.norms import (
    CLASSES,
    BatchNorm,
    Identity,
    IsoBN,
    LayerNorm,
    Recenter,
    RunningModule,
    make_normalizer,
)
from isojax.nnx.pretrained import (
    Pretrained,
    export_pretrained,
    from_linen,
    from_pretrained,
    linen_variables,
    load_linen_variables,
    to_linen,
)
from isojax.nnx.stabilizer import IsoScoreStar, install_c0, istar_penalty, make_isoscore_star

__all__ = [
    "CLASSES",
    "BatchNorm",
    "Encoder",
    "EncoderOutput",
    "Identity",
    "IsoBN",
    "IsoScoreStar",
    "LayerNorm",
    "Recenter",
    "Pretrained",
    "RunningModule",
    "SequenceClassifier",
    "export_pretrained",
    "from_linen",
    "from_pretrained",
    "install_c0",
    "istar_penalty",
    "linen_variables",
    "load_linen_variables",
    "make_isoscore_star",
    "make_normalizer",
    "to_linen",
]
