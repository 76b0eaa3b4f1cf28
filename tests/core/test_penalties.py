"""Tests for isojax.core.penalties: I-STAR against a float64 NumPy transcription of SPEC.md §4 and
the IsoScore package's torch reference, masking, gradients and the sign of lambda; CosReg against
the [N, N] cosine matrix; the C0 stabiliser pass against numpy.cov."""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from isojax.core import isotropy, penalties

L, B, T, D = 2, 3, 5, 6


def hidden_and_mask(seed=0, layers=L, batch=B, length=T, d=D):
    """Anisotropic per-layer token vectors `[L, b, t, d]` and a ragged attention mask `[b, t]`."""
    rng = np.random.default_rng(seed)
    scales = np.geomspace(3.0, 0.2, d)
    hidden = rng.normal(size=(layers, batch, length, d)) * scales + rng.normal(size=d)
    lengths = rng.integers(2, length + 1, size=batch)
    lengths[0] = length
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    return hidden, mask


def numpy_istar(points, c0, zeta):
    """1 - IsoScore* in float64 from SPEC.md §3-4: PR of the shrunk unbiased covariance."""
    d = points.shape[-1]
    cov = np.cov(points.reshape(-1, d), rowvar=False, ddof=1)
    shrunk = (1 - zeta) * cov + zeta * c0
    pr = np.trace(shrunk) ** 2 / np.sum(shrunk**2)
    return 1 - (pr - 1) / (d - 1)


def random_spd(d, seed=5):
    a = np.random.default_rng(seed).normal(size=(d, d))
    return a @ a.T / d + 0.1 * np.eye(d)


@pytest.mark.parametrize("zeta", [0.0, 0.2, 0.75])
@pytest.mark.parametrize("use_c0", [False, True])
def test_istar_matches_numpy_and_the_isoscore_package(zeta, use_c0):
    from IsoScore import IsoScore as isoscore_pkg  # noqa: N813 (the package's module name)

    hidden, mask = hidden_and_mask()
    c0 = random_spd(D) if use_c0 else np.eye(D)
    got = penalties.istar_penalty(
        [jnp.asarray(h, jnp.float32) for h in hidden],
        mask,
        c0=jnp.asarray(c0, jnp.float32) if use_c0 else None,
        zeta=zeta,
        include_padding=True,
    )
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(got, numpy_istar(hidden, c0, zeta), rtol=1e-5)
    # The reference code's own IsoScore* (torch.cov + svdvals), padding included as it does.
    import torch

    points = hidden.reshape(-1, D)
    ref = isoscore_pkg.istar().IsoScore_star(points, torch.tensor(c0), zeta, is_eval=True)
    np.testing.assert_allclose(got, 1 - float(ref), rtol=1e-5, atol=1e-6)


def test_istar_masked_equals_penalty_on_the_unpadded_tokens_alone():
    hidden, mask = hidden_and_mask(seed=1)
    c0 = random_spd(D)
    got = penalties.istar_penalty(jnp.asarray(hidden, jnp.float32), mask, c0=c0, zeta=0.2)
    real = np.stack([h[mask.astype(bool)] for h in hidden])  # [L, n_real, d]
    alone = penalties.istar_penalty(jnp.asarray(real[:, None], jnp.float32), None, c0=c0, zeta=0.2)
    np.testing.assert_allclose(got, alone, rtol=1e-6)
    np.testing.assert_allclose(got, numpy_istar(real, c0, 0.2), rtol=1e-5)
    padded = penalties.istar_penalty(
        jnp.asarray(hidden, jnp.float32), mask, c0=c0, zeta=0.2, include_padding=True
    )
    assert abs(float(padded) - float(got)) > 1e-4  # the padding really changes the value


def test_istar_stacked_and_list_inputs_agree_and_half_precision_is_float32():
    hidden, mask = hidden_and_mask(seed=2)
    stacked = penalties.istar_penalty(jnp.asarray(hidden, jnp.float32), mask)
    listed = penalties.istar_penalty(tuple(jnp.asarray(h, jnp.float32) for h in hidden), mask)
    np.testing.assert_allclose(stacked, listed, rtol=1e-7)
    half = penalties.istar_penalty(jnp.asarray(hidden, jnp.bfloat16), mask)
    assert half.dtype == jnp.float32
    np.testing.assert_allclose(half, stacked, rtol=2e-2)
    big = penalties.istar_penalty(jnp.asarray(hidden * 100.0 + 300.0, jnp.float16), mask)
    assert big.dtype == jnp.float32 and np.isfinite(big)


def test_istar_rejects_mismatched_shapes():
    hidden, mask = hidden_and_mask()
    with pytest.raises(ValueError, match=r"mask of shape \(3, 4\).*\(3, 5\)"):
        penalties.istar_penalty(hidden, mask[:, :4])
    with pytest.raises(ValueError, match=r"\(3, 5, 6\), \(3, 4, 6\)"):
        penalties.istar_penalty([hidden[0], hidden[1][:, :4]], None)
    with pytest.raises(ValueError, match=r"\[layers, batch, len, d\].*\(3, 5, 6\)"):
        penalties.istar_penalty(jnp.asarray(hidden[0]), mask)
    with pytest.raises(ValueError, match=r"c0 of shape \(5, 5\).*d=6"):
        penalties.istar_penalty(hidden, mask, c0=np.eye(5))


class TinyEncoder(nn.Module):
    """Token encoder used for testing only: embed, then 2 x (Dense, tanh); every layer's output."""

    vocab: int = 32
    d: int = D
    layers: int = 2

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(self.vocab, self.d)(ids)
        states = []
        for _ in range(self.layers):
            h = jnp.tanh(nn.Dense(self.d)(h))
            states.append(h)
        return tuple(states)


def encoder_setup(seed=0):
    ids = jax.random.randint(jax.random.key(seed), (4, 8), 0, 32)
    mask = jnp.ones((4, 8), jnp.int32).at[1, 5:].set(0).at[3, 3:].set(0)
    model = TinyEncoder()
    params = model.init(jax.random.key(seed + 1), ids)["params"]
    return model, params, ids, mask


def test_istar_has_a_gradient_with_respect_to_encoder_parameters():
    model, params, ids, mask = encoder_setup()

    def penalty(params, zeta):
        return penalties.istar_penalty(model.apply({"params": params}, ids), mask, zeta=zeta)

    grads = jax.jit(jax.grad(penalty))(params, 0.2)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert np.isfinite(g).all(), path
        assert np.abs(g).max() > 1e-6, path
    # zeta = 1 ignores the points: a finite, zero gradient.
    grads = jax.jit(jax.grad(penalty))(params, 1.0)
    assert all(np.abs(g).max() == 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("lam", [1.0, -1.0])
def test_istar_sgd_moves_isoscore_star_with_the_sign_of_lambda(lam):
    model, params, ids, mask = encoder_setup(seed=3)
    zeta = 0.2
    optimizer = optax.sgd(0.5)

    def loss(params):
        return lam * penalties.istar_penalty(model.apply({"params": params}, ids), mask, zeta=zeta)

    @jax.jit
    def step(params, opt_state):
        grads = jax.grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    def score(params):
        hidden = jnp.stack(model.apply({"params": params}, ids))
        return float(
            isotropy.isoscore_star(hidden, zeta=zeta, mask=jnp.broadcast_to(mask, (2, 4, 8)))
        )

    before = score(params)
    opt_state = optimizer.init(params)
    for _ in range(5):
        params, opt_state = step(params, opt_state)
    after = score(params)
    assert (after - before) * lam > 0.01, (before, after)


def numpy_cosreg(tokens):
    unit = tokens / np.linalg.norm(tokens, axis=-1, keepdims=True)
    w = unit @ unit.T
    n = len(tokens)
    return (w.sum() - n) / n**2


def test_cosreg_matches_the_cosine_matrix_and_masks_padding():
    hidden, mask = hidden_and_mask(seed=4)
    last = hidden[-1]
    got = penalties.cosreg_penalty(jnp.asarray(last, jnp.float32), mask)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, numpy_cosreg(last[mask.astype(bool)]), rtol=1e-5)
    everything = penalties.cosreg_penalty(
        jnp.asarray(last, jnp.float32), mask, include_padding=True
    )
    np.testing.assert_allclose(everything, numpy_cosreg(last.reshape(-1, D)), rtol=1e-5)
    # Zero vectors (e.g. zeroed padding kept in) add nothing instead of -1/N^2.
    zeros = np.concatenate([last.reshape(-1, D), np.zeros((3, D))])
    with_zeros = penalties.cosreg_penalty(jnp.asarray(zeros[None], jnp.float32), None)
    n = len(zeros)
    expected = numpy_cosreg(last.reshape(-1, D)) * (n - 3) ** 2 / n**2
    np.testing.assert_allclose(with_zeros, expected, rtol=1e-5)
    with pytest.raises(ValueError, match=r"last layer \[batch, len, d\].*\(2, 3, 5, 6\)"):
        penalties.cosreg_penalty(hidden, mask)


def test_cosreg_gradient_lowers_mean_cosine():
    model, params, ids, mask = encoder_setup(seed=5)

    def penalty(params):
        return penalties.cosreg_penalty(model.apply({"params": params}, ids)[-1], mask)

    grad_fn = jax.jit(jax.value_and_grad(penalty))
    before, grads = grad_fn(params)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    for _ in range(5):
        params = jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)
        after, grads = grad_fn(params)
    assert float(after) < float(before) - 0.01


@pytest.mark.parametrize("include_padding", [False, True])
def test_stabilizer_pass_equals_numpy_cov_of_all_tokens(include_padding):
    batches = [hidden_and_mask(seed=s) for s in range(3)]
    update = jax.jit(penalties.c0_pass_update, static_argnames="include_padding")
    state = penalties.c0_pass_init(D)
    for hidden, mask in batches:
        state = update(state, jnp.asarray(hidden, jnp.float32), mask, include_padding)
    c0 = jax.jit(penalties.c0_pass_finalize)(state)
    if include_padding:
        tokens = np.concatenate([h.reshape(-1, D) for h, _ in batches])
    else:
        tokens = np.concatenate([h[:, m.astype(bool)].reshape(-1, D) for h, m in batches])
    assert int(state.count) == len(tokens)
    assert c0.dtype == jnp.float32
    np.testing.assert_allclose(c0, np.cov(tokens, rowvar=False, ddof=1), rtol=1e-5, atol=1e-6)


def test_stabilizer_state_is_a_checkpointable_pytree_and_empty_gives_identity():
    np.testing.assert_array_equal(penalties.c0_pass_finalize(penalties.c0_pass_init(D)), np.eye(D))
    hidden, mask = hidden_and_mask()
    state = penalties.c0_pass_update(penalties.c0_pass_init(D), hidden, mask)
    restored = flax.serialization.from_bytes(
        penalties.c0_pass_init(D), flax.serialization.to_bytes(state)
    )
    assert type(restored) is type(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"feature size 6.*size 4"):
        penalties.c0_pass_update(penalties.c0_pass_init(4), hidden, mask)


def test_estimate_stabilizer_stops_after_num_points():
    """The C0 pass counts every layer's unmasked tokens and stops after the batch that reaches
    `num_points` (the training loop's use of it: training/test_loop.py)."""
    batches = [hidden_and_mask(seed=s) for s in range(5)]
    tokens_per_batch = [int(m.sum()) * L for _, m in batches]
    calls = []

    def update_fn(state, batch):
        calls.append(1)
        return penalties.c0_pass_update(state, jnp.asarray(batch[0], jnp.float32), batch[1])

    state = penalties.estimate_c0(
        update_fn, batches, penalties.c0_pass_init(D), num_points=tokens_per_batch[0] + 1
    )
    c0 = penalties.c0_pass_finalize(state)
    assert len(calls) == 2 and int(state.count) == sum(tokens_per_batch[:2])
    tokens = np.concatenate([h[:, m.astype(bool)].reshape(-1, D) for h, m in batches[:2]])
    np.testing.assert_allclose(c0, np.cov(tokens, rowvar=False), rtol=1e-5, atol=1e-6)
    penalty = functools.partial(penalties.istar_penalty, c0=c0, zeta=0.2)
    assert np.isfinite(penalty(jnp.asarray(batches[0][0], jnp.float32), batches[0][1]))
