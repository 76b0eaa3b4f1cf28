r"""IsoScore* with its running stabiliser ``C₀`` as a native Flax NNX module.

The twin of :class:`isojax.linen.istar.IsoScoreStar`, over the same pure step
(:func:`isojax.core.istar.step`: the score with the previous steps' ``C₀``, then the ``epoch``
or ``ema`` rule under the bad-batch guard), the same settings table
(`isojax.core.istar.DEFAULTS`, `isojax.core.istar.check_hparams`) and the same state, here float32
`nnx.BatchStat` attributes: ``c0``; for ``epoch`` ``window_count``, ``window_mean``,
``window_m2``, ``steps_in_window``, ``windows_closed``; for ``ema`` ``ema``; for both the
``count``/``skipped`` counters.

.. math::
  C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta\,\mathrm{sg}(C_0),\qquad
  \iota^* = \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},\qquad R = 1 - \iota^*.

The ``pass`` stabiliser (the reference's) holds ``C₀`` fixed; :func:`install_c0` puts in the
one of the explicit pass (:func:`isojax.core.penalties.estimate_c0`, then
:func:`isojax.core.penalties.c0_pass_finalize`) before each epoch.

References:
  Rudman & Eickhoff, `Stable Anisotropic Regularization
  <https://arxiv.org/abs/2305.19358>`_, ICLR 2024 (IsoScore*, Eq. 4–5; I-STAR, Sec. 4).
"""

import functools
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from isojax.core import istar, penalties, stats
from isojax.nnx.norms import RunningModule

_DEFAULTS = istar.DEFAULTS


class IsoScoreStar(RunningModule):
    """IsoScore* of a batch of hidden states with a running ``C₀``, in NNX.

    Args:
      num_features: the hidden size `d`.
      stabilizer: ``pass``, ``epoch`` or ``ema`` (:mod:`isojax.core.istar`).
      zeta, window, window_unit, momentum, debias, c0_init: as in the linen module.
      use_running_average: default mode (None: set by `.train()`/`.eval()`/`nnx.view`);
        True freezes the state.
      axis_name: mapped axis under ``shard_map``/``pmap``.
      rngs: accepted for a uniform signature; unused.

    Raises:
      ValueError: a setting out of range (`isojax.core.istar.check_hparams`, `check_zeta`).

    Example:
      >>> istar = IsoScoreStar(8, stabilizer="ema")
      >>> h = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
      >>> penalty = 1.0 - istar(h, use_running_average=False)
      >>> int(istar.count[...])
      1
    """

    def __init__(
        self,
        num_features: int,
        *,
        stabilizer: str = "epoch",
        zeta: float = _DEFAULTS["zeta"],
        window: int = _DEFAULTS["window"],
        window_unit: str = _DEFAULTS["window_unit"],
        momentum: float = _DEFAULTS["momentum"],
        debias: bool = _DEFAULTS["debias"],
        c0_init: Callable = istar.identity_init,
        use_running_average: bool | None = None,
        axis_name: str | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        del rngs
        self.num_features, self.stabilizer, self.zeta = num_features, stabilizer, zeta
        self.window, self.window_unit = window, window_unit
        self.momentum, self.debias, self.c0_init = momentum, debias, c0_init
        self.use_running_average, self.axis_name = use_running_average, axis_name
        istar.checked_settings(self)
        self.init_state(istar.state_for(self, num_features))

    def __call__(self, hidden_states, mask=None, use_running_average=None) -> jax.Array:
        """Scalar float32 IsoScore* with the current ``C₀``; then (training) the update.

        Args:
          hidden_states: ``[..., d]`` token vectors (e.g. ``[L, batch, len, d]``) or L arrays
            ``[batch, len, d]``, any float dtype.
          mask: one ``[batch, len]`` token mask for every layer, one of the stacked shape, or
            None for every token.
          use_running_average: True leaves the state untouched.
        """
        settings = istar.checked_settings(self)
        x, mask = istar.prepare(hidden_states, mask)
        init = functools.partial(istar.state_for, self)
        return self.run(init, istar.step, x, mask, use_running_average, zeta=self.zeta, **settings)


def make_isoscore_star(
    num_features: int, stabilizer: str, *, zeta: float = _DEFAULTS["zeta"], **hparams
) -> IsoScoreStar:
    """The NNX IsoScore* for a stabiliser named in a config, with the checks of
    :func:`isojax.linen.istar.make_isoscore_star` (unknown fields and values out of range)."""
    istar.check_fields(hparams, front="nnx")
    return IsoScoreStar(num_features, stabilizer=stabilizer, zeta=zeta, **hparams)


def install_c0(module: IsoScoreStar, c0: jax.typing.ArrayLike | stats.MomentState) -> None:
    """Puts ``C₀`` into `module` (the ``pass`` stabiliser's step before an epoch, or a seed for a
    running mode); the rest of its state is left as it is.

    Args:
      module: an :class:`IsoScoreStar`.
      c0: ``[d, d]``, or the accumulator of the explicit pass
        (:func:`isojax.core.penalties.estimate_c0`), finalised here by
        :func:`isojax.core.penalties.c0_pass_finalize`.

    Raises:
      ValueError: ``c0`` of another shape than the module's state.
    """
    if isinstance(c0, stats.MomentState):
        c0 = penalties.c0_pass_finalize(c0)
    module.c0.set_value(istar.checked_c0(c0, module.c0.get_value().shape))


def penalty_and_update(
    module: IsoScoreStar,
    hidden_states: jax.Array | Sequence[jax.Array],
    mask: jax.typing.ArrayLike | None,
    *,
    train: bool | None = None,
) -> jax.Array:
    """The I-STAR penalty ``1 − IsoScore*`` (float32 scalar): what an NNX train step adds as
    ``λ · penalty``, the twin of :func:`isojax.linen.istar.penalty_and_update` (whose state
    lives in the module here). `train` True updates the state, False freezes it, None follows
    the module's mode (``.train()``/``.eval()``/``nnx.view``)."""
    use_running_average = None if train is None else not train
    return 1.0 - module(hidden_states, mask, use_running_average=use_running_average)
