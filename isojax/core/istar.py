r"""IsoScore* with its stabilising covariance ``C₀`` as running state in ``'batch_stats'``.

I-STAR (SPEC.md §4) shrinks the batch covariance towards a stabiliser,
``C_ζ = (1 − ζ) cov(X) + ζ C₀``, and the reference rebuilds ``C₀`` at the start of every
epoch with a separate pass over at least 250 000 training tokens (eval mode, no gradient).
:class:`IsoScoreStar` keeps ``C₀`` as running statistics of the tokens the training steps
see anyway, so no extra pass (and no second input pipeline) is needed, and ``C₀``
checkpoints, shards and resumes like batch norm. Three stabilisers, by name:

``pass``
  the reference: ``C₀`` is held fixed in ``batch_stats['c0']``; the training loop replaces it
  (:func:`replace_c0`) with the explicit pass of :mod:`isojax.core.penalties` each epoch.
``epoch``
  accumulate the tokens of a window (``window`` steps or tokens) with the streaming moments
  of :mod:`isojax.core.stats` (Chan et al.), and swap their unbiased covariance in as ``C₀`` when
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
moments in, new state out), which the pure :func:`step` applies under
:mod:`isojax.core.running`'s guard (``guarded``); the linen :class:`isojax.linen.IsoScoreStar` and
``isojax.nnx.IsoScoreStar`` both run that step on their state. Before any window closes (or
any EMA update) ``C₀`` is ``c0_init``: the identity (the reference's choice with no sample), or
a matrix the caller supplies.

Order within a step: the score is computed with the ``C₀`` of the *previous* steps, then the
state is updated. The reference builds ``C₀`` before the epoch's first step, so the batch that
closes a window never sees the ``C₀`` it completes (likewise a batch never sees itself in the
EMA). Gradients: the penalty ``1 − IsoScore*`` differentiates through the batch covariance
only; ``C₀`` enters as ``stop_gradient`` and the state is updated from ``stop_gradient(X)``.

Bad batches (:mod:`isojax.core.running`, the convention shared with :mod:`isojax.linen.norms`): a
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

import jax
import jax.numpy as jnp
from jax import lax

from isojax.core import isotropy, penalties, running, stats
from isojax.core.running import STATS_DTYPE

STABILIZERS = ("pass", "epoch", "ema")
WINDOW_UNITS = ("steps", "tokens")
# The window's token count is a float32 sum of 0/1 weights: exact up to 2**24 tokens.
MAX_TOKEN_WINDOW = 2**24


check_zeta = isotropy.check_zeta  # the shrinkage ``ζ`` in ``[0, 1]``, IsoScore*'s one check


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
    :func:`isojax.core.penalties.estimate_c0`, before each epoch), or to seed a running
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
    return {**batch_stats, "c0": checked_c0(c0, batch_stats["c0"].shape)}


def checked_c0(c0: jax.typing.ArrayLike, shape: tuple) -> jax.Array:
    """``c0`` as float32, or ValueError (one line) unless it has the state's `shape`."""
    c0 = jnp.asarray(c0, STATS_DTYPE)
    if c0.shape != tuple(shape):
        raise ValueError(f"c0 has shape {c0.shape}, the state holds {tuple(shape)}")
    return c0


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


# ----------------------------------------------------------------------------------------------
# The step, once: state in, `(score, new state, ok)` out; both front ends run it.
# ----------------------------------------------------------------------------------------------

# The settings' defaults, read by both front ends' classes (`check_hparams` is their rule).
DEFAULTS = {
    "zeta": 0.2,
    "window": 250_000,
    "window_unit": "tokens",
    "momentum": 0.99,
    "debias": True,
}
_SETTINGS = ("stabilizer", "window", "window_unit", "momentum", "debias")
# What else a `make_isoscore_star` of either front end takes by keyword; linen adds `name`.
OTHER_FIELDS = ("c0_init", "use_running_average")


def rule_for(
    stabilizer: str, *, window: int, window_unit: str, momentum: float, debias: bool
) -> tuple[Callable | None, Callable, dict]:
    """`(update rule or None, state init c0 -> dict, the rule's hyper-parameters)`."""
    if stabilizer == "epoch":
        hparams = {"window": window, "window_unit": window_unit}
        return epoch_rule, lambda c0: epoch_state(c0.shape[-1]), hparams
    if stabilizer == "ema":
        hparams = {"momentum": momentum, "debias": debias}
        return ema_rule, lambda c0: ema_state(c0, debias), hparams
    return None, lambda c0: {}, {}


def state_init(c0: jax.Array, stabilizer: str, **settings) -> dict[str, jax.Array]:
    """The whole running state of a stabiliser from its initial ``c0`` `[d, d]`: ``c0``, the
    rule's state and (``epoch``, ``ema``) the ``count``/``skipped`` counters. `settings`:
    ``window``, ``window_unit``, ``momentum``, ``debias``."""
    rule, init_state, _ = rule_for(stabilizer, **settings)
    if rule is None:
        return {"c0": c0}
    return {"c0": c0, **init_state(c0), **running.counters_init()}


def prepare(
    hidden_states: jax.Array | Sequence[jax.Array], mask: jax.typing.ArrayLike | None
) -> tuple[jax.Array, jax.Array | None]:
    """`([..., d] token vectors, mask of their shape or None)`: layers stacked, one
    `[batch, len]` mask broadcast over them."""
    x = penalties.stack_layers(hidden_states, ndim=None)
    if mask is not None and jnp.ndim(mask) == x.ndim - 2:  # one [batch, len] mask, L layers
        mask = jnp.broadcast_to(jnp.asarray(mask), x.shape[:-1])
    return x, mask


def step(
    state: dict,
    x: jax.Array,
    mask: jax.Array | None,
    *,
    update: bool,
    stabilizer: str,
    zeta: float,
    axis_name: str | None = None,
    train: bool = True,
    **settings,
) -> tuple[jax.Array, dict | None, jax.Array | None]:
    """IsoScore* of the batch with the state's ``C₀``; then (`update`, a running stabiliser)
    the rule's new state under the bad-batch guard.

    Args:
      state: `state_init`'s dict, or the previous step's.
      x, mask: `prepare`'s token vectors `[..., d]` and mask.
      update: move the state (training with ``epoch`` or ``ema``).
      train: not read (the common signature of :func:`isojax.linen.running.linen_step`): the score
        is the batch's in training and evaluation alike.
      stabilizer, zeta, settings: the module's settings (`DEFAULTS`).
      axis_name: mapped axis to reduce the moments over (shard_map/pmap).

    Returns:
      `(score [] float32, new state or None, ok or None)`; None where the state does not move.
    """
    del train
    # One unbiased covariance serves the score (differentiable) and the update (detached).
    batch = stats.batch_moments(x, mask, ddof=1, axis_name=axis_name)
    score = isotropy.isoscore_star_from_cov(batch.cov, c0=lax.stop_gradient(state["c0"]), zeta=zeta)
    rule, _, hparams = rule_for(stabilizer, **settings)
    if rule is None or not update:
        return score, None, None
    batch = jax.tree.map(lax.stop_gradient, batch)
    new = rule(state, batch, state["count"], **hparams)
    ok = running.batch_ok(batch.count, batch.mean, batch.cov, min_count=1)
    return score, running.guarded(state, new, ok), ok


def state_for(module, d: int) -> dict[str, jax.Array]:
    """The initial running state of an IsoScore* module of either front end for feature size
    `d`: `state_init` of ``module.c0_init(None, (d, d), float32)`` and its settings."""
    c0 = jnp.asarray(module.c0_init(None, (d, d), STATS_DTYPE))
    return state_init(c0, **{k: getattr(module, k) for k in _SETTINGS})


def checked_settings(module) -> dict:
    """The stabiliser settings of an IsoScore* module of either front end (``stabilizer``,
    ``window``, ``window_unit``, ``momentum``, ``debias``), after `check_zeta` and
    `check_hparams`."""
    check_zeta(module.zeta)
    check_hparams(
        module.stabilizer,
        window=module.window,
        window_unit=module.window_unit,
        momentum=module.momentum,
    )
    return {name: getattr(module, name) for name in _SETTINGS}


def check_fields(hparams: dict, *, front: str = "linen") -> None:
    """Raises ValueError (one line) for a keyword that an IsoScore* module does not take: the
    `DEFAULTS` besides ``zeta``, `OTHER_FIELDS` and (linen) ``name``."""
    fields = (
        (set(DEFAULTS) - {"zeta"}) | set(OTHER_FIELDS) | ({"name"} if front == "linen" else set())
    )
    unknown = sorted(set(hparams) - fields)
    if unknown:
        raise ValueError(f"IsoScoreStar has no field(s) {unknown}; it takes {sorted(fields)}")
