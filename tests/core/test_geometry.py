"""Effective rank, RankMe, outlier dimensions and the 1-D rule against float64 NumPy
transcriptions of SPEC.md §10.4, the moment forms against the vector forms."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.core import geometry, stats

# The measures run jitted, one program a shape (from the session's compile cache): called
# eagerly, each dispatched some hundred small ops compiled one by one, most of this file's
# seconds. The same jnp code either way.
effective_rank = jax.jit(geometry.effective_rank)
rankme = jax.jit(geometry.rankme)
outlier_dimensions = jax.jit(geometry.outlier_dimensions)
geometry_from_moments = jax.jit(geometry.geometry_from_moments)
moments_update = jax.jit(stats.moments_update)
fit_threshold = jax.jit(geometry.fit_threshold, static_argnums=2)


def erank_reference(x: np.ndarray) -> float:
    """Roy & Vetterli 2007 on the centred rows, float64."""
    s = np.linalg.svd(x - x.mean(0), compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-np.sum(p * np.log(p))))


def rankme_reference(x: np.ndarray) -> float:
    """Garrido et al. 2023, Eq. 1, as their code: svdvals of the uncentred rows, + 1e-7."""
    s = np.linalg.svd(x, compute_uv=False)
    p = s / np.sum(np.abs(s)) + 1e-7
    return float(np.exp(-np.sum(p * np.log(p))))


def outliers_reference(x: np.ndarray, multiple: float = 5.0):
    var = np.var(x, axis=0)
    return int(np.sum(var >= multiple * var.mean())), int(np.argmax(var)), var.max() / var.sum()


def cloud(n: int, d: int, seed: int, outliers=(3,)) -> np.ndarray:
    """Anisotropic rows with a large mean and a few high-variance dimensions."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-1.0, 0.5, d))
    scale[list(outliers)] = 8.0 + np.arange(len(outliers))
    return rng.normal(size=(n, d)) * scale + rng.normal(size=d) * 3


@pytest.mark.parametrize("n, d", [(200, 8), (40, 64), (20, 64)])
def test_vector_forms_match_float64(n, d):
    """Effective rank and RankMe within 1e-5 of float64 NumPy (n < d included); the outlier
    count and principal outlier exactly, its share within 1e-5."""
    x = cloud(n, d, seed=n + d, outliers=(3, 5))
    np.testing.assert_allclose(effective_rank(x), erank_reference(x), rtol=1e-5)
    np.testing.assert_allclose(rankme(x), rankme_reference(x), rtol=1e-5)
    got = outlier_dimensions(x)
    count, principal, share = outliers_reference(x)
    assert (int(got.count), int(got.principal)) == (count, principal)
    assert principal in (3, 5) and count >= (1 if d > 8 else 0)
    np.testing.assert_allclose(got.share, share, rtol=1e-5)


def test_outlier_count_multiple_and_ties():
    """`>= multiple × mean` counts, the first of tied maxima is the principal outlier."""
    var = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 10.0, 10.0, 0.0])  # mean 3.125
    got = geometry.outliers_from_variances(var, multiple=3.2)
    assert (int(got.count), int(got.principal)) == (2, 5)
    assert int(geometry.outliers_from_variances(var, multiple=10 / 3.125).count) == 2
    assert int(geometry.outliers_from_variances(var).count) == 0
    np.testing.assert_allclose(got.share, 10 / 25, rtol=1e-6)


def streamed(x: np.ndarray, mask: np.ndarray | None = None, chunks: int = 3):
    state = stats.moments_init(x.shape[1])
    w = np.ones(len(x)) if mask is None else mask
    for xs, ws in zip(np.array_split(x, chunks), np.array_split(w, chunks), strict=True):
        state = moments_update(state, jnp.asarray(xs, jnp.float32), jnp.asarray(ws))
    return geometry_from_moments(state)


@pytest.mark.parametrize("n, d", [(300, 16), (50, 64)])
def test_moment_forms_equal_vector_forms(n, d):
    """What the dev evaluation streams gives the measures of the rows themselves, n < d too
    (the eigenvalues of a rank-deficient float32 covariance below d·eps·λ_max count as 0)."""
    x = cloud(n, d, seed=7 * n + d, outliers=(1, 2, 9))
    got = streamed(x)
    np.testing.assert_allclose(got["erank"], effective_rank(x), rtol=2e-5)
    np.testing.assert_allclose(got["erank"], erank_reference(x), rtol=2e-5)
    np.testing.assert_allclose(got["rankme"], rankme(x), rtol=2e-5)
    np.testing.assert_allclose(got["rankme"], rankme_reference(x), rtol=2e-5)
    count, principal, share = outliers_reference(x)
    assert (int(got["outliers"]), int(got["principal_outlier"])) == (count, principal)
    assert count >= 2 and principal in (1, 2, 9)
    np.testing.assert_allclose(got["principal_outlier_share"], share, rtol=1e-5)


def collapsed(n: int, d: int, ev1: float, seed: int) -> np.ndarray:
    """Rows whose first principal direction holds ``ev1`` of the variance, the other ``d − 1``
    sharing the rest evenly: the head inputs the whitening study measures (EV_1 0.98-0.999)."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=d)
    u /= np.linalg.norm(u)
    z = rng.normal(size=(n, d))
    z -= np.outer(z @ u, u)
    z *= np.sqrt((1 - ev1) / (d - 1))
    return z + np.outer(rng.normal(size=n), u) * np.sqrt(ev1) + 0.5


@pytest.mark.parametrize(
    "name",
    ["ev1 0.99", "ev1 0.999", "variances 1/k^2", "rank 40 of 64", "n < d collapsed"],
)
def test_moment_forms_keep_a_collapsed_spectrum(name):
    """Audit 6, finding 1: on a collapsed float32 cloud (d = 384, 1000 rows) the streamed
    effective rank and RankMe are within 1 % of the vector forms and of float64 NumPy. The
    old cut at ``d·eps·λ_max`` dropped the tail the float32 eigenvalues resolve: 7.2 for 89.9
    at EV_1 0.99, 1.00 for 17.4 at EV_1 0.999, 51 for 96 on a 1/k² spectrum. A rank-deficient
    cloud (rows in a 40-D subspace; fewer rows than dimensions) keeps its rank: rounding-level
    eigenvalues add no spread."""
    rng = np.random.default_rng(5)
    if name.startswith("ev1"):
        x = collapsed(1000, 384, float(name.split()[1]), seed=0)
    elif name == "variances 1/k^2":
        x = rng.normal(size=(3000, 384)) / np.arange(1, 385)
    elif name == "rank 40 of 64":
        q, _ = np.linalg.qr(rng.normal(size=(64, 64)))
        x = (rng.normal(size=(2000, 40)) * np.exp(rng.uniform(-1, 0.5, 40))) @ q[:40] + 3
    else:
        x = collapsed(200, 384, 0.99, seed=1) + 5
    x32 = np.asarray(x, np.float32)
    got = streamed(x32, chunks=4)
    reference = np.asarray(x32, np.float64)
    np.testing.assert_allclose(got["erank"], erank_reference(reference), rtol=1e-2)
    np.testing.assert_allclose(got["erank"], effective_rank(x32), rtol=1e-2)
    np.testing.assert_allclose(got["rankme"], rankme_reference(reference), rtol=1e-2)
    np.testing.assert_allclose(got["rankme"], rankme(x32), rtol=1e-2)


def test_masks_drop_rows():
    """A masked row, even NaN or huge, changes nothing: vector and moment forms equal those of
    the kept rows alone."""
    x = cloud(60, 12, seed=1)
    mask = np.ones(60)
    mask[[0, 17, 59]] = 0
    dirty = x.copy()
    dirty[0] = np.nan
    dirty[17] = 1e6
    kept = x[mask > 0]
    np.testing.assert_allclose(effective_rank(dirty, mask), erank_reference(kept), 1e-5)
    np.testing.assert_allclose(rankme(dirty, mask), rankme_reference(kept), rtol=1e-5)
    got = outlier_dimensions(dirty, mask)
    assert (int(got.count), int(got.principal)) == outliers_reference(kept)[:2]
    moments = streamed(dirty, mask)
    np.testing.assert_allclose(moments["erank"], erank_reference(kept), rtol=2e-5)
    np.testing.assert_allclose(moments["rankme"], rankme_reference(kept), rtol=2e-5)
    # A [batch, len, d] cloud with a [batch, len] mask: tokens, flattened.
    tokens = dirty.reshape(6, 10, 12)
    np.testing.assert_allclose(
        effective_rank(tokens, mask.reshape(6, 10)), erank_reference(kept), rtol=1e-5
    )


def test_bfloat16_in_float32_out():
    """bf16 vectors give float32 statistics, equal to those of the same values in float32."""
    x = jnp.asarray(cloud(64, 16, seed=2), jnp.bfloat16)
    x32 = np.asarray(x.astype(jnp.float32), np.float64)
    pairs = ((effective_rank, erank_reference), (rankme, rankme_reference))
    for fn, ref in pairs:
        got = fn(x)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, ref(x32), rtol=1e-5)
    out = outlier_dimensions(x)
    assert out.share.dtype == jnp.float32 and out.count.dtype == jnp.int32
    assert (int(out.count), int(out.principal)) == outliers_reference(x32)[:2]
    state = moments_update(stats.moments_init(16), x, jnp.ones(64))
    got = geometry_from_moments(state)
    assert all(v.dtype in (jnp.float32, jnp.int32) for v in got.values())


def test_degenerate_sets_are_zero_not_nan():
    zeros = np.zeros((10, 4))
    same = np.ones((10, 4))
    assert float(effective_rank(zeros)) == 0 == float(effective_rank(same))
    assert float(rankme(zeros)) == 0
    out = outlier_dimensions(same)
    assert (int(out.count), float(out.share)) == (0, 0.0)
    got = geometry_from_moments(stats.moments_init(4))
    assert all(float(v) == 0 for v in got.values())
    np.testing.assert_allclose(rankme(same), 1.0, rtol=1e-5)  # one value
    # Audit 6, finding 10, as the module docstring now says: equal rows whose float32 mean is
    # not exact centre to rounding noise (effective rank about 1, not 0), and the moment
    # forms hold the scale down to about 1e-18 only (float32 M₂ underflows below).
    row = np.random.default_rng(0).normal(size=16).astype(np.float32)
    assert 0.99 < float(effective_rank(np.tile(row, (10, 1)))) < 1.5
    tiny = np.random.default_rng(1).normal(size=(100, 16)).astype(np.float32)
    for scale, ok in ((1e-15, True), (1e-20, False)):
        got = streamed(tiny * np.float32(scale))["erank"]
        assert np.isclose(got, effective_rank(tiny), rtol=1e-3) == ok


# ---------------------------------------------------------------------------------------------
# The 1-D rule, against a brute-force search written here.
# ---------------------------------------------------------------------------------------------


def brute_force_rule(x: np.ndarray, y: np.ndarray, k: int):
    """Every threshold (midpoints of consecutive distinct values, and ±inf), every ordered
    pair of classes; the first best in (threshold ascending, pair) order."""
    u = np.unique(x)
    thresholds = [-np.inf, *((u[:-1] + u[1:]) / 2), np.inf]
    best = (-1.0, None)
    for t in thresholds:
        for a, b in itertools.permutations(range(k), 2):
            accuracy = np.mean(np.where(x <= t, a, b) == y)
            if accuracy > best[0]:
                best = (accuracy, (t, a, b))
    return best


@pytest.mark.parametrize("k, seed", [(2, 0), (2, 1), (3, 2)])
def test_fit_threshold_is_the_brute_force_optimum(k, seed):
    """The fitted rule's train accuracy is the brute-force maximum, its rule the same (ties:
    lowest threshold, first pair), and its dev predictions score what the brute force's do."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, 300)
    x = np.round(rng.normal(size=300) + 1.2 * y, 1).astype(np.float32)  # ties on purpose
    accuracy, (t, a, b) = brute_force_rule(x.astype(np.float64), y, k)
    rule = fit_threshold(x, y, k)
    np.testing.assert_allclose(rule.train_accuracy, accuracy, rtol=1e-6)
    assert (int(rule.below), int(rule.above)) == (a, b)
    np.testing.assert_allclose(rule.threshold, t, rtol=1e-6)
    y_dev = rng.integers(0, k, 200)
    x_dev = (rng.normal(size=200) + 1.2 * y_dev).astype(np.float32)
    got = np.asarray(geometry.apply_threshold(rule, x_dev))
    np.testing.assert_array_equal(got, np.where(x_dev <= t, a, b))
    assert np.mean(got == y_dev) > 1 / k + 0.1


def test_fit_threshold_one_side_and_reversed():
    """A rule may put every value on one side (one class) or the larger class below."""
    x = np.array([0.0, 1.0, 2.0, 3.0])
    rule = fit_threshold(x, np.array([1, 1, 0, 0]), 2)
    assert (int(rule.below), int(rule.above), float(rule.threshold)) == (1, 0, 1.5)
    rule = fit_threshold(x, np.array([1, 1, 1, 1]), 2)
    assert float(rule.train_accuracy) == 1.0
    assert np.all(np.asarray(geometry.apply_threshold(rule, x)) == 1)


def test_fit_sign():
    rng = np.random.default_rng(3)
    x = rng.normal(size=100)
    assert float(geometry.fit_sign(x, -2 * x + rng.normal(size=100) * 0.1)) == -1.0
    assert float(geometry.fit_sign(x, x)) == 1.0
