r"""isojax: isotropy-aware fine-tuning of BERT-family encoders in JAX/Flax.

The front-end-free maths is here, optax-style: pure functions of arrays, jit-able, float32
statistics whatever the input dtype: the isotropy measures (IsoScore, IsoScore*, EV_k, the
participation ratio, the mean cosine), the geometry of SPEC.md §10.4 (effective rank, RankMe,
outlier dimensions), the penalties and the C0 pass.

>>> import jax, jax.numpy as jnp
>>> import isojax
>>> x = jax.random.normal(jax.random.key(0), (256, 8))
>>> round(float(isojax.isoscore(x)), 2) > 0.9               # nearly isotropic Gaussian points
True
>>> round(float(isojax.effective_rank(x)), 1) > 7.0         # and uses all 8 directions
True
>>> float(isojax.outlier_dimensions(x * jnp.array([9.] + [1.] * 7)).count)
1.0
>>> c0 = jnp.eye(8)
>>> float(isojax.istar_penalty(x[None, None], None, c0=c0, zeta=0.2)) < 0.05
True

The modules live in the two front ends, under the same names (``import isojax.linen as ijl``,
``import isojax.nnx as ijx``): :class:`~isojax.linen.IsoBN`, ``BatchNorm``, ``LayerNorm``,
``Recenter``, ``Identity``, ``make_normalizer``, ``NORMALIZERS``, ``IsoScoreStar``, the
encoders and the classifier. I-STAR as a loss term, with a fixed ``C0``::

    loss = task_loss + lam * isojax.istar_penalty(hidden_states, token_mask, c0=c0, zeta=0.2)

The layers, bottom up: :mod:`isojax.core` (the maths), :mod:`isojax.models` (the encoders'
front-end-free half: configs, transformer maths, Hugging Face weights in and out) and
:mod:`isojax.data` (GLUE), :mod:`isojax.linen` and :mod:`isojax.nnx` (the front ends: the
normalisers, IsoScore*, the encoders, the classifier, ``load_pretrained`` /
``from_pretrained`` and ``export_pretrained``), :mod:`isojax.training` (the fine-tuning loop),
:mod:`isojax.runs` (restore, predict, export), :mod:`isojax.analysis` (isotropy reports) and
:mod:`isojax.cli` (the ``isojax`` command). ``import isojax`` imports ``core``, ``models``,
``linen`` and ``nnx`` only.
"""

from isojax import linen, nnx
from isojax.core.geometry import effective_rank, outlier_dimensions, rankme
from isojax.core.isotropy import (
    explained_variance,
    isoscore,
    isoscore_star,
    mean_cosine_similarity,
    participation_ratio,
)
from isojax.core.normalizers import isobn_gain
from isojax.core.penalties import (
    c0_pass_finalize,
    c0_pass_init,
    c0_pass_update,
    cosreg_penalty,
    estimate_c0,
    istar_penalty,
)

__version__ = "0.6.4"

__all__ = [
    "c0_pass_finalize",
    "c0_pass_init",
    "c0_pass_update",
    "cosreg_penalty",
    "effective_rank",
    "estimate_c0",
    "explained_variance",
    "isobn_gain",
    "isoscore",
    "isoscore_star",
    "istar_penalty",
    "linen",
    "mean_cosine_similarity",
    "nnx",
    "outlier_dimensions",
    "participation_ratio",
    "rankme",
]
