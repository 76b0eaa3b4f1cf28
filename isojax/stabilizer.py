r"""IsoScore* with its stabilising covariance ``C₀`` as running state in ``'batch_stats'``.

I-STAR (SPEC.md §4) shrinks the batch covariance towards a stabiliser,
``C_ζ = (1 − ζ) cov(X) + ζ C₀``, and the reference rebuilds ``C₀`` at the start of every
epoch with a separate pass over at least 250 000 training tokens (eval mode, no gradient).
:class:`IsoScoreStar` keeps ``C₀`` as running statistics of the tokens the training steps
see anyway, so no extra pass (and no second input pipeline) is needed, and ``C₀``
checkpoints, shards and resumes like batch norm. Three stabilisers, by name:

``pass``
  the reference: ``C₀`` is held fixed in ``batch_stats['c0']``; the training loop replaces it
  (:func:`replace_c0`) with the explicit pass of :mod:`isojax.regularizers` each epoch.
``epoch``
  accumulate the tokens of a window (``window`` steps or tokens) with the streaming moments
  of :mod:`isojax.stats` (Chan et al.), and swap their unbiased covariance in as ``C₀`` when
  the window closes: the reference's per-epoch ``C₀`` without the extra pass.
``ema``
  ``C₀`` is an exponential moving average of the unbiased batch covariances, in Flax's form
  ``ema ← m·ema + (1 − m)·cov(X)``, optionally debiased as Adam does.

Before any window closes (or any EMA update) ``C₀`` is ``c0_init``: the identity (the
reference's choice with no sample), or a matrix the caller supplies.

Order within a step: the score is computed with the ``C₀`` of the *previous* steps, then the
state is updated. The reference builds ``C₀`` before the epoch's first step, so the batch that
closes a window never sees the ``C₀`` it completes (likewise a batch never sees itself in the
EMA). Gradients: the penalty ``1 − IsoScore*`` differentiates through the batch covariance
only; ``C₀`` enters as ``stop_gradient`` and the state is updated from ``stop_gradient(X)``.

Bad batches (the convention of :mod:`isojax.norms`): a training batch with no unmasked token
or with non-finite moments leaves the running state exactly as it was, adds 1 to
``batch_stats['skipped']`` and sows ``intermediates['skipped_batch'] = True``; applied updates
count in ``batch_stats['count']``. All state is float32 whatever the input dtype.

Sharding: under ``jax.jit`` with the tokens sharded over a mesh the moments are global already;
under ``shard_map``/``pmap`` pass ``axis_name`` and they are reduced over it, so every device
holds the same state.

References:
  Rudman & Eickhoff, `Stable Anisotropic Regularization
  <https://arxiv.org/abs/2305.19358>`_, ICLR 2024 (IsoScore*, Eq. 4–5; I-STAR, Sec. 4).
"""

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from isojax import isotropy, norms, stats

STABILIZERS = ("pass", "epoch", "ema")
WINDOW_UNITS = ("steps", "tokens")

_STATS_DTYPE = jnp.float32
# The window's token count is a float32 sum of 0/1 weights: exact up to 2**24 tokens.
_MAX_TOKEN_WINDOW = 2**24


def identity_init(key: jax.Array | None, shape: tuple[int, int], dtype=_STATS_DTYPE) -> jax.Array:
    """The default ``C₀`` before any update: the identity (SPEC.md §4, "no sample")."""
    del key
    return jnp.eye(shape[0], shape[1], dtype=dtype)


def replace_c0(batch_stats: dict, c0: jax.typing.ArrayLike) -> dict:
    """``batch_stats`` of an :class:`IsoScoreStar` with ``c0`` put in as the stabiliser.

    For the ``pass`` stabiliser (``C₀`` from :mod:`isojax.regularizers`' explicit pass at the
    start of each epoch), or to seed a running mode with a known ``C₀``. The rest of the state
    (window, EMA, counters) is left as it is.

    Args:
      batch_stats: the module's own collection (holding ``'c0'``), not a parent's.
      c0: ``[d, d]`` stabilising covariance; stored as float32.

    Returns:
      A new dict; the input is not modified.
    """
    if "c0" not in batch_stats:
        raise ValueError(
            f"batch_stats has no 'c0' (keys {sorted(batch_stats)}): pass the IsoScoreStar "
            "module's own collection, e.g. variables['batch_stats']['istar'] for a submodule"
        )
    c0 = jnp.asarray(c0, _STATS_DTYPE)
    if c0.shape != batch_stats["c0"].shape:
        raise ValueError(f"c0 has shape {c0.shape}, the state holds {batch_stats['c0'].shape}")
    return {**batch_stats, "c0": c0}


def _stack(hidden_states: jax.Array | Sequence[jax.Array]) -> jax.Array:
    """A sequence of L arrays ``[batch, len, d]`` -> ``[L, batch, len, d]``; arrays pass."""
    if isinstance(hidden_states, list | tuple):
        if not hidden_states:
            raise ValueError("hidden_states is an empty sequence")
        return jnp.stack(hidden_states)
    return jnp.asarray(hidden_states)


def _moment_state(batch: stats.Moments) -> stats.MomentState:
    """The accumulator of one batch back from its ``ddof=1`` moments (``m2 = cov·(n − 1)``)."""
    return stats.MomentState(
        count=batch.count, mean=batch.mean, m2=batch.cov * jnp.maximum(batch.count - 1, 1)
    )


class IsoScoreStar(nn.Module):
    r"""IsoScore* of a batch of hidden states, with a running stabiliser ``C₀``.

    .. math::
      C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta\,\mathrm{sg}(C_0),\qquad
      \iota^* = \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},

    with ``cov`` unbiased (``torch.cov``, as the reference) over the unmasked tokens of all
    layers, and ``sg`` stop-gradient. The I-STAR loss adds ``λ (1 − ι*)``.

    ``batch_stats`` (float32, ``[d, d]`` matrices, int32 counters):

    - every stabiliser: ``c0``, the stabiliser the score uses;
    - ``epoch``: ``window_count`` ``[]``, ``window_mean`` ``[d]``, ``window_m2`` ``[d, d]`` (the
      fields of :class:`isojax.stats.MomentState` for the open window), ``steps_in_window``,
      ``windows_closed``, ``count``, ``skipped``;
    - ``ema``: ``ema`` (the raw moving average: starts at ``c0_init``, or at zero with
      ``debias``), ``count``, ``skipped``.

    ``epoch``: each training batch is merged into the window; when the window holds
    ``window`` steps (or at least ``window`` tokens: the batch that crosses the threshold is
    included whole), ``c0 ← cov(window tokens)`` (unbiased; kept as it was if the window holds
    fewer than 2 tokens) and the window restarts empty.

    ``ema``: ``ema ← m·ema + (1 − m)·cov(X)``, ``c0 = ema`` or, with ``debias``,
    ``c0 = ema / (1 − m^count)``.

    Attributes:
      stabilizer: ``pass``, ``epoch`` or ``ema`` (see the module docstring).
      zeta: shrinkage weight ``ζ`` in ``[0, 1]`` (reference default 0.2).
      window: ``epoch`` window length, in ``window_unit``s (default: the reference's 250 000
        tokens; for exactly one epoch use ``window_unit='steps'`` and the steps per epoch).
      window_unit: ``tokens`` (unmasked token vectors, all layers counted) or ``steps``.
      momentum: ``ema`` decay ``m`` in ``[0, 1)``.
      debias: ``ema`` bias correction ``1/(1 − m^count)`` (with a zero start).
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
    zeta: float = 0.2
    window: int = 250_000
    window_unit: str = "tokens"
    momentum: float = 0.99
    debias: bool = False
    c0_init: Callable = identity_init
    use_running_average: bool | None = None
    axis_name: str | None = None

    def _check_config(self) -> None:
        if self.stabilizer not in STABILIZERS:
            raise ValueError(
                f"unknown stabilizer {self.stabilizer!r}; known: {', '.join(STABILIZERS)}"
            )
        if not 0.0 <= float(self.zeta) <= 1.0:
            raise ValueError(f"zeta must lie in [0, 1], got {self.zeta}")
        if self.stabilizer == "epoch":
            if self.window_unit not in WINDOW_UNITS:
                raise ValueError(
                    f"window_unit must be one of {WINDOW_UNITS}, got {self.window_unit!r}"
                )
            if int(self.window) < 1:
                raise ValueError(f"window must be a positive number of {self.window_unit}")
            if self.window_unit == "tokens" and self.window > _MAX_TOKEN_WINDOW:
                raise ValueError(
                    f"a token window above 2**24 ({self.window}) is not counted exactly in "
                    "float32; use window_unit='steps'"
                )
        if self.stabilizer == "ema" and not 0.0 <= float(self.momentum) < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {self.momentum}")

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
          mask: weights broadcastable to the leading shape, e.g. the ``[batch, len]`` attention
            mask (1 keeps a token, 0 drops padding); None keeps every token (the reference's
            parity setting).
          use_running_average: True leaves the state untouched (evaluation, or the ``pass``
            stabiliser, which never updates itself).

        Returns:
          Scalar float32 IsoScore* in ``[0, 1]``; the penalty is ``1 − score``.
        """
        self._check_config()
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        x = _stack(hidden_states)
        if x.ndim < 2:
            raise ValueError(f"hidden_states must be [..., d], got shape {x.shape}")
        d = x.shape[-1]
        c0 = self.variable(
            "batch_stats", "c0", lambda: jnp.asarray(self.c0_init(None, (d, d), _STATS_DTYPE))
        )
        if c0.value.shape != (d, d):
            raise ValueError(
                f"batch_stats['c0'] has shape {c0.value.shape} but the hidden states "
                f"{x.shape} have d={d}: expected ({d}, {d})"
            )

        initializing = self.is_initializing()
        # One unbiased covariance serves the score (differentiable) and the update (detached).
        batch = stats.batch_moments(
            x, mask, ddof=1, axis_name=None if initializing else self.axis_name
        )
        score = isotropy.isoscore_star_from_cov(
            batch.cov, c0=lax.stop_gradient(c0.value), zeta=self.zeta
        )

        if self.stabilizer == "epoch":
            self._epoch_update(batch, c0, d, update=not (use_running_average or initializing))
        elif self.stabilizer == "ema":
            self._ema_update(batch, c0, d, update=not (use_running_average or initializing))
        return score

    def _epoch_update(self, batch: stats.Moments, c0: nn.Variable, d: int, update: bool):
        empty = stats.moments_init(d, _STATS_DTYPE)
        w_count = self.variable("batch_stats", "window_count", lambda: empty.count)
        w_mean = self.variable("batch_stats", "window_mean", lambda: empty.mean)
        w_m2 = self.variable("batch_stats", "window_m2", lambda: empty.m2)
        steps = self.variable("batch_stats", "steps_in_window", jnp.zeros, (), jnp.int32)
        closed = self.variable("batch_stats", "windows_closed", jnp.zeros, (), jnp.int32)
        counters = norms.skip_counters(self)
        if not update:
            return

        batch = jax.tree.map(lax.stop_gradient, batch)
        ok = (
            (batch.count > 0) & jnp.all(jnp.isfinite(batch.mean)) & jnp.all(jnp.isfinite(batch.cov))
        )
        old = stats.MomentState(count=w_count.value, mean=w_mean.value, m2=w_m2.value)
        window = stats.moments_merge(old, _moment_state(batch))
        new_steps = steps.value + 1
        if self.window_unit == "steps":
            closes = new_steps >= self.window
        else:
            closes = window.count >= self.window
        window_c0 = stats.moments_finalize(window, ddof=1).cov  # [d, d]
        new_c0 = jnp.where(closes & (window.count > 1), window_c0, c0.value)
        window = jax.tree.map(lambda e, w: jnp.where(closes, e, w), empty, window)
        norms.guarded_update(
            self,
            [
                (c0, new_c0),
                (w_count, window.count),
                (w_mean, window.mean),
                (w_m2, window.m2),
                (steps, jnp.where(closes, 0, new_steps)),
                (closed, closed.value + closes.astype(jnp.int32)),
            ],
            counters,
            ok,
        )

    def _ema_update(self, batch: stats.Moments, c0: nn.Variable, d: int, update: bool):
        if self.debias:
            ema = self.variable("batch_stats", "ema", jnp.zeros, (d, d), _STATS_DTYPE)
        else:
            ema = self.variable("batch_stats", "ema", lambda: c0.value)
        counters = norms.skip_counters(self)
        if not update:
            return

        cov = lax.stop_gradient(batch.cov)
        ok = (batch.count > 0) & jnp.all(jnp.isfinite(batch.mean)) & jnp.all(jnp.isfinite(cov))
        new_ema = self.momentum * ema.value + (1.0 - self.momentum) * cov
        new_c0 = new_ema
        if self.debias:
            t = (counters[0].value + 1).astype(_STATS_DTYPE)
            new_c0 = new_ema / (1.0 - self.momentum**t)
        norms.guarded_update(self, [(ema, new_ema), (c0, new_c0)], counters, ok)


def make_isoscore_star(
    stabilizer: str,
    *,
    zeta: float = 0.2,
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
      ValueError: unknown stabiliser or field.
    """
    if stabilizer not in STABILIZERS:
        raise ValueError(f"unknown stabilizer {stabilizer!r}; known: {', '.join(STABILIZERS)}")
    fields = set(IsoScoreStar.__dataclass_fields__) - {"parent", "stabilizer", "zeta", "axis_name"}
    unknown = sorted(set(hparams) - fields)
    if unknown:
        raise ValueError(f"IsoScoreStar has no field(s) {unknown}; it takes {sorted(fields)}")
    return IsoScoreStar(stabilizer=stabilizer, zeta=zeta, axis_name=axis_name, **hparams)


def init_batch_stats(module: IsoScoreStar, d: int) -> dict:
    """The initial ``'batch_stats'`` of ``module`` for hidden size ``d`` (no data needed).

    ``C₀`` is ``module.c0_init`` (the identity by default), windows and counters are empty.
    Carry the result in the train state and checkpoint it with it.
    """
    dummy = jnp.zeros((2, d), _STATS_DTYPE)  # two tokens: the moments are defined
    return module.init(jax.random.key(0), dummy, use_running_average=True)["batch_stats"]


def penalty_and_update(
    module: IsoScoreStar,
    batch_stats: dict,
    hidden_states: jax.Array | Sequence[jax.Array],
    mask: jax.typing.ArrayLike | None,
    *,
    train: bool = True,
) -> tuple[jax.Array, dict]:
    r"""The I-STAR penalty ``1 − IsoScore*`` of a batch and the updated stabiliser state.

    Differentiable with respect to ``hidden_states`` (through the batch covariance only); the
    returned state carries no gradient. With ``train=False`` (or the ``pass`` stabiliser) the
    state comes back unchanged.

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
