"""The `whiten` normaliser (isojax.core.whitening, both front ends) against a float64 NumPy
transcription of SPEC.md §10.1, and the post-hoc transforms (isojax.core.posthoc) against NumPy
(SPEC.md §10.2). Each exactness check also runs against broken twins of its reference (a wrong
debias, no shrinkage, a PCA basis, an n-divided covariance, ...) and asserts that they fail."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from isojax import nnx as inx
from isojax.core import normalizers, posthoc, whitening
from isojax.linen import norms

HP = normalizers.HPARAMS["whiten"]

# The core functions run jitted, one program a shape (from the session's compile cache): called
# eagerly, each dispatched dozens of small ops compiled one by one. The same jnp code either way.
whitening_matrix = jax.jit(
    whitening.whitening_matrix, static_argnames=("alpha", "epsilon", "group_size")
)
whiten_train = jax.jit(functools.partial(whitening.whiten, mask=None, update=True, **HP))
apply_bert_whitening = jax.jit(posthoc.apply_bert_whitening)
fit_abtt = jax.jit(posthoc.fit_abtt, static_argnames="num_directions")
apply_abtt = jax.jit(posthoc.apply_abtt)
fit_zca = jax.jit(posthoc.fit_zca)
apply_zca = jax.jit(posthoc.apply_zca)


def rel_err(got, want) -> float:
    """Relative Frobenius error of `got` against `want`, in float64."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def stream(num, batch, d, seed=0, padded=0):
    """Anisotropic correlated batches `[batch + padded, d]` with a mean of ~3 (float64), and
    their masks (the `padded` last rows are junk, masked out)."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.geomspace(4.0, 0.05, d)[:, None]
    mean = 3.0 * rng.normal(size=d)
    out = []
    for _ in range(num):
        x = np.concatenate(
            [rng.normal(size=(batch, d)) @ mixing + mean, np.full((padded, d), 50.0)]
        )
        out.append((x, np.concatenate([np.ones(batch), np.zeros(padded)])))
    return out


def inv_sqrt64(sigma, basis="zca"):
    lam, vec = np.linalg.eigh(sigma)
    return (vec * lam**-0.5) @ vec.T if basis == "zca" else vec * lam**-0.5


class ReferenceWhiten:
    """Float64 transcription of SPEC.md §10.1; `twin` breaks one step on purpose."""

    def __init__(self, d, momentum=0.99, alpha=0.1, epsilon=1e-5, keep_scale=True, group_size=None,
                 twin=None):  # fmt: skip
        self.mu, self.cov, self.t = np.zeros(d), np.zeros((d, d)), 0
        self.m, self.alpha, self.eps, self.keep_scale = momentum, alpha, epsilon, keep_scale
        self.g, self.twin = group_size or d, twin

    def update(self, x, mask=None):
        x = x if mask is None else x[np.asarray(mask) > 0]
        mu_b = x.mean(0)
        c_b = (x - mu_b).T @ (x - mu_b) / len(x)
        self.mu = self.m * self.mu + (1 - self.m) * mu_b
        self.cov = self.m * self.cov + (1 - self.m) * c_b
        self.t += 1

    def transform(self):
        """`(μ̂, W [d, d], scale)`."""
        d = len(self.mu)
        if self.t == 0:
            return np.zeros(d), np.eye(d), 1.0
        t = self.t + 1 if self.twin == "wrong debias" else self.t
        mu, cov = self.mu / (1 - self.m**t), self.cov / (1 - self.m**t)
        tau = np.trace(cov) / d
        alpha = 0.0 if self.twin == "no shrinkage" else self.alpha
        basis = "pca" if self.twin == "pca basis" else "zca"
        w = np.zeros((d, d))
        for s in range(0, d, self.g):
            block = cov[s : s + self.g, s : s + self.g]
            sigma = (1 - alpha) * block + (alpha * tau + self.eps) * np.eye(self.g)
            w[s : s + self.g, s : s + self.g] = inv_sqrt64(sigma, basis)
        return mu, w, np.sqrt(tau) if self.keep_scale else 1.0

    def __call__(self, x, mask=None, training=True):
        if training:
            self.update(x, mask)
        mu, w, scale = self.transform()
        return (x - mu) @ w * scale


TWINS = ("wrong debias", "no shrinkage", "pca basis")


class Front:
    """One front end behind `step(x, mask, train) -> y` and `stats()`."""

    def __init__(self, front, d, **hparams):
        self.front = front
        if front == "nnx":
            self.model = inx.make_normalizer("whiten", d, **hparams)
            self.call = nnx.jit(lambda m, x, mask, ura: m(x, ura, mask=mask), static_argnums=3)
            return
        self.model = norms.make_normalizer("whiten", **hparams)
        x = jnp.zeros((2, d))
        self.variables = self.model.init(jax.random.key(0), x, use_running_average=True)
        self.train = jax.jit(functools.partial(self.model.apply, use_running_average=False,
                                               mutable=["batch_stats"]))  # fmt: skip
        self.eval = jax.jit(functools.partial(self.model.apply, use_running_average=True))

    def step(self, x, mask, train):
        if self.front == "nnx":
            return self.call(self.model, x, mask, not train)
        if not train:
            return self.eval(self.variables, x, mask=mask)
        y, updates = self.train(self.variables, x, mask=mask)
        self.variables = {**self.variables, **updates}
        return y

    def stats(self):
        if self.front == "nnx":
            return self.model.state_values()
        return self.variables["batch_stats"]


# (front, d, batch, padded rows, input dtype, group_size): batches smaller than d from d = 64.
STREAMS = [
    ("linen", 8, 32, 0, jnp.float32, None),
    ("nnx", 8, 32, 0, jnp.float32, None),
    ("linen", 64, 16, 4, jnp.float32, None),
    ("nnx", 64, 16, 4, jnp.float32, None),
    ("linen", 384, 32, 4, jnp.float32, None),  # MiniLM's width: one front end (same core step)
    ("linen", 64, 16, 4, jnp.bfloat16, None),
    ("nnx", 8, 32, 4, jnp.bfloat16, None),
    ("linen", 8, 32, 4, jnp.float32, 4),
    ("nnx", 64, 16, 4, jnp.bfloat16, 16),
]


@functools.cache
def reference_run(d, batch, padded, dtype, group_size):
    """The float64 reference's and its twins' outputs on each batch of the stream (the values
    the module sees: the batch in `dtype`, read back in float32), and the reference's final
    `(cov, mu)`: computed once per stream, for both front ends."""
    twins = TWINS if d < 384 else ()  # float64 eigh per step and twin: d = 8 and 64 show them
    refs = {twin: ReferenceWhiten(d, group_size=group_size, twin=twin) for twin in (None, *twins)}
    outputs = {twin: [] for twin in refs}
    for i, (x, mask) in enumerate(stream(21, batch, d, padded=padded)):
        seen = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
        for twin, ref in refs.items():
            outputs[twin].append(ref(seen, mask, training=i < 20))
    return outputs, refs[None].cov, refs[None].mu


@pytest.mark.parametrize("front, d, batch, padded, dtype, group_size", STREAMS)
def test_front_end_matches_reference_over_20_batches_then_eval(
    front, d, batch, padded, dtype, group_size
):
    data = stream(21, batch, d, padded=padded)
    module = Front(front, d, group_size=group_size, dtype=jnp.float32)
    outputs, cov, mu = reference_run(d, batch, padded, dtype, group_size)
    first = jnp.asarray(data[0][0], dtype)
    np.testing.assert_array_equal(module.step(first, None, train=False), first)  # t = 0
    errors = {twin: [] for twin in outputs}
    for i, (x, mask) in enumerate(data):
        y = module.step(jnp.asarray(x, dtype), jnp.asarray(mask), train=i < 20)
        assert y.dtype == jnp.float32 and y.shape == x.shape
        for twin, want in outputs.items():
            errors[twin].append(rel_err(y[mask > 0], want[i][mask > 0]))
    assert max(errors[None]) < 1e-4, errors[None]
    for twin in (twin for twin in outputs if twin is not None):
        assert max(errors[twin]) > 1e-3, (twin, max(errors[twin]))
    got = module.stats()
    assert got["mean"].dtype == got["cov"].dtype == jnp.float32
    assert (int(got["count"]), int(got["skipped"])) == (20, 0)
    assert rel_err(got["cov"], cov) < 1e-5 and rel_err(got["mean"], mu) < 1e-5


def test_linen_and_nnx_agree_within_1e_6():
    data = stream(21, 16, 64, padded=4, seed=1)
    linen, twin = Front("linen", 64), Front("nnx", 64, momentum=0.98)
    nnx_front = Front("nnx", 64)
    worst, twin_worst = 0.0, 0.0
    for i, (x, mask) in enumerate(data):
        x, mask = jnp.asarray(x, jnp.float32), jnp.asarray(mask)
        y = linen.step(x, mask, i < 20)
        worst = max(worst, rel_err(nnx_front.step(x, mask, i < 20), y))
        twin_worst = max(twin_worst, rel_err(twin.step(x, mask, i < 20), y))
    assert worst < 1e-6 and twin_worst > 1e-3, (worst, twin_worst)
    for key in ("mean", "cov"):
        assert rel_err(nnx_front.stats()[key], linen.stats()[key]) < 1e-6


def collapsed_cov(d, seed=0):
    """`[d, d]` float64 covariance of rank d / 4 with 99 % of its variance on one direction."""
    rng = np.random.default_rng(seed)
    spectrum = np.zeros(d)
    spectrum[: max(d // 4, 2)] = np.geomspace(1e-2, 1e-4, max(d // 4, 2)) / max(d // 4, 2)
    spectrum[0] = 0.99
    basis, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (basis * spectrum) @ basis.T


@pytest.mark.parametrize("d, alpha, group_size", [(8, 0.1, None), (64, 0.1, None),
                                                  (384, 0.1, None), (64, 0.01, None),
                                                  (64, 0.1, 16), (8, 1.0, None)])  # fmt: skip
def test_w_matches_float64_eigh_up_to_condition_d_over_alpha(d, alpha, group_size):
    cov = collapsed_cov(d)
    w, tau = whitening_matrix(
        jnp.asarray(cov, jnp.float32), alpha=alpha, epsilon=1e-5, group_size=group_size
    )
    cov32 = np.asarray(jnp.asarray(cov, jnp.float32), np.float64)
    dense = jax.scipy.linalg.block_diag(*w)
    refs = {}
    for twin in (None, "no shrinkage", "pca basis"):
        ref = ReferenceWhiten(d, alpha=alpha, group_size=group_size, twin=twin)
        ref.cov, ref.t, ref.m = cov32, 1, 0.0  # Ŝ = cov32 (no debias: 1 − 0¹ = 1)
        refs[twin] = ref.transform()[1]
    sigma = (1 - alpha) * cov32 + (alpha * np.trace(cov32) / d + 1e-5) * np.eye(d)
    if group_size is None:
        assert np.linalg.cond(sigma) > 0.8 * (1 - alpha) * d / alpha  # near the bound
    assert rel_err(dense, refs[None]) < 1e-4
    np.testing.assert_allclose(tau, np.trace(cov32) / d, rtol=1e-6)
    for twin in ("no shrinkage", "pca basis") if alpha < 1 else ():  # α = 1: W ∝ I, any basis
        if not (twin == "no shrinkage" and alpha == 0.01):  # α = 0.01 is close to none
            assert rel_err(dense, refs[twin]) > 1e-2, twin


def run_core(step, batches, hparams):
    init = whitening.whiten_init if step is whitening.whiten else normalizers.isobn_init
    state = init(batches[0].shape[-1])
    fn = jax.jit(functools.partial(step, mask=None, update=True, **hparams))
    ys = []
    for x in batches:
        y, state, _ = fn(state, jnp.asarray(x, jnp.float32))
        ys.append(np.asarray(y, np.float64))
    return ys


def test_rotating_the_input_rotates_the_output_and_not_for_isobn():
    d = 16
    batches = [x for x, _ in stream(6, 24, d, seed=2)]
    q, _ = np.linalg.qr(np.random.default_rng(3).normal(size=(d, d)))
    rotated = [x @ q for x in batches]
    whiten_hp = {**HP, "axis_name": None}
    ys, ys_rot = (
        run_core(whitening.whiten, batches, whiten_hp),
        run_core(whitening.whiten, rotated, whiten_hp),
    )
    worst = max(rel_err(yr, y @ q) for y, yr in zip(ys, ys_rot, strict=True))
    assert worst < 1e-4, worst
    isobn_hp = normalizers.HPARAMS["isobn"]
    zs, zs_rot = (
        run_core(normalizers.isobn, batches, isobn_hp),
        run_core(normalizers.isobn, rotated, isobn_hp),
    )
    assert min(rel_err(zr, z @ q) for z, zr in zip(zs, zs_rot, strict=True)) > 1e-2


@pytest.mark.parametrize("alpha", [0.1, 0.001])  # 0.001: about the least d = 8 accepts
def test_output_covariance_converges_to_tau_i_within_the_shrinkage_bias(alpha):
    d, batch = 8, 256
    rng = np.random.default_rng(4)
    mixing = rng.normal(size=(d, d)) * np.geomspace(3.0, 0.3, d)[:, None]
    sigma0 = mixing.T @ mixing  # the data's covariance
    lam = np.linalg.eigvalsh(sigma0 * (1 - 1 / batch))  # what the biased batch moments estimate
    tau = lam.sum() / d
    shrunk = tau * lam / ((1 - alpha) * lam + alpha * tau + 1e-5)  # eigenvalues of τ W S W
    batches = [rng.normal(size=(batch, d)) @ mixing + 1.0 for _ in range(300)]
    state = whitening.whiten_init(d)
    hparams = {**HP, "alpha": alpha}
    train = jax.jit(functools.partial(whitening.whiten, mask=None, update=True, **hparams))
    for x in batches:
        _, state, _ = train(state, jnp.asarray(x, jnp.float32))
    x_eval = jnp.asarray(rng.normal(size=(20000, d)) @ mixing + 1.0, jnp.float32)
    evaluate = jax.jit(functools.partial(whitening.whiten, mask=None, update=False, **hparams))
    y, _, _ = evaluate(state, x_eval)
    out = np.cov(np.asarray(y, np.float64), rowvar=False)
    got = np.linalg.eigvalsh(out)
    # Noise: the eigenvalues of a 20000-row sample covariance spread by ~±2 sqrt(d / n) = ±4 %,
    # plus that of the running estimate.
    np.testing.assert_allclose(got, np.sort(shrunk), rtol=0.07)
    bias = np.abs(shrunk - tau).max()
    assert np.abs(got - tau).max() <= bias + 0.07 * tau
    if alpha >= 0.1:  # the bias is real: shrinkage keeps the spread of eigenvalues
        assert bias > 0.2 * tau


def test_gradient_flows_through_x_only():
    d, n = 4, 6
    data = [x for x, _ in stream(4, n, d, seed=5)]
    ref = ReferenceWhiten(d)
    state = whitening.whiten_init(d)
    for x in data[:3]:
        ref.update(x)
        _, state, _ = whiten_train(state, jnp.asarray(x, jnp.float32))
    x0 = data[3]

    def loss(x):  # a training step: the statistics are updated from x itself
        y, _, _ = whitening.whiten(state, x, None, update=True, **HP)
        return jnp.sum(jnp.sin(y))

    grad = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(x0, jnp.float32)), np.float64)
    frozen = copy.deepcopy(ref)
    frozen.update(x0)
    mu, w, scale = frozen.transform()

    def loss_frozen(x):  # statistics held at their value: stop-gradient
        return np.sum(np.sin((x - mu) @ w * scale))

    def loss_full(x):  # statistics recomputed from x: the gradient a missing stop_gradient gives
        return np.sum(np.sin(copy.deepcopy(ref)(x)))

    def finite_differences(f, h=1e-6):
        out = np.zeros_like(x0)
        for idx in np.ndindex(*x0.shape):
            e = np.zeros_like(x0)
            e[idx] = h
            out[idx] = (f(x0 + e) - f(x0 - e)) / (2 * h)
        return out

    assert rel_err(grad, finite_differences(loss_frozen)) < 1e-4
    assert rel_err(grad, finite_differences(loss_full)) > 1e-2


def test_non_finite_batch_is_skipped_and_counted_in_nnx():
    model = inx.Whiten(8, use_running_average=False)
    step = nnx.jit(lambda m, x: m(x))  # one program for both batches, not op by op
    x, _ = stream(1, 16, 8)[0]
    x = jnp.asarray(x, jnp.float32)
    step(model, x)
    before = model.state_values()
    y = step(model, x.at[2, 3].set(jnp.nan))
    after = model.state_values()
    assert (int(after["count"]), int(after["skipped"])) == (1, 1)
    for key in ("mean", "cov"):
        np.testing.assert_array_equal(after[key], before[key])
    assert np.isnan(np.asarray(y)[2]).all() and np.isfinite(np.asarray(y)[[0, 1, 3]]).all()


def test_group_size_must_divide_d_and_hparams_are_checked():
    with pytest.raises(ValueError, match="group_size 3 does not divide the feature size 8"):
        norms.make_normalizer("whiten", group_size=3).init(
            jax.random.key(0), jnp.ones((4, 8)), use_running_average=True
        )
    for bad, match in [({"alpha": 1.5}, r"alpha 1.5 not in \[0, 1\]"),
                       ({"group_size": 0}, "group_size must be a positive integer")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            inx.make_normalizer("whiten", 8, **bad)
    assert normalizers.NORMALIZERS[-2:] == ("whiten", "iternorm")
    assert normalizers.NORMALIZERS[:5] == ("none", "recenter", "batchnorm", "layernorm", "isobn")


# Post-hoc transforms (SPEC.md §10.2) against NumPy.


def fit_set(n=400, d=16, seed=6):
    """A fit set and an apply set; condition number ~16, well-separated eigenvalues: float32
    SVD's error on the smallest direction grows with the condition number (1e-4 at ~600)."""
    rng = np.random.default_rng(seed)
    mixing = np.linalg.qr(rng.normal(size=(d, d)))[0] * np.geomspace(3.0, 0.75, d)[:, None]
    return [rng.normal(size=(n, d)) @ mixing + 2.0 for _ in range(2)]  # fit set, apply set


def svd_flip(u):
    top = np.argmax(np.abs(u), axis=0)
    return u * np.sign(u[top, np.arange(u.shape[1])])


def bert_whitening_ref(fit, x, k, ddof=1, basis="pca"):
    mu = fit.mean(0)
    cov = (fit - mu).T @ (fit - mu) / (len(fit) - ddof)
    u, s, _ = np.linalg.svd(cov)
    w = svd_flip(u) / np.sqrt(s) if basis == "pca" else inv_sqrt64(cov)
    return (x - mu) @ w[:, :k]


def abtt_ref(fit, x, num, center=True):
    mu = fit.mean(0)
    u, _, _ = np.linalg.svd(np.cov(fit, rowvar=False))
    xt = x - mu if center else x
    return xt - (xt @ u[:, :num]) @ u[:, :num].T


@pytest.mark.parametrize("k", [16, 8])
def test_bert_whitening_matches_numpy(k):
    fit, x = fit_set()
    params = posthoc.fit_bert_whitening(jnp.asarray(fit, jnp.float32), k=k)
    y = apply_bert_whitening(params, jnp.asarray(x, jnp.float32))
    fit32, x32 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (fit, x))
    want = bert_whitening_ref(fit32, x32, k)
    assert y.shape == (len(x), k) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for twin in ({"ddof": 0}, {"basis": "zca"}):
        assert not np.allclose(y, bert_whitening_ref(fit32, x32, k, **twin), rtol=1e-5, atol=1e-4)


def test_abtt_matches_numpy_and_defaults_to_d_over_100():
    fit, x = fit_set()
    params = fit_abtt(jnp.asarray(fit, jnp.float32), num_directions=3)
    y = apply_abtt(params, jnp.asarray(x, jnp.float32))
    fit32, x32 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (fit, x))
    want = abtt_ref(fit32, x32, 3)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    for twin in (abtt_ref(fit32, x32, 2), abtt_ref(fit32, x32, 3, center=False)):
        assert not np.allclose(y, twin, rtol=1e-5, atol=1e-4)
    wide = fit_abtt(jnp.ones((3, 384)) * jnp.arange(3.0)[:, None])
    assert wide.directions.shape == (4, 384)


def test_zca_fitted_once_matches_the_reference_transform():
    fit, x = fit_set()
    params = fit_zca(jnp.asarray(fit, jnp.float32))
    y = apply_zca(params, jnp.asarray(x, jnp.float32))
    ref = ReferenceWhiten(16, momentum=0.0)
    ref.update(np.asarray(jnp.asarray(fit, jnp.float32), np.float64))  # one batch: μ̂, Ŝ = the set's
    x32 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    assert rel_err(y, ref(x32, training=False)) < 1e-4
    ref.twin = "pca basis"
    assert rel_err(y, ref(x32, training=False)) > 1e-2
