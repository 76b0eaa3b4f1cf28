"""isojax's Flax NNX front end: native `nnx.Module` twins of the linen modules, over the same
pure functions (one copy of the maths; `isojax.norms`, `isojax.running`, `isojax.stabilizer`).

- `make_normalizer(name, num_features, *, rngs=None, **hparams)`: IsoBN, batch norm, layer
  norm, re-centring, none (`isojax.nnx.norms`), the names of `isojax.norms.NORMALIZERS`;
- `IsoScoreStar` with the `pass`, `epoch` and `ema` stabilisers, `install_c0` for the explicit
  pass's `C0`, and `istar_penalty` (`isojax.nnx.stabilizer`).

Running statistics are float32 `nnx.BatchStat`s; the mode is the call argument or the
`use_running_average` attribute that `.train()`, `.eval()` and `nnx.view` set.
"""

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
from isojax.nnx.stabilizer import IsoScoreStar, install_c0, istar_penalty, make_isoscore_star

__all__ = [
    "CLASSES",
    "BatchNorm",
    "Identity",
    "IsoBN",
    "IsoScoreStar",
    "LayerNorm",
    "Recenter",
    "RunningModule",
    "install_c0",
    "istar_penalty",
    "make_isoscore_star",
    "make_normalizer",
]
