"""`iternorm` (SPEC.md §10.3) against an independent float64 transcription in PyTorch: the
whitening matrix at T = 0 and T = 50, the gradient of the train-mode transform (with the
statistics attached and detached), and the hyper-parameter checks. The front ends over 20
batches: tests/linen/test_iternorm.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

from isojax.core import iternorm, normalizers

# Jitted once per module: called eagerly, T = 50 iterations dispatched hundreds of small ops,
# each compiled on its own. The same jnp code either way.
iterative_whitening = jax.jit(iternorm.iterative_whitening, static_argnums=1)
batch_covariance = jax.jit(iternorm.batch_covariance, static_argnames=("group_size", "epsilon"))

torch = pytest.importorskip("torch")


def transcription(x, mask, *, iterations, epsilon, group_size=None):
    """SPEC.md §10.3 train mode in float64 torch, from the formulas: `(y, μ, [W_k])`."""
    x = torch.as_tensor(x, dtype=torch.float64) if not torch.is_tensor(x) else x
    keep = torch.as_tensor(np.asarray(mask) > 0)
    rows = x[keep]
    m, d = rows.shape
    g = group_size or d
    mu = rows.mean(0)
    blocks = []
    for k in range(d // g):
        xc = rows[:, k * g : (k + 1) * g] - mu[k * g : (k + 1) * g]
        sigma = epsilon * torch.eye(g, dtype=x.dtype) + xc.T @ xc / m
        trace = torch.trace(sigma)
        sigma_n = sigma / trace
        p = torch.eye(g, dtype=x.dtype)
        for _ in range(iterations):
            p = 1.5 * p - 0.5 * torch.linalg.matrix_power(p, 3) @ sigma_n
        blocks.append(p / torch.sqrt(trace))
    return (x - mu) @ torch.block_diag(*blocks), mu, blocks


def data(n, d, seed=0, offset=2.0):
    """Correlated anisotropic rows `[n, d]` and a mask dropping two rows."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.geomspace(3.0, 0.3, d)[:, None] / np.sqrt(d)
    x = rng.normal(size=(n, d)) @ mixing + offset
    mask = np.ones(n, np.float32)
    mask[[1, n - 1]] = 0.0
    return x, mask


def test_t0_is_a_scalar_normalisation_and_t50_is_the_inverse_square_root():
    x, mask = data(64, 12)
    _, _, sigma = batch_covariance(
        jnp.asarray(x, jnp.float32), jnp.asarray(mask), group_size=None, epsilon=1e-5
    )
    rows = x[mask > 0]
    want_sigma = 1e-5 * np.eye(12) + np.cov(rows, rowvar=False, bias=True)
    np.testing.assert_allclose(sigma[0], want_sigma, rtol=1e-5, atol=1e-6)
    w0 = iterative_whitening(sigma, 0)[0]
    np.testing.assert_allclose(w0, np.eye(12) / np.sqrt(np.trace(want_sigma)), rtol=1e-6)
    # A well-conditioned Σ (eigenvalues in [0.75, 1.5]): 50 steps reach eigh's Σ^(-1/2). (The
    # uncoupled iteration is unstable at its fixed point for condition numbers above ~2.4:
    # float32 rounding grows there, so many steps need a well-conditioned Σ.)
    rng = np.random.default_rng(3)
    q, _ = np.linalg.qr(rng.normal(size=(16, 16)))
    well = (q * np.linspace(0.75, 1.5, 16)) @ q.T
    vals, vecs = np.linalg.eigh(well)
    want = (vecs / np.sqrt(vals)) @ vecs.T
    got = np.asarray(iterative_whitening(jnp.asarray(well, jnp.float32), 50), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # T = 5 is a partial whitening on purpose: not yet Σ^(-1/2).
    partial = np.asarray(iterative_whitening(jnp.asarray(well, jnp.float32), 5))
    assert np.linalg.norm(partial - want) / np.linalg.norm(want) > 1e-3


def _train_output(x, mask, stop_gradient, group_size=None, iterations=5):
    state = iternorm.iternorm_init(x.shape[-1], group_size=group_size)
    y, _, _ = iternorm.iternorm(
        state, x, mask, train=True, update=False, momentum=0.1, iterations=iterations,
        epsilon=1e-5, group_size=group_size, stop_gradient=stop_gradient,
    )  # fmt: skip
    return y


@pytest.mark.parametrize("d, n, group_size", [(8, 16, None), (24, 12, 6)])
def test_gradient_matches_float64_autograd_of_the_transcription(d, n, group_size):
    """The gradient flows through μ, Σ and every Newton step: that of any scalar loss of `y`
    equals float64 torch autograd of the transcription within 1e-5 (relative, max-norm); with
    ``stop_gradient`` the forward is the same and the gradient is `r W^T` only."""
    x, mask = data(n, d, seed=d)
    r = np.random.default_rng(7).normal(size=(n, d))

    def loss(x, stop_gradient):
        y = _train_output(x, jnp.asarray(mask), stop_gradient, group_size)
        return jnp.sum(y * r), y

    grads = {}
    for sg in (False, True):
        grads[sg], y = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)(
            jnp.asarray(x, jnp.float32), sg
        )
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        want_y, _, blocks = transcription(
            xt, mask, iterations=5, epsilon=1e-5, group_size=group_size
        )
        scale = want_y.abs().max().item()
        np.testing.assert_allclose(y, want_y.detach().numpy(), rtol=1e-5, atol=1e-5 * scale)
        (want_y * torch.as_tensor(r)).sum().backward()
        want_grad = xt.grad.numpy()
        if sg:
            want_grad = r @ torch.block_diag(*blocks).detach().numpy().T
        err = np.abs(np.asarray(grads[sg], np.float64) - want_grad).max()
        assert err < 1e-5 * np.abs(want_grad).max(), (sg, err)
    difference = np.abs(np.asarray(grads[True]) - np.asarray(grads[False])).max()
    assert difference > 1e-2 * np.abs(np.asarray(grads[False])).max()


def test_skipped_batch_falls_back_to_the_running_transform():
    """One unmasked row: the running state does not move, `skipped` counts it, and the output
    is the evaluation one (`x` itself before any update), finite."""
    x, _ = data(6, 4)
    x = jnp.asarray(x, jnp.float32)
    one = jnp.zeros(6).at[2].set(1.0)
    state = iternorm.iternorm_init(4)
    hp = dict(momentum=0.1, iterations=5, epsilon=1e-5, group_size=None, stop_gradient=False)
    # Jitted: one program each instead of every operation dispatched on its own.
    y, new, ok = jax.jit(functools.partial(iternorm.iternorm, train=True, update=True, **hp))(
        state, x, one
    )
    assert not bool(ok) and (int(new["count"]), int(new["skipped"])) == (0, 1)
    np.testing.assert_array_equal(new["wmat"], state["wmat"])
    np.testing.assert_array_equal(y, x)
    grad = jax.jit(
        jax.grad(
            lambda x: jnp.sum(iternorm.iternorm(state, x, one, train=True, update=False, **hp)[0])
        )
    )(x)
    assert np.isfinite(np.asarray(grad)).all()


def test_hyper_parameters_are_checked():
    check = normalizers.check_hparams
    check("iternorm", momentum=0.1, iterations=0, group_size=16, stop_gradient=True)
    for bad, match in [
        ({"momentum": 1.0}, r"momentum 1.0 not in \(0, 1\)"),
        ({"momentum": 1e-9}, "rounds to 1 or 0 in float32"),
        ({"iterations": -1}, r"iterations must be an integer in \[0, 6\], got -1"),
        ({"iterations": 2.5}, r"iterations must be an integer in \[0, 6\]"),
        ({"iterations": True}, r"iterations must be an integer in \[0, 6\]"),
        ({"iterations": 7}, "iterations 7 > 6: more float32 Newton-Schulz steps amplify"),
        ({"iterations": 1000000}, "iterations 1000000 > 6"),
        ({"group_size": True}, "group_size must be a positive integer"),
        ({"group_size": 0}, "group_size must be a positive integer"),
        ({"epsilon": 0.0}, "epsilon must be > 0"),
        ({"stop_gradient": 1}, "stop_gradient must be True or False"),
        ({"affine": "yes"}, "affine must be True or False"),
        ({"alpha": 0.5}, r"'iternorm' has no hyper-parameter\(s\) \['alpha'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            check("iternorm", **bad)
    with pytest.raises(ValueError, match="group_size 5 does not divide the feature size 8"):
        iternorm.iternorm_init(8, group_size=5)


def _exact_recursion(sigma: np.ndarray, iterations: int) -> np.ndarray:
    """The same Newton-Schulz recursion, exact: float64 `eigh`, `P_T = V f_T(Λ) Vᵀ`."""
    lam, v = np.linalg.eigh(sigma)
    p = np.ones_like(lam)
    for _ in range(iterations):
        p = 1.5 * p - 0.5 * p**3 * lam / lam.sum()
    return (v * p) @ v.T / np.sqrt(lam.sum())


def test_the_largest_accepted_iterations_keep_the_running_matrix_within_1e3():
    """Audit 6, finding 3: at T = 12 the float32 iteration's `W` on a 32-row batch at d = 384
    (rank-deficient Σ) was 13× off, and it reaches the running `W_r` evaluation uses. At the
    largest accepted T (`MAX_ITERATIONS`) `W` and the running matrix after an update are
    within 1e-3 of float64 (measured 1.5e-7), and so on two rows of 8 features (5e-5; T = 7
    gives 2.4e-3 there); one more step is refused."""
    assert normalizers.MAX_ITERATIONS == 6
    t = normalizers.MAX_ITERATIONS
    for n, d, seed in ((32, 384, 0), (2, 8, 1)):
        rng = np.random.default_rng(seed)
        mix = rng.normal(size=(d, d)) * np.geomspace(3, 0.2, d)[:, None] / np.sqrt(d)
        x = rng.normal(size=(n, d)) @ mix
        xc = x - x.mean(0)
        exact = _exact_recursion(1e-5 * np.eye(d) + xc.T @ xc / n, t)
        state = iternorm.iternorm_init(d)
        hp = dict(momentum=0.5, iterations=t, epsilon=1e-5, group_size=None, stop_gradient=False)
        _, new, ok = jax.jit(functools.partial(iternorm.iternorm, train=True, update=True, **hp))(
            state, jnp.asarray(x, jnp.float32), None
        )
        assert bool(ok)
        running = np.asarray(new["wmat"][0], np.float64)
        want = 0.5 * np.eye(d) + 0.5 * exact
        assert np.linalg.norm(running - want) / np.linalg.norm(want) < 1e-3, (n, d)
        sigma = jnp.asarray(1e-5 * np.eye(d) + xc.T @ xc / n, jnp.float32)
        w = np.asarray(iterative_whitening(sigma[None], t)[0])
        w = w.astype(np.float64)
        assert np.linalg.norm(w - exact) / np.linalg.norm(exact) < 1e-3, (n, d)
    with pytest.raises(ValueError, match="iterations 7 > 6"):
        normalizers.check_hparams("iternorm", iterations=t + 1)


def reference_step(x, g_y, *, iterations, epsilon, group_size=None):
    """huangleiBuaa/IterNorm-pytorch's training step as its `iterative_normalization_py`
    computes it, written here in float64 NumPy over features × rows (`x [d, m]`, one block per
    group): the forward (`y`, the batch mean, `W`) and its hand-written backward of the
    cotangent `g_y [d, m]`. That backward carries ``g_Σ_N`` with the −½ of the Newton step
    folded into ``g_Σ`` and always adds the last ``g_P`` to it, which is the gradient for
    T >= 1 only: at T = 0, `P_0 = I` does not depend on `Σ_N`."""
    d, m = x.shape
    g = group_size or d
    y, g_x, means, ws = np.zeros_like(x), np.zeros_like(x), [], []
    for k in range(d // g):
        xs, gs = x[k * g : (k + 1) * g], g_y[k * g : (k + 1) * g]
        mean = xs.mean(1, keepdims=True)
        xc = xs - mean
        sigma = epsilon * np.eye(g) + xc @ xc.T / m
        r_tr = 1.0 / np.trace(sigma)
        sn = sigma * r_tr
        p = [np.eye(g)]
        for _ in range(iterations):
            p.append(1.5 * p[-1] - 0.5 * np.linalg.matrix_power(p[-1], 3) @ sn)
        wm = p[-1] * np.sqrt(r_tr)
        y[k * g : (k + 1) * g] = wm @ xc
        g_wm = gs @ xc.T
        g_p = g_wm * np.sqrt(r_tr)
        g_sn = np.zeros((g, g))
        for j in range(iterations, 1, -1):
            q = p[j - 1].T
            q2 = q @ q
            g_sn += q2 @ q @ g_p
            tmp = g_p @ sn.T
            g_p = 1.5 * g_p - 0.5 * tmp @ q2 - 0.5 * q2 @ tmp - 0.5 * q @ tmp @ q
        g_sn += g_p
        g_tr = np.trace(-sn.T @ g_sn + g_wm.T @ wm) * np.eye(g)
        g_sigma = (g_sn + g_sn.T + 2.0 * g_tr) * (-0.5 / m * r_tr)
        g_x[k * g : (k + 1) * g] = wm @ (gs - gs.mean(1, keepdims=True)) + g_sigma @ xc
        means.append(mean[:, 0])
        ws.append(wm)
    return y, g_x, np.concatenate(means), np.stack(ws)


@pytest.mark.parametrize("n, d, group_size", [(32, 16, None), (8, 16, None), (32, 24, 6)])
def test_four_steps_equal_the_reference_and_its_backward_at_t5(n, d, group_size):
    """Audit 6's probe that held, as a test: over 4 training steps and an evaluation, isojax's
    output, gradient (autodiff), running mean and running `W` equal the reference's forward
    and hand-written backward in float64 (measured there: y 2.4e-6, gradient 3.8e-6 relative
    at worst). At T = 0 the reference's backward is wrong (it adds `g_P` to `g_Σ_N`), by far
    more than rounding, while autodiff equals float64 autograd of SPEC's transcription."""
    rng = np.random.default_rng(n + d)
    mix = rng.normal(size=(d, d)) * np.geomspace(3.0, 0.3, d)[:, None] / np.sqrt(d)
    hp = dict(iterations=5, epsilon=1e-5, group_size=group_size, stop_gradient=False)
    state = iternorm.iternorm_init(d, group_size=group_size)
    mean, wmat = np.zeros(d), np.asarray(state["wmat"], np.float64)

    def loss(x, state, r):
        y, new, _ = iternorm.iternorm(state, x, None, train=True, update=True, momentum=0.1, **hp)
        return jnp.sum(y * r), (y, new)

    step = jax.jit(jax.grad(loss, has_aux=True))
    for _ in range(4):
        x = rng.normal(size=(n, d)) @ mix + rng.normal(size=d)
        r = rng.normal(size=(n, d))
        grad, (y, state) = step(jnp.asarray(x, jnp.float32), state, jnp.asarray(r, jnp.float32))
        want_y, want_grad, mu, w = reference_step(
            x.T, r.T, iterations=5, epsilon=1e-5, group_size=group_size
        )
        for got, want in ((y, want_y.T), (grad, want_grad.T)):
            err = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
            assert err < 2e-5, err
        mean, wmat = 0.9 * mean + 0.1 * mu, 0.9 * wmat + 0.1 * w
        np.testing.assert_allclose(state["mean"], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["wmat"], wmat, rtol=1e-5, atol=1e-6)
    x = rng.normal(size=(n, d)) @ mix
    evaluate = jax.jit(functools.partial(iternorm.iternorm, mask=None, train=False,
                                         update=False, momentum=0.1, **hp))  # fmt: skip
    y, _, _ = evaluate(state, jnp.asarray(x, jnp.float32))
    want = (x - mean) @ scipy.linalg.block_diag(*wmat).T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_at_t0_autodiff_is_right_and_the_references_backward_is_not():
    """T = 0 (`y = X_c / sqrt(tr Σ)`): isojax's gradient equals float64 torch autograd of
    SPEC's transcription (the audit measured 7.9e-8), while the reference's hand-written
    backward is off by far more (0.14 relative in the audit): SPEC.md §10.3's "the reference's
    hand-written backward equals autodiff" holds for T >= 1 only."""
    x, _ = data(16, 8, seed=4)
    r = np.random.default_rng(5).normal(size=(16, 8))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(_train_output(x, None, False, iterations=0) * r)))(
        jnp.asarray(x, jnp.float32)
    )
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    want_y, _, _ = transcription(xt, np.ones(16), iterations=0, epsilon=1e-5)
    (want_y * torch.as_tensor(r)).sum().backward()
    want = xt.grad.numpy()
    assert np.abs(np.asarray(grad, np.float64) - want).max() < 1e-5 * np.abs(want).max()
    _, reference_grad, _, _ = reference_step(x.T, r.T, iterations=0, epsilon=1e-5)
    assert np.abs(reference_grad.T - want).max() > 1e-2 * np.abs(want).max()


def test_a_skipped_overflowing_batch_has_a_finite_gradient():
    """Audit 6, finding 7: rows of about 1e19 overflow the float32 covariance; the batch was
    skipped with a finite output but its gradient was NaN (the zero cotangent of `where`'s
    unselected branch times inf). Now the gradient is that of the evaluation output, `W_r`
    (the identity before any update), in both front ends' step."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 8)) + 1, jnp.float32) * 1e19
    state = iternorm.iternorm_init(8)
    hp = dict(momentum=0.1, iterations=5, epsilon=1e-5, group_size=None, stop_gradient=False)
    # Jitted: one program each instead of every operation dispatched on its own.
    y, new, ok = jax.jit(functools.partial(iternorm.iternorm, train=True, update=True, **hp))(
        state, x, None
    )
    assert not bool(ok) and int(new["skipped"]) == 1
    np.testing.assert_array_equal(y, x)
    r = jnp.asarray(np.random.default_rng(1).normal(size=(6, 8)), jnp.float32)
    grad = jax.jit(
        jax.grad(
            lambda x: jnp.sum(
                iternorm.iternorm(state, x, None, train=True, update=True, **hp)[0] * r
            )
        )
    )(x)
    np.testing.assert_array_equal(grad, r)  # ∂y/∂x = W_r = I
