"""IsoScore, IsoScore*, EV_k and cosine against float64 references written from SPEC.md."""

import functools

import chex
import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st
from IsoScore import IsoScore as isoscore_package

from isojax.core import isotropy

# The property tests draw many shapes: one compiled program per shape, not one per operation.
isoscore = jax.jit(isotropy.isoscore)
isoscore_star = jax.jit(isotropy.isoscore_star, static_argnames="zeta")
isoscore_star_from_cov = jax.jit(isotropy.isoscore_star_from_cov, static_argnames="zeta")
mean_cosine_similarity = jax.jit(isotropy.mean_cosine_similarity)
explained_variance = jax.jit(isotropy.explained_variance, static_argnums=1)


def isoscore_reference(x: np.ndarray) -> float:
    """The eigenvalue definition of IsoScore, SPEC.md §3, in float64."""
    d = x.shape[1]
    lam = np.linalg.eigvalsh(np.cov(x, rowvar=False))
    lam_hat = np.sqrt(d) * lam / np.linalg.norm(lam)
    delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (d - np.sqrt(d)))
    phi = (d - delta**2 * (d - np.sqrt(d))) ** 2 / d**2
    return (d * phi - 1) / (d - 1)


def isoscore_star_reference(x: np.ndarray, c0: np.ndarray, zeta: float) -> float:
    """IsoScore* as the I-STAR reference computes it: torch.cov, shrink, singular values."""
    d = x.shape[1]
    shrunk = (1 - zeta) * np.cov(x, rowvar=False) + zeta * c0
    lam = np.linalg.svd(shrunk, compute_uv=False)
    lam_hat = np.sqrt(d) * lam / np.linalg.norm(lam)
    delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (d - np.sqrt(d)))
    phi = (d - delta**2 * (d - np.sqrt(d))) ** 2 / d**2
    return (d * phi - 1) / (d - 1)


def _cloud(seed, m, d):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(m, d)) @ (rng.normal(size=(d, d)) * np.geomspace(1, 0.01, d)) + 3


@pytest.mark.parametrize("m, d", [(500, 8), (64, 32), (10, 40), (2, 5), (1000, 96)])
def test_isoscore_equals_eigenvalue_definition_and_package(m, d):
    x = _cloud(m + d, m, d)
    got = float(isoscore(jnp.asarray(x, jnp.float32)))
    ref = isoscore_reference(x)
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert got == pytest.approx(float(isoscore_package.IsoScore(x)), rel=1e-5, abs=1e-6)
    with jax.enable_x64(True):
        got64 = float(isoscore(jnp.asarray(x, jnp.float64)))
    assert got64 == pytest.approx(ref, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("m, d", [(300, 8), (12, 30)])
@pytest.mark.parametrize("zeta", [0.0, 0.2, 0.75, 1.0])
def test_isoscore_star_equals_reference(m, d, zeta):
    x = _cloud(7, m, d)
    c0 = np.cov(_cloud(8, 4 * d, d), rowvar=False)
    got = isoscore_star(jnp.asarray(x, jnp.float32), c0=jnp.asarray(c0), zeta=zeta)
    assert float(got) == pytest.approx(isoscore_star_reference(x, c0, zeta), rel=1e-5, abs=1e-6)
    from_cov = isoscore_star_from_cov(np.cov(x, rowvar=False), c0=c0, zeta=zeta)
    assert float(from_cov) == pytest.approx(float(got), rel=1e-5, abs=1e-6)


def test_isoscore_star_at_zeta_zero_is_isoscore_and_identity_default():
    x = jnp.asarray(_cloud(9, 50, 6), jnp.float32)
    assert float(isoscore_star(x, zeta=0.0)) == pytest.approx(float(isoscore(x)))
    eye = isoscore_star_reference(np.asarray(x, np.float64), np.eye(6), 0.4)
    assert float(isoscore_star(x, zeta=0.4)) == pytest.approx(eye, rel=1e-5)


def test_masked_isoscore_star_equals_unpadded_tokens():
    x = _cloud(10, 3 * 20, 8).reshape(3, 20, 8)
    mask = np.arange(20)[None] < np.array([20, 7, 12])[:, None]
    got = isoscore_star(jnp.asarray(x, jnp.float32), mask=jnp.asarray(mask), zeta=0.3)
    ref = isoscore_star_reference(x[mask], np.eye(8), 0.3)
    assert float(got) == pytest.approx(ref, rel=1e-5)


# Properties ------------------------------------------------------------------------------


@hypothesis.settings(deadline=None, max_examples=12)
@hypothesis.given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=2, max_side=12),
        elements=st.floats(-1e3, 1e3),
    )
)
def test_score_lies_in_unit_interval(x):
    score = float(isoscore(jnp.asarray(x, jnp.float32)))
    assert np.isfinite(score) and -1e-5 <= score <= 1 + 1e-5


@pytest.mark.parametrize("d", [2, 7, 64])
def test_isotropic_cloud_scores_one(d):
    cloud = np.concatenate([np.eye(d), -np.eye(d)])  # the ±e_i points
    assert float(isoscore(jnp.asarray(cloud, jnp.float32))) == pytest.approx(1, abs=1e-6)


@hypothesis.settings(deadline=None, max_examples=10)
@hypothesis.given(st.sampled_from([2, 5, 40]), st.integers(0, 2**31 - 1))
def test_rank_one_cloud_scores_zero(d, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(30, 1)) * rng.normal(size=(1, d))
    assert float(isoscore(jnp.asarray(x, jnp.float32))) == pytest.approx(0, abs=1e-5)


@hypothesis.settings(deadline=None, max_examples=10)
@hypothesis.given(st.sampled_from([3, 24]), st.data())
def test_even_spread_over_k_axes_scores_k_minus_one_over_d_minus_one(d, data):
    k = data.draw(st.integers(1, d))
    cloud = np.zeros((2 * d, d))  # ±e_i for i < k, zero rows after: one shape per d
    cloud[:k, :k] = np.eye(k)
    cloud[k : 2 * k, :k] = -np.eye(k)
    got = float(isoscore(jnp.asarray(cloud, jnp.float32)))
    assert got == pytest.approx((k - 1) / (d - 1), abs=1e-5)


@hypothesis.settings(deadline=None, max_examples=10)
@hypothesis.given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3), st.floats(-100, 100))
def test_invariant_to_rotation_translation_and_scale(seed, scale, shift):
    x = _cloud(seed % 1000, 40, 6)
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(6, 6)))
    moved = scale * x @ q + shift
    # float64: in float32 a shift of 100 over a spread of 1e-3 is lost in the input itself.
    with jax.enable_x64(True):
        a = float(isoscore(jnp.asarray(x)))
        b = float(isoscore(jnp.asarray(moved)))
    assert a == pytest.approx(b, rel=1e-8, abs=1e-10)


def test_small_samples_bias_isotropic_data_low():
    # SPEC.md §3: isotropic data in 768-d scores about 0.29 from 320 points.
    x = np.random.default_rng(0).normal(size=(320, 768))
    assert float(isoscore(jnp.asarray(x, jnp.float32))) == pytest.approx(0.29, abs=0.01)


# Gradients -------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="zeta")
def _penalty_grad(x, c0, zeta):
    return jax.grad(lambda p: isotropy.isoscore_star(p, c0=c0, zeta=zeta))(x)


@pytest.mark.parametrize(
    "name, x",
    [
        ("isotropic", np.concatenate([np.eye(5), -np.eye(5)])),
        ("rank one", np.outer(np.arange(1.0, 11.0), np.arange(1.0, 6.0))),
        ("zero", np.zeros((10, 5))),
        ("generic", _cloud(11, 10, 5)),
    ],
)
@pytest.mark.parametrize("zeta", [0.0, 0.3, 1.0])
def test_gradient_is_finite_everywhere(name, x, zeta):
    del name
    grad = _penalty_grad(jnp.asarray(x, jnp.float32), jnp.eye(5) * 0.5, zeta)
    assert np.isfinite(np.asarray(grad)).all()
    if zeta == 1.0:
        assert np.all(np.asarray(grad) == 0)


@pytest.mark.parametrize("m", [12, 3])  # the covariance path and the Gram path (m < d)
def test_gradient_matches_finite_differences_in_float64(m):
    with jax.enable_x64(True):
        x = jnp.asarray(_cloud(12, m, 6))
        c0 = jnp.asarray(np.cov(_cloud(13, 40, 6), rowvar=False))
        # Jitted: each of check_grads' evaluations one program, not every operation alone.
        fn = jax.jit(lambda p: isotropy.isoscore_star(p, c0=c0, zeta=0.2))
        jax.test_util.check_grads(fn, (x,), order=1, modes=["rev"], eps=1e-6, atol=1e-7, rtol=1e-6)


def test_zero_cloud_has_defined_values():
    zeros = jnp.zeros((8, 4))
    assert float(isoscore(zeros)) == 0.0
    assert float(isotropy.participation_ratio(jnp.zeros((4, 4)))) == 0.0
    assert float(mean_cosine_similarity(zeros)) == 0.0
    assert np.all(np.asarray(isotropy.explained_variance_ratio(jnp.zeros((4, 4)))) == 0)


# Analysis measures -----------------------------------------------------------------------


def test_participation_ratio_and_explained_variance_against_eigenvalues():
    x = _cloud(14, 200, 10)
    cov = np.cov(x, rowvar=False)
    lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
    assert float(isotropy.participation_ratio(cov)) == pytest.approx(
        lam.sum() ** 2 / (lam**2).sum(), rel=1e-5
    )
    ratio = np.asarray(isotropy.explained_variance_ratio(jnp.asarray(cov, jnp.float32)))
    np.testing.assert_allclose(ratio, lam / lam.sum(), rtol=1e-4, atol=1e-6)
    for k in (1, 3, 10):
        assert float(explained_variance(cov, k)) == pytest.approx(
            lam[:k].sum() / lam.sum(), rel=1e-5
        )


def test_mean_cosine_similarity_against_the_full_matrix():
    x = _cloud(15, 40, 7)
    x[3] = 0  # a zero vector: cosine 0 with everything
    mask = np.ones(40, bool)
    mask[-5:] = False
    got = float(mean_cosine_similarity(jnp.asarray(x, jnp.float32), jnp.asarray(mask)))
    xs = x[mask]
    norms = np.linalg.norm(xs, axis=1, keepdims=True)
    unit = np.divide(xs, norms, out=np.zeros_like(xs), where=norms > 0)
    sim = unit @ unit.T
    n = len(xs)
    ref = (sim.sum() - np.trace(sim)) / (n * (n - 1))
    assert got == pytest.approx(ref, rel=1e-5)


def test_isoscore_star_traces_once():
    fn = jax.jit(chex.assert_max_traces(lambda p, c: isotropy.isoscore_star(p, c0=c, zeta=0.2), 1))
    for seed in range(3):
        fn(jnp.asarray(_cloud(seed, 20, 4), jnp.float32), jnp.eye(4))


# Bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(points=np.ones(4)), r"shape \(4,\)"),
        (dict(points=np.ones((1, 4))), r"at least two points.*\(1, 4\)"),
        (dict(points=np.ones((5, 4)), c0=np.eye(3)), r"c0 has shape \(3, 3\).*d=4"),
        (dict(points=np.ones((5, 4)), zeta=1.5), r"zeta must lie in \[0, 1\], got 1.5"),
        (dict(points=np.ones((5, 4)), zeta=-0.1), r"got -0.1"),
        (dict(points=np.ones((5, 1))), r"d >= 2"),
    ],
)
def test_bad_input_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        isotropy.isoscore_star(**kwargs)


def test_bad_covariance_and_k_are_named():
    with pytest.raises(ValueError, match=r"\(3, 4\)"):
        isotropy.isoscore_from_cov(np.ones((3, 4)))
    with pytest.raises(ValueError, match=r"k must lie in \[1, d=4\], got 5"):
        isotropy.explained_variance(np.eye(4), 5)


# The summary of streamed sentence vectors ------------------------------------------------


def summary_reference(x: np.ndarray, ddof: int) -> dict:
    """`isotropy.summarize` of ``[n, d]`` float64 points from the definitions (SPEC.md §3, §6,
    §10.4): EV_k, IsoScore and PR of the ``ddof`` covariance's eigenvalues, the mean cosine
    over all pairs of the full cosine matrix, the geometry from singular values (``ddof=0``)."""
    n = len(x)
    cov = np.cov(x, rowvar=False, ddof=ddof)
    lam = np.sort(np.linalg.eigvalsh(cov))[::-1]
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    unit = np.divide(x, norms, out=np.zeros_like(x), where=norms > 0)
    cos = unit @ unit.T

    def entropy_rank(s, eps=0.0):
        p = s / s.sum() + eps
        return np.exp(-np.sum(p * np.log(p)))

    var = np.var(x, axis=0)
    return {
        "count": n,
        "ev1": lam[0] / lam.sum(),
        "ev3": lam[:3].sum() / lam.sum(),
        "isoscore": isoscore_reference(x),  # scale-free: the same for every ddof
        "participation_ratio": lam.sum() ** 2 / (lam**2).sum(),
        "mean_cosine": (cos.sum() - np.trace(cos)) / (n * (n - 1)),
        "erank": entropy_rank(np.linalg.svd(x - x.mean(0), compute_uv=False)),
        "rankme": entropy_rank(np.linalg.svd(x, compute_uv=False), 1e-7),
        "outliers": np.sum(var >= 5 * var.mean()),
        "principal_outlier": np.argmax(var),
        "principal_outlier_share": var.max() / var.sum(),
        "ev_ratio": lam / lam.sum(),
        "std": np.std(x, axis=0, ddof=ddof),
    }


@pytest.mark.parametrize("ddof", [0, 1])  # the dev evaluation's, `isojax analyze`'s
def test_summarize_matches_numpy_float64(ddof):
    """`summarize` of statistics streamed in uneven, masked batches (a zero vector among the
    points) equals the float64 definitions, key for key: the `SCALARS`, `ev_ratio`, `std`."""
    rng = np.random.default_rng(3)
    x = _cloud(3, 70, 9)
    x[:, 4] *= 12  # one dimension far above the others: a principal outlier
    x[5] = 0  # cosine 0 with every other point
    keep = rng.random(70) > 0.25  # dropped rows stand for batch filler
    state = isotropy.sentence_stats_init(9)
    update = jax.jit(isotropy.sentence_stats_update)
    for lo, hi in ((0, 30), (30, 41), (41, 70)):
        state = update(state, jnp.asarray(x[lo:hi], jnp.float32), jnp.asarray(keep[lo:hi]))
    got = jax.tree.map(np.asarray, jax.jit(isotropy.summarize, static_argnums=1)(state, ddof))
    want = summary_reference(x[keep].astype(np.float32).astype(np.float64), ddof)
    assert set(got) == {*isotropy.SCALARS, "ev_ratio", "std"} == set(want)
    assert want["outliers"] == 1 and want["principal_outlier"] == 4
    for key, value in want.items():
        integer = key in ("outliers", "principal_outlier")
        assert got[key].dtype == (np.int32 if integer else np.float32), key
        np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=2e-6, err_msg=key)
