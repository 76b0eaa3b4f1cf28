"""Isotropy regularisers as pure loss terms: I-STAR and CosReg, and I-STAR's stabiliser `C0`.

The train step adds `weight * penalty` to the task loss (weight > 0 pushes towards isotropy for
both penalties here, weight < 0 away from it). The stabiliser `C0` is estimated by a pure
accumulate-then-finalise pass (`c0_pass_init` / `c0_pass_update` / `c0_pass_finalize`,
driven by `estimate_c0`, the one C0 pass the training loop runs) over batches in eval
mode; its state is a `stats.MomentState` pytree, so it can be carried in
(and checkpointed with) the train state, and `C0` itself is a plain `[d, d]` array, never a
parameter.

Padding. The reference code feeds every position, padding included, into both the penalty and
`C0`. Here `mask` (the `[batch, len]` attention mask) leaves padding out by default;
`include_padding=True` keeps it, for parity with the reference.
"""

from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from isojax.core import isotropy, stats

# The token penalties a fine-tuning run can add to its loss (`config.penalty`), "none" first.
PENALTIES = ("none", "istar", "cosreg")


def stack_layers(
    hidden_states: Sequence[jax.Array] | jax.Array, *, ndim: int | None = 4
) -> jax.Array:
    """L arrays `[batch, len, d]` -> one stacked `[L, batch, len, d]`; an array passes through.

    Args:
        hidden_states: a sequence of layers of one shape, or one array.
        ndim: the rank the result must have (4: `[L, batch, len, d]`); None accepts any
            `[..., d]` with at least 2 axes (`isojax.linen.IsoScoreStar`).
    """
    if isinstance(hidden_states, list | tuple):
        if not hidden_states:
            raise ValueError("hidden_states is empty: need at least one layer [batch, len, d]")
        shapes = [tuple(h.shape) for h in hidden_states]
        if len(set(shapes)) != 1 or (ndim is not None and any(len(s) != ndim - 1 for s in shapes)):
            raise ValueError(
                f"hidden_states must be layers of one shape [batch, len, d]; got shapes {shapes}"
            )
        return jnp.stack(hidden_states)
    hidden_states = jnp.asarray(hidden_states)
    if ndim is None and hidden_states.ndim < 2:
        raise ValueError(f"hidden_states must be [..., d], got shape {hidden_states.shape}")
    if ndim is not None and hidden_states.ndim != ndim:
        raise ValueError(
            "hidden_states must be a sequence of [batch, len, d] arrays or one stacked "
            f"[layers, batch, len, d] array; got an array of shape {hidden_states.shape}"
        )
    return hidden_states


def _token_mask(
    mask: jax.typing.ArrayLike | None, batch_len: tuple[int, int], include_padding: bool
) -> jax.Array | None:
    """Checks the `[batch, len]` attention mask; None when every position counts."""
    if mask is None or include_padding:
        return None
    mask = jnp.asarray(mask)
    if tuple(mask.shape) != tuple(batch_len):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not match the hidden states' "
            f"[batch, len] = {tuple(batch_len)}"
        )
    return mask


def _layer_tokens(
    hidden_states: Sequence[jax.Array] | jax.Array,
    mask: jax.typing.ArrayLike | None,
    include_padding: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """`([L, batch, len, d] points, [L, batch, len] mask or None)` for statistics over tokens."""
    points = stack_layers(hidden_states)  # [L, b, t, d]
    token_mask = _token_mask(mask, points.shape[1:3], include_padding)
    if token_mask is not None:
        token_mask = jnp.broadcast_to(token_mask, points.shape[:3])  # [L, b, t]
    return points, token_mask


def istar_penalty(
    hidden_states: Sequence[jax.Array] | jax.Array,
    mask: jax.typing.ArrayLike | None,
    *,
    c0: jax.typing.ArrayLike | None = None,
    zeta: float = 0.2,
    include_padding: bool = False,
    axis_name: str | None = None,
) -> jax.Array:
    r"""I-STAR penalty `1 − IsoScore*(X)` over every token of every layer (SPEC.md §4).

    .. math::
        C_\zeta = (1-\zeta)\,\mathrm{cov}(X) + \zeta C_0,\qquad
        R = 1 - \frac{\mathrm{PR}(C_\zeta) - 1}{d - 1},\qquad
        \mathrm{PR}(C) = \frac{(\operatorname{tr} C)^2}{\lVert C\rVert_F^2},

    where `X` stacks the token vectors of all L layers (embedding layer excluded) of the batch,
    `cov` is unbiased (as `torch.cov` in the reference), and PR equals the reference's
    singular-value route exactly (SPEC.md §3). The loss is `L_task + λ R`: λ > 0 pushes
    towards isotropy, λ < 0 (the paper's usual choice) away from it. Differentiable with
    respect to the hidden states (unlike the PyPI package's `IsoScore_star`, which detaches
    its input by default).

    Args:
        hidden_states: L arrays `[batch, len, d]`, or one `[L, batch, len, d]`; any float dtype.
        mask: `[batch, len]` attention mask (1 = token, 0 = padding), or None for all tokens.
        c0: `[d, d]` stabilising covariance (see `c0_pass_finalize`); identity when None.
            Cast to the statistics dtype (float32), so a float64 `C0` does not promote the loss.
        zeta: shrinkage weight in [0, 1]; 0 is plain IsoScore of the batch, 1 gives no gradient.
        include_padding: keep padding positions, as the reference does.
        axis_name: mapped axis (`shard_map`/`pmap`) the batch is split over: the moments are
            summed over it (`isotropy.isoscore_star`), so the penalty is the global batch's on
            every device. Not needed under `jax.jit` with a sharded batch.

    Returns:
        Scalar float32 in [0, 1] (float64 for float64 input).

    References:
        Rudman, Eickhoff, `Stable Anisotropic Regularization
        <https://arxiv.org/abs/2305.19358>`_, ICLR 2024, Sec. 4 (Eq. 4-5).
    """
    points, token_mask = _layer_tokens(hidden_states, mask, include_padding)
    d = points.shape[-1]
    dtype = stats.stats_dtype(points.dtype)
    if c0 is not None:
        c0 = jnp.asarray(c0)
        if tuple(c0.shape) != (d, d):
            raise ValueError(f"c0 of shape {tuple(c0.shape)} does not match feature size d={d}")
        c0 = c0.astype(dtype)
    score = isotropy.isoscore_star(points, c0=c0, zeta=zeta, mask=token_mask, axis_name=axis_name)
    return (1.0 - score).astype(dtype)


def cosreg_penalty(
    hidden: jax.Array,
    mask: jax.typing.ArrayLike | None,
    include_padding: bool = False,
    *,
    axis_name: str | None = None,
) -> jax.Array:
    r"""CosReg: mean pairwise cosine similarity of the token vectors (SPEC.md §5).

    .. math::
        \hat x_i = \frac{x_i}{\lVert x_i\rVert},\qquad
        R = \frac{\sum_{i \ne j} \hat x_i^\top \hat x_j}{N^2}
          = \frac{\lVert \sum_i \hat x_i \rVert^2 - \sum_i \lVert \hat x_i\rVert^2}{N^2},

    over the N unmasked tokens of the batch, without the `[N, N]` matrix. For nonzero vectors
    `Σ‖x̂_i‖² = N`, the reference's `(ΣW − N)/N²`; an all-zero vector (unit-normalised to zero,
    as `F.normalize` does) then adds nothing instead of `−1/N²`. Added as `+λ R`.

    Args:
        hidden: `[batch, len, d]` last-layer token vectors, any float dtype.
        mask: `[batch, len]` attention mask, or None for all tokens.
        include_padding: keep padding positions, as the reference does.
        axis_name: mapped axis (`shard_map`/`pmap`) the batch is split over: the unit-vector
            sums and the token count are `psum`-med over it, so the penalty is the global
            batch's on every device. Not needed under `jax.jit` with a sharded batch.

    Returns:
        Scalar float32 (float64 for float64 input); 0 when no token is left.

    References:
        Gao et al., `Representation Degeneration Problem in Training Natural Language
        Generation Models <https://arxiv.org/abs/1907.12009>`_, ICLR 2019, Eq. 9; used as a
        baseline by Rudman & Eickhoff, ICLR 2024.
    """
    hidden = jnp.asarray(hidden)
    if hidden.ndim != 3:
        raise ValueError(
            f"cosreg_penalty takes the last layer [batch, len, d]; got shape {hidden.shape}"
        )
    dtype = stats.stats_dtype(hidden.dtype)
    x = hidden.astype(dtype)
    token_mask = _token_mask(mask, hidden.shape[:2], include_padding)
    weight = jnp.ones(hidden.shape[:2], dtype) if token_mask is None else token_mask.astype(dtype)
    total, unit_sq, n = isotropy.unit_vector_sums(x, weight)  # [d], [], []
    if axis_name is not None:
        total, unit_sq, n = lax.psum((total, unit_sq, n), axis_name)
    off_diagonal = jnp.sum(total * total) - unit_sq
    return jnp.where(n > 0, off_diagonal / jnp.maximum(n, 1.0) ** 2, 0.0)


def c0_pass_init(d: int) -> stats.MomentState:
    """Empty accumulator for I-STAR's `C0` over `d` features (float32 `stats.MomentState`)."""
    return stats.moments_init(d)


def c0_pass_update(
    state: stats.MomentState,
    hidden_states: Sequence[jax.Array] | jax.Array,
    mask: jax.typing.ArrayLike | None,
    include_padding: bool = False,
    *,
    axis_name: str | None = None,
) -> stats.MomentState:
    """Adds one eval-mode batch's tokens of every layer to the `C0` accumulator (pure, jit-able).

    Args:
        state: accumulator from `c0_pass_init` or a previous update.
        hidden_states: L arrays `[batch, len, d]` or one `[L, batch, len, d]` (no gradient
            is taken: the input is stop-gradient).
        mask: `[batch, len]` attention mask, or None for all tokens.
        include_padding: keep padding positions, as the reference does.
        axis_name: mapped axis to reduce over under shard_map/pmap (not needed under jit).

    Returns:
        The updated `stats.MomentState` (Chan et al.'s parallel update, float32).
    """
    points, token_mask = _layer_tokens(hidden_states, mask, include_padding)
    if points.shape[-1] != state.mean.shape[-1]:
        raise ValueError(
            f"hidden states of feature size {points.shape[-1]} (shape {tuple(points.shape)}) do "
            f"not match the stabiliser state of size {state.mean.shape[-1]}"
        )
    return stats.moments_update(state, lax.stop_gradient(points), token_mask, axis_name=axis_name)


def c0_pass_finalize(state: stats.MomentState) -> jax.Array:
    """`C0` `[d, d]` float32: the unbiased covariance of all tokens seen (identity if < 2).

    The reference keeps `C0` in float64 (which promotes its whole loss); float32 accumulation
    with Chan et al.'s update is accurate to ~1e-6 relative here. With fewer than two tokens, or
    non-finite statistics, the identity is returned (SPEC.md §4: "with no sample, use the
    identity").
    """
    moments = stats.moments_finalize(state, ddof=1)
    eye = jnp.eye(state.mean.shape[-1], dtype=moments.cov.dtype)
    ok = (state.count >= 2) & jnp.all(jnp.isfinite(moments.cov))
    return jnp.where(ok, moments.cov, eye)


def estimate_c0(
    update_fn: Callable[[stats.MomentState, dict], stats.MomentState],
    batches: Iterable[dict],
    state: stats.MomentState,
    *,
    num_points: int = 250_000,
) -> stats.MomentState:
    """The `C0` pass (SPEC.md §4): accumulate batches until `num_points` token vectors.

    The reference rebuilds `C0` before every epoch (and so before the first update) from at
    least 250 000 token vectors of the training set, in eval mode without gradients. The
    count is `state.count`: the unmasked token vectors of every layer (L per token); the batch
    that reaches `num_points` is included whole, and the pass stops there. The training loop
    runs it with `steps.c0_pass_step` over the epoch's training batches in order.

    Args:
        update_fn: `(state, batch) -> state`, adding one batch's eval-mode tokens of every
            layer (`c0_pass_update` of the encoder's hidden states); jit it yourself.
        batches: iterable of batches (e.g. `isojax.data.batching.batches(...)`).
        state: the starting accumulator, `c0_pass_init(d)` (placed where you want it).
        num_points: stop once this many token vectors have been accumulated.

    Returns:
        The accumulated state; `c0_pass_finalize(state)` is `C0`.
    """
    for batch in batches:
        state = update_fn(state, batch)
        if float(state.count) >= num_points:
            break
    return state
