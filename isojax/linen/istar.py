r"""The linen :class:`IsoScoreStar`: IsoScore* with its stabiliser ``C₀`` as running state in
``'batch_stats'``, over the pure step of :mod:`isojax.core.istar` (whose docstring gives the
maths, the three stabilisers and the order within a step); and the calls the train step makes
(`make_isoscore_star`, `init_batch_stats`, `penalty_and_update`).
"""

import functools
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from isojax.core.istar import (
    DEFAULTS,
    check_fields,
    checked_settings,
    identity_init,
    prepare,
    state_for,
    step,
)
from isojax.core.running import STATS_DTYPE
from isojax.linen import running as linen_running


class IsoScoreStar(nn.Module):
    r"""IsoScore* of a batch of hidden states, with a running stabiliser ``C₀``.

    .. math::
      C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta\,\mathrm{sg}(C_0),\qquad
      \iota^* = \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},

    with ``cov`` unbiased (``torch.cov``, as the reference) over the unmasked tokens of all
    layers, and ``sg`` stop-gradient; the score is
    :func:`isojax.core.isotropy.isoscore_star_from_cov`
    of that covariance. The I-STAR loss adds ``λ (1 − ι*)`` (:func:`penalty_and_update`).
    The maths is the pure :func:`step`, which ``isojax.nnx.IsoScoreStar`` runs too.

    ``batch_stats`` (float32, ``[d, d]`` matrices, int32 counters): ``c0``, the stabiliser the
    score uses; for ``epoch`` the open window (:func:`epoch_state`: ``window_count``,
    ``window_mean``, ``window_m2``, ``steps_in_window``, ``windows_closed``), for ``ema`` the
    raw average ``ema``; for both the ``count``/``skipped`` counters of :mod:`isojax.core.running`.
    The update rules are :func:`epoch_rule` and :func:`ema_rule`.

    Attributes:
      stabilizer: ``pass``, ``epoch`` or ``ema`` (see the module docstring).
      zeta: shrinkage weight ``ζ`` in ``[0, 1]`` (reference default 0.2).
      window: ``epoch`` window length, in ``window_unit``s (default: the reference's 250 000
        tokens; for exactly one epoch use ``window_unit='steps'`` and the steps per epoch).
      window_unit: ``tokens`` (unmasked token vectors, all layers counted) or ``steps``.
      momentum: ``ema`` decay ``m`` in ``(0, 1)``.
      debias: ``ema`` starts at zero and is divided by ``1 − m^count`` (default), instead of
        starting at ``c0_init``.
      c0_init: initializer ``(key, (d, d), dtype) -> [d, d]`` of ``C₀`` before any update
        (called with ``key=None``, so it must be deterministic); the identity by default;
        ``nn.initializers.constant(c0)`` for a given matrix.
      use_running_average: default of the call argument; True freezes the state.
      axis_name: mapped axis to reduce over under ``shard_map``/``pmap``.

    Example:
      >>> istar = IsoScoreStar(stabilizer="epoch", window=2, window_unit="steps")
      >>> h = jnp.ones((2, 3, 4, 8)).at[..., 0].set(jnp.arange(24.0).reshape(2, 3, 4))
      >>> variables = istar.init(jax.random.key(0), h, use_running_average=True)
      >>> score, updates = istar.apply(
      ...     variables, h, use_running_average=False, mutable=["batch_stats"])
      >>> int(updates["batch_stats"]["steps_in_window"])
      1
    """

    stabilizer: str = "epoch"
    zeta: float = DEFAULTS["zeta"]
    window: int = DEFAULTS["window"]
    window_unit: str = DEFAULTS["window_unit"]
    momentum: float = DEFAULTS["momentum"]
    debias: bool = DEFAULTS["debias"]
    c0_init: Callable = identity_init
    use_running_average: bool | None = None
    axis_name: str | None = None

    @nn.compact
    def __call__(
        self,
        hidden_states: jax.Array | Sequence[jax.Array],
        mask: jax.typing.ArrayLike | None = None,
        use_running_average: bool | None = None,
    ) -> jax.Array:
        """IsoScore* of the batch with the current ``C₀``; then (training) updates the state.

        Args:
          hidden_states: ``[..., d]`` token vectors, e.g. stacked ``[L, batch, len, d]``, or a
            sequence of L arrays ``[batch, len, d]`` (every transformer layer), any float dtype.
          mask: a `[batch, len]` token mask shared by every layer, or one `[L, batch, len]`
            mask (1 keeps a token, 0 drops padding); None keeps every token (the reference's
            parity setting).
          use_running_average: True leaves the state untouched (evaluation, or the ``pass``
            stabiliser, which never updates itself).

        Returns:
          Scalar float32 IsoScore* in ``[0, 1]``; the penalty is ``1 − score``.
        """
        settings = checked_settings(self)
        x, mask = prepare(hidden_states, mask)
        init = functools.partial(state_for, self)
        return linen_running.linen_step(
            self, init, step, x, mask, use_running_average, zeta=self.zeta, **settings
        )


def make_isoscore_star(
    stabilizer: str,
    *,
    zeta: float = DEFAULTS["zeta"],
    axis_name: str | None = None,
    **hparams,
) -> IsoScoreStar:
    """The IsoScore* module for a stabiliser named in a config (``config.istar.stabilizer``).

    Args:
      stabilizer: ``pass``, ``epoch`` or ``ema``.
      zeta: shrinkage weight.
      axis_name: mapped axis under ``shard_map``/``pmap``.
      **hparams: other :class:`IsoScoreStar` fields (``window``, ``window_unit``,
        ``momentum``, ``debias``, ``c0_init``, ``name``).

    Raises:
      ValueError: unknown stabiliser or field, or a value out of range (:func:`check_hparams`).
    """
    check_fields(hparams)
    module = IsoScoreStar(stabilizer=stabilizer, zeta=zeta, axis_name=axis_name, **hparams)
    checked_settings(module)
    return module


def init_batch_stats(module: IsoScoreStar, d: int) -> dict:
    """The initial ``'batch_stats'`` of ``module`` for hidden size ``d`` (no data needed).

    ``C₀`` is ``module.c0_init`` (the identity by default), windows and counters are empty.
    Carry the result in the train state and checkpoint it with it.
    """
    dummy = jnp.zeros((2, d), STATS_DTYPE)  # two tokens: the moments are defined
    return module.init(jax.random.key(0), dummy, use_running_average=True)["batch_stats"]


def penalty_and_update(
    module: IsoScoreStar,
    batch_stats: dict,
    hidden_states: jax.Array | Sequence[jax.Array],
    mask: jax.typing.ArrayLike | None,
    *,
    train: bool = True,
) -> tuple[jax.Array, dict]:
    r"""The I-STAR penalty ``1 − IsoScore*`` of a batch and the updated stabiliser state: what
    the train step runs (SPEC.md §4).

    .. math::
        C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta\,\mathrm{sg}(C_0),\qquad
        R = 1 - \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},\qquad
        \mathrm{PR}(C) = \frac{(\operatorname{tr} C)^2}{\lVert C\rVert_F^2},

    ``X`` every unmasked token of every layer, ``cov`` unbiased. With a fixed ``C₀`` it equals
    the stateless :func:`isojax.core.penalties.istar_penalty` (tested); both run
    :func:`isojax.core.isotropy.isoscore_star_from_cov`. Differentiable with respect to
    ``hidden_states`` (through the batch covariance only); the returned state carries no
    gradient. With ``train=False`` (or the ``pass`` stabiliser) the state comes back unchanged.

    Args:
      module: an :class:`IsoScoreStar` (e.g. from :func:`make_isoscore_star`).
      batch_stats: its collection (:func:`init_batch_stats`, or the previous step's).
      hidden_states: L arrays ``[batch, len, d]`` or ``[..., d]``, any float dtype.
      mask: ``[batch, len]`` token mask (1 token, 0 padding); None keeps every position.
      train: update the running state.

    Returns:
      ``(penalty [] float32, new batch_stats)``.
    """
    score, updates = module.apply(
        {"batch_stats": batch_stats},
        hidden_states,
        mask,
        use_running_average=not train,
        mutable=["batch_stats"],
    )
    return 1.0 - score, updates["batch_stats"]
