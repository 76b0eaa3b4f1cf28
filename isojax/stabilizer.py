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
  the window closes. This approximates the reference's per-epoch ``C₀`` without the extra
  pass; it is not the same matrix. (1) Its tokens are the training steps' own, from train
  mode (dropout on), where the pass runs in eval mode. (2) They come from parameters that
  change during the window (every step of it updates them), where the pass sees one set of
  parameters. (3) Its ``C₀`` takes effect one window late: the steps of a window use the
  previous window's ``C₀`` (the identity during the first), where the reference's ``C₀`` is
  built from the current parameters before the steps that use it.
  ``experiments/bench/stabilizer_gap.py`` measures the gap (relative Frobenius distance to the
  pass's ``C₀``, and its effect on IsoScore* and on the penalty's gradient).
``ema``
  ``C₀`` is an exponential moving average of the unbiased batch covariances, in Flax's form
  ``ema ← m·ema + (1 − m)·cov(X)``. With ``debias`` (the default) the average starts at zero
  and is divided by ``1 − m^t`` as Adam does, so the first update gives ``C₀ = cov(X₁)``, at
  the scale of the hidden states from the first step. Without it the average starts at
  ``c0_init`` (the identity), whose scale has nothing to do with the hidden states': with
  ``m = 0.99`` the early ``C₀`` is then mostly identity. Like ``epoch``, an approximation of
  the pass: train-mode tokens, under parameters that changed over the average's horizon.

Each mode's update is a small pure rule (:func:`epoch_rule`, :func:`ema_rule`: state and batch
moments in, new state out); the module applies it through :mod:`isojax.running`'s guarded
update. Before any window closes (or any EMA update) ``C₀`` is ``c0_init``: the identity (the
reference's choice with no sample), or a matrix the caller supplies.

Order within a step: the score is computed with the ``C₀`` of the *previous* steps, then the
state is updated. The reference builds ``C₀`` before the epoch's first step, so the batch that
closes a window never sees the ``C₀`` it completes (likewise a batch never sees itself in the
EMA). Gradients: the penalty ``1 − IsoScore*`` differentiates through the batch covariance
only; ``C₀`` enters as ``stop_gradient`` and the state is updated from ``stop_gradient(X)``.

Bad batches (:mod:`isojax.running`, the convention shared with :mod:`isojax.norms`): a
training batch with no unmasked token or with non-finite moments leaves the running state
exactly as it was, adds 1 to ``batch_stats['skipped']`` and sows
``intermediates['skipped_batch'] = True``; applied updates count in ``batch_stats['count']``.
All state is float32 whatever the input dtype.

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

from isojax import isotropy, regularizers, running, stats
from isojax.running import STATS_DTYPE

STABILIZERS = ("pass", "epoch", "ema")
WINDOW_UNITS = ("steps", "tokens")
# The window's token count is a float32 sum of 0/1 weights: exact up to 2**24 tokens.
MAX_TOKEN_WINDOW = 2**24


def check_zeta(zeta: float) -> None:
    """Raises ValueError unless the shrinkage ``ζ`` lies in ``[0, 1]``."""
    if not 0.0 <= float(zeta) <= 1.0:
        raise ValueError(f"zeta must lie in [0, 1], got {zeta}")


def check_hparams(
    kind: str, *, window: int = 1, window_unit: str = "tokens", momentum: float = 0.99
) -> None:
    """The one rule for each stabiliser setting (the module and the config both call it).

    Raises ValueError (one line) for an unknown ``kind`` or ``window_unit``, a ``window`` below
    1 (or above 2**24 tokens, not counted exactly in float32), a ``momentum`` outside (0, 1).
    """
    if kind not in STABILIZERS:
        raise ValueError(f"unknown stabilizer {kind!r}; known: {', '.join(STABILIZERS)}")
    if window_unit not in WINDOW_UNITS:
        raise ValueError(f"window_unit must be one of {WINDOW_UNITS}, got {window_unit!r}")
    if int(window) < 1:
        raise ValueError(f"window must be a positive number of {window_unit}, got {window}")
    if window_unit == "tokens" and window > MAX_TOKEN_WINDOW:
        raise ValueError(
            f"a token window above 2**24 ({window}) is not counted exactly in float32; "
            "use window_unit 'steps'"
        )
    if not 0.0 < float(momentum) < 1.0:
        raise ValueError(f"momentum {momentum} not in (0, 1)")


def identity_init(key: jax.Array | None, shape: tuple[int, int], dtype=STATS_DTYPE) -> jax.Array:
    """The default ``C₀`` before any update: the identity (SPEC.md §4, "no sample")."""
    del key
    return jnp.eye(shape[0], shape[1], dtype=dtype)


def replace_c0(batch_stats: dict, c0: jax.typing.ArrayLike) -> dict:
    """``batch_stats`` of an :class:`IsoScoreStar` with ``c0`` put in as the stabiliser.

    For the ``pass`` stabiliser (``C₀`` from the explicit pass,
    :func:`isojax.regularizers.estimate_stabilizer`, before each epoch), or to seed a running
    mode with a known ``C₀``. The rest of the state (window, EMA, counters) is left as it is.

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
    c0 = jnp.asarray(c0, STATS_DTYPE)
    if c0.shape != batch_stats["c0"].shape:
        raise ValueError(f"c0 has shape {c0.shape}, the state holds {batch_stats['c0'].shape}")
    return {**batch_stats, "c0": c0}


def _moment_state(batch: stats.Moments) -> stats.MomentState:
    """The accumulator of one batch back from its ``ddof=1`` moments (``m2 = cov·(n − 1)``)."""
    return stats.MomentState(
        count=batch.count, mean=batch.mean, m2=batch.cov * jnp.maximum(batch.count - 1, 1)
    )


# ----------------------------------------------------------------------------------------------
# The update rules: `(state, batch moments, count) -> new state`, pure, float32.
# ----------------------------------------------------------------------------------------------


def epoch_state(d: int) -> dict:
    """The ``epoch`` rule's state besides ``c0``: an empty window."""
    empty = stats.moments_init(d, STATS_DTYPE)
    return {
        "window_count": empty.count,
        "window_mean": empty.mean,
        "window_m2": empty.m2,
        "steps_in_window": jnp.zeros((), jnp.int32),
        "windows_closed": jnp.zeros((), jnp.int32),
    }


def epoch_rule(state: dict, batch: stats.Moments, count, *, window: int, window_unit: str):
    """Merge the batch into the window; when it closes, ``c0 ← cov(window)`` and it restarts.

    The window closes after ``window`` steps, or once it holds at least ``window`` tokens (the
    batch that crosses the threshold is included whole). ``cov`` is unbiased; a window of
    fewer than 2 tokens leaves ``c0`` as it was.
    """
    del count
    d = state["c0"].shape[-1]
    old = stats.MomentState(state["window_count"], state["window_mean"], state["window_m2"])
    merged = stats.moments_merge(old, _moment_state(batch))
    new_steps = state["steps_in_window"] + 1
    closes = (new_steps if window_unit == "steps" else merged.count) >= window
    window_c0 = stats.moments_finalize(merged, ddof=1).cov  # [d, d]
    empty = epoch_state(d)
    restart = {"window_count": merged.count, "window_mean": merged.mean, "window_m2": merged.m2}
    restart = {key: jnp.where(closes, empty[key], value) for key, value in restart.items()}
    return {
        "c0": jnp.where(closes & (merged.count > 1), window_c0, state["c0"]),
        **restart,
        "steps_in_window": jnp.where(closes, 0, new_steps),
        "windows_closed": state["windows_closed"] + closes.astype(jnp.int32),
    }


def ema_state(c0: jax.Array, debias: bool) -> dict:
    """The ``ema`` rule's state: the raw average, at zero (``debias``) or at ``c0_init``."""
    return {"ema": jnp.zeros_like(c0) if debias else c0}


def ema_rule(state: dict, batch: stats.Moments, count, *, momentum: float, debias: bool):
    """``ema ← m·ema + (1 − m)·cov(X)``; ``c0 = ema``, or ``ema / (1 − m^t)`` with ``debias``
    (``t`` the number of updates including this one: ``c0 = cov(X₁)`` after the first)."""
    new_ema = running.ema(momentum, state["ema"], batch.cov)
    new_c0 = new_ema
    if debias:
        new_c0 = new_ema / (1.0 - momentum ** (count + 1).astype(STATS_DTYPE))
    return {"ema": new_ema, "c0": new_c0}


class IsoScoreStar(nn.Module):
    r"""IsoScore* of a batch of hidden states, with a running stabiliser ``C₀``.

    .. math::
      C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta\,\mathrm{sg}(C_0),\qquad
      \iota^* = \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},

    with ``cov`` unbiased (``torch.cov``, as the reference) over the unmasked tokens of all
    layers, and ``sg`` stop-gradient; the score is :func:`isojax.isotropy.isoscore_star_from_cov`
    of that covariance. The I-STAR loss adds ``λ (1 − ι*)`` (:func:`penalty_and_update`).

    ``batch_stats`` (float32, ``[d, d]`` matrices, int32 counters): ``c0``, the stabiliser the
    score uses; for ``epoch`` the open window (:func:`epoch_state`: ``window_count``,
    ``window_mean``, ``window_m2``, ``steps_in_window``, ``windows_closed``), for ``ema`` the
    raw average ``ema``; for both the ``count``/``skipped`` counters of :mod:`isojax.running`.
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
    zeta: float = 0.2
    window: int = 250_000
    window_unit: str = "tokens"
    momentum: float = 0.99
    debias: bool = True
    c0_init: Callable = identity_init
    use_running_average: bool | None = None
    axis_name: str | None = None

    def _rule(self) -> tuple[Callable | None, Callable, dict]:
        """`(update rule or None, state init d|c0 -> dict, the rule's hyper-parameters)`."""
        if self.stabilizer == "epoch":
            hparams = {"window": self.window, "window_unit": self.window_unit}
            return epoch_rule, lambda c0: epoch_state(c0.shape[-1]), hparams
        if self.stabilizer == "ema":
            hparams = {"momentum": self.momentum, "debias": self.debias}
            return ema_rule, lambda c0: ema_state(c0, self.debias), hparams
        return None, lambda c0: {}, {}

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
        check_zeta(self.zeta)
        check_hparams(
            self.stabilizer,
            window=self.window,
            window_unit=self.window_unit,
            momentum=self.momentum,
        )
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        x = regularizers.stack_layers(hidden_states, ndim=None)
        if mask is not None and jnp.ndim(mask) == x.ndim - 2:  # one [batch, len] mask, L layers
            mask = jnp.broadcast_to(jnp.asarray(mask), x.shape[:-1])
        d = x.shape[-1]
        c0 = self.variable(
            "batch_stats", "c0", lambda: jnp.asarray(self.c0_init(None, (d, d), STATS_DTYPE))
        )
        running.check_state_shape(self, "c0", c0.value.shape, (d, d), x.shape)
        initializing = self.is_initializing()
        # One unbiased covariance serves the score (differentiable) and the update (detached).
        batch = stats.batch_moments(
            x, mask, ddof=1, axis_name=None if initializing else self.axis_name
        )
        score = isotropy.isoscore_star_from_cov(
            batch.cov, c0=lax.stop_gradient(c0.value), zeta=self.zeta
        )
        rule, init_state, hparams = self._rule()
        if rule is None:
            return score
        variables = {"c0": c0}
        for name, value in init_state(c0.value).items():
            variables[name] = self.variable("batch_stats", name, lambda v=value: v)
        counters = running.skip_counters(self)
        if use_running_average or initializing:
            return score
        batch = jax.tree.map(lax.stop_gradient, batch)
        state = {name: v.value for name, v in variables.items()}
        new = rule(state, batch, counters[0].value, **hparams)
        ok = running.batch_ok(batch.count, batch.mean, batch.cov, min_count=1)
        pairs = [(variables[name], value) for name, value in new.items()]
        running.guarded_update(self, pairs, counters, ok)
        return score


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
      ValueError: unknown stabiliser or field, or a value out of range (:func:`check_hparams`).
    """
    fields = set(IsoScoreStar.__dataclass_fields__) - {"parent", "stabilizer", "zeta", "axis_name"}
    unknown = sorted(set(hparams) - fields)
    if unknown:
        raise ValueError(f"IsoScoreStar has no field(s) {unknown}; it takes {sorted(fields)}")
    module = IsoScoreStar(stabilizer=stabilizer, zeta=zeta, axis_name=axis_name, **hparams)
    check_zeta(zeta)
    check_hparams(
        stabilizer, window=module.window, window_unit=module.window_unit, momentum=module.momentum
    )
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
    the stateless :func:`isojax.regularizers.istar_penalty` (tested); both run
    :func:`isojax.isotropy.isoscore_star_from_cov`. Differentiable with respect to
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
