"""Moments and the streaming accumulator against float64 NumPy."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.core import stats


def _cloud(seed, m, d, shift=0.0):
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.linspace(3.0, 0.1, d)
    return rng.normal(size=(m, d)) @ mixing + shift


@pytest.mark.parametrize("ddof", [0, 1])
def test_batch_moments_match_numpy(ddof):
    x = _cloud(0, 200, 12, shift=5.0)
    got = jax.jit(lambda p: stats.batch_moments(p, ddof=ddof))(jnp.asarray(x, jnp.float32))
    ref = np.cov(x, rowvar=False, ddof=ddof)
    assert got.cov.dtype == jnp.float32
    np.testing.assert_allclose(got.mean, x.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.cov, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got.std, np.sqrt(np.diag(ref)), rtol=1e-5)
    assert float(got.count) == 200


def test_masked_moments_equal_moments_of_the_subset():
    x = _cloud(1, 4 * 16, 8).reshape(4, 16, 8)  # [batch, len, d]
    lengths = np.array([16, 3, 9, 1])
    mask = np.arange(16)[None, :] < lengths[:, None]
    got = stats.batch_moments(jnp.asarray(x, jnp.float32), jnp.asarray(mask), ddof=1)
    subset = x[mask]
    np.testing.assert_allclose(got.cov, np.cov(subset, rowvar=False), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.mean, subset.mean(0), rtol=1e-5, atol=1e-6)
    assert float(got.count) == mask.sum()


def test_nan_in_a_masked_point_does_not_poison_the_moments():
    x = _cloud(8, 10, 3)
    x[4] = np.nan
    mask = np.ones(10, bool)
    mask[4] = False
    got = stats.batch_moments(jnp.asarray(x, jnp.float32), jnp.asarray(mask), ddof=1)
    np.testing.assert_allclose(got.cov, np.cov(x[mask], rowvar=False), rtol=1e-4, atol=1e-5)


def test_mask_over_layers_is_given_whole():
    x = _cloud(2, 3 * 2 * 5, 6).reshape(3, 2, 5, 6)  # [layers, batch, len, d]
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # [batch, len]
    layer_mask = np.broadcast_to(mask, x.shape[:-1])  # [layers, batch, len]
    got = stats.batch_moments(jnp.asarray(x, jnp.float32), jnp.asarray(layer_mask))
    subset = x[:, mask.astype(bool)].reshape(-1, 6)
    np.testing.assert_allclose(got.cov, np.cov(subset, rowvar=False, ddof=0), rtol=1e-4, atol=1e-5)
    # A [batch, len] mask is aligned with [layers, batch]: an error, never a silent guess.
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5\) does not cover .*\(3, 2, 5\)"):
        stats.batch_moments(jnp.asarray(x, jnp.float32), jnp.asarray(mask))


@pytest.mark.parametrize("update", [False, True])
def test_example_mask_covers_the_batch_axis_when_batch_equals_len(update):
    # [batch, len, d] with batch == len: a [batch] mask keeps whole examples. NumPy's
    # right-aligned broadcasting would pair it with the len axis and keep token positions.
    x = _cloud(9, 4 * 4, 5).reshape(4, 4, 5)
    example_mask = np.array([1, 0, 1, 1])
    points = jnp.asarray(x, jnp.float32)
    if update:
        state = stats.moments_update(stats.moments_init(5), points, jnp.asarray(example_mask))
        got = stats.moments_finalize(state, ddof=1)
    else:
        got = stats.batch_moments(points, jnp.asarray(example_mask), ddof=1)
    subset = x[example_mask.astype(bool)].reshape(-1, 5)  # the 3 kept examples' 12 tokens
    assert float(got.count) == 12
    np.testing.assert_allclose(got.mean, subset.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.cov, np.cov(subset, rowvar=False), rtol=1e-4, atol=1e-5)
    # The same [batch, 1] and [batch, len] masks say the same thing.
    full = np.broadcast_to(example_mask[:, None], (4, 4))
    for mask in (example_mask[:, None], full):
        again = stats.batch_moments(points, jnp.asarray(mask), ddof=1)
        np.testing.assert_allclose(again.cov, got.cov, rtol=1e-6, atol=1e-7)


def test_example_mask_on_tokens_of_another_length():
    # batch != len: a [batch] mask used to fail to broadcast; it now covers the examples.
    x = _cloud(10, 3 * 7, 4).reshape(3, 7, 4)
    example_mask = np.array([0, 1, 1])
    got = stats.batch_moments(jnp.asarray(x, jnp.float32), jnp.asarray(example_mask))
    subset = x[1:].reshape(-1, 4)
    np.testing.assert_allclose(got.cov, np.cov(subset, rowvar=False, ddof=0), rtol=1e-4, atol=1e-5)


def test_accumulator_over_batches_equals_one_shot():
    x = _cloud(3, 300, 10, shift=100.0)  # a large mean: E[xx^T] - mu mu^T would lose digits
    mask = np.random.default_rng(3).random(300) > 0.3
    state = stats.moments_init(10)
    update = jax.jit(stats.moments_update)
    for chunk, m in zip(np.array_split(x, 7), np.array_split(mask, 7), strict=True):
        state = update(state, jnp.asarray(chunk, jnp.float32), jnp.asarray(m))
    got = stats.moments_finalize(state, ddof=1)
    ref = np.cov(x[mask], rowvar=False)
    np.testing.assert_allclose(got.cov, ref, rtol=2e-4, atol=1e-4)
    np.testing.assert_allclose(got.mean, x[mask].mean(0), rtol=1e-6)


def test_merge_is_associative_over_devices():
    x = _cloud(4, 64, 5)
    parts = [
        stats.moments_update(stats.moments_init(5), jnp.asarray(p, jnp.float32))
        for p in np.split(x, 4)
    ]
    left = stats.moments_merge(stats.moments_merge(parts[0], parts[1]), parts[2])
    right = stats.moments_merge(parts[0], stats.moments_merge(parts[1], parts[2]))
    chex.assert_trees_all_close(left, right, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_large_values_give_finite_float32(dtype):
    # 300^2 = 90000 overflows float16 (max 65504): statistics must be float32 first.
    x = 300.0 + 20.0 * _cloud(5, 128, 6) / 10
    got = stats.batch_moments(jnp.asarray(x, dtype))
    assert got.cov.dtype == jnp.float32 and got.mean.dtype == jnp.float32
    assert np.isfinite(np.asarray(got.cov)).all()
    xq = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got.cov, np.cov(xq, rowvar=False, ddof=0), rtol=1e-3, atol=1e-2)
    state = stats.moments_update(stats.moments_init(6), jnp.asarray(x, dtype))
    assert np.isfinite(np.asarray(state.m2)).all()


def test_shard_map_axis_name_gives_global_moments():
    mesh = jax.make_mesh((4,), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.P("data"))
    x = jax.device_put(jnp.asarray(_cloud(6, 64, 6), jnp.float32), rows)
    mask = jax.device_put(jnp.asarray(np.random.default_rng(6).random(64) > 0.2), rows)
    local = jax.shard_map(
        lambda p, m: stats.batch_moments(p, m, axis_name="data"),
        mesh=mesh,
        in_specs=(jax.P("data"), jax.P("data")),
        out_specs=jax.P(),
    )
    got = jax.jit(local)(x, mask)
    ref = stats.batch_moments(x, mask)
    chex.assert_trees_all_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("explicit", [True, False])
def test_jit_over_a_sharded_batch_gives_global_moments(explicit):
    axis_type = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4,), ("data",), axis_types=(axis_type,))
    x = jnp.asarray(_cloud(7, 64, 6), jnp.float32)
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("data")))
    got = jax.jit(stats.batch_moments)(sharded)
    chex.assert_trees_all_close(got, stats.batch_moments(x), rtol=1e-5, atol=1e-5)


def test_empty_and_single_point_states_are_zero_not_nan():
    got = stats.moments_finalize(stats.moments_init(3), ddof=1)
    assert np.all(np.asarray(got.cov) == 0) and np.isfinite(np.asarray(got.std)).all()
    one = stats.batch_moments(jnp.ones((4, 3)), jnp.array([0, 1, 0, 0]), ddof=1)
    assert np.all(np.asarray(one.cov) == 0)


def test_moments_trace_once():
    fn = jax.jit(chex.assert_max_traces(lambda p: stats.batch_moments(p), n=1))
    for seed in range(3):
        fn(jnp.asarray(_cloud(seed, 16, 4), jnp.float32))


@pytest.mark.parametrize(
    "points, mask, match",
    [
        (np.ones(5), None, r"shape \(5,\)"),
        (np.ones((4, 3)), np.ones(5), r"mask of shape \(5,\)"),
        (np.ones((4, 2, 3)), np.ones(2), r"mask of shape \(2,\) does not cover .*\(4, 2\)"),
        (np.ones((4, 2, 3)), np.ones((4, 2, 1)), r"mask of shape \(4, 2, 1\)"),
        (np.ones((4, 3), np.int32), None, "floating point"),
    ],
)
def test_bad_input_is_named(points, mask, match):
    with pytest.raises(ValueError, match=match):
        stats.batch_moments(points, mask)


def test_update_with_wrong_d_is_named():
    with pytest.raises(ValueError, match="d=4.*d=3"):
        stats.moments_update(stats.moments_init(3), jnp.ones((2, 4)))
