"""IsoScoreStar: running stabiliser C0 in 'batch_stats', against float64 NumPy references."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from isojax.core import isotropy, istar, penalties
from isojax.linen import istar as linen_istar

L, B, T, D = 2, 8, 6, 8  # [layers, batch, len, d]


def _batch(seed, scale=1.0, shift=3.0):
    """Hidden states [L, B, T, D] with correlated, shifted features and a ragged mask [B, T]."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(D, D)) * np.linspace(2.0, 0.2, D)
    x = (rng.normal(size=(L, B, T, D)) @ mixing + shift) * scale
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int32)
    return x, mask


def _tokens(x, mask):
    """float64 [n, D]: the unmasked token vectors of every layer."""
    return np.asarray(x, np.float64)[:, mask.astype(bool)].reshape(-1, D)


def _np_score(cov, c0, zeta):
    """IsoScore* from the eigenvalue definition (SPEC.md §3), float64."""
    lam = np.linalg.eigvalsh((1 - zeta) * cov + zeta * c0)
    d = len(lam)
    lam_hat = np.sqrt(d) * lam / np.linalg.norm(lam)
    delta = np.linalg.norm(lam_hat - 1) / np.sqrt(2 * (d - np.sqrt(d)))
    phi = (d - delta**2 * (d - np.sqrt(d))) ** 2 / d**2
    return (d * phi - 1) / (d - 1)


def _train_step(model):
    """jit(variables, x, mask) -> (score, new batch_stats)."""

    @jax.jit
    def step(variables, x, mask):
        score, updates = model.apply(
            variables, x, mask, use_running_average=False, mutable=["batch_stats"]
        )
        return score, updates["batch_stats"]

    return step


def _init(model, x, mask):
    return model.init(jax.random.key(0), jnp.asarray(x), mask, use_running_average=True)


@pytest.mark.parametrize("unit, window", [("steps", 3), ("tokens", 150)])
def test_epoch_window_c0_is_covariance_of_window_tokens(unit, window):
    zeta = 0.3
    model = linen_istar.IsoScoreStar(stabilizer="epoch", zeta=zeta, window=window, window_unit=unit)
    batches = [_batch(s) for s in range(7)]
    variables = _init(model, batches[0][0].astype(np.float32), batches[0][1])
    bs = variables["batch_stats"]
    np.testing.assert_array_equal(bs["c0"], np.eye(D))
    step = _train_step(model)
    seen, c0_ref, closes_at = [], np.eye(D), []
    for i, (x, mask) in enumerate(batches):
        score, bs = step({"batch_stats": bs}, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
        # The score uses the C0 from before this step, even on the step that closes the window.
        tokens = _tokens(x, mask)
        np.testing.assert_allclose(
            score, _np_score(np.cov(tokens, rowvar=False), c0_ref, zeta), rtol=2e-5, atol=2e-6
        )
        seen.append(tokens)
        window_tokens = np.concatenate(seen)
        closes = len(seen) == window if unit == "steps" else len(window_tokens) >= window
        if closes:
            c0_ref = np.cov(window_tokens, rowvar=False)
            seen = []
            closes_at.append(i)
        assert bs["c0"].dtype == jnp.float32
        tol = 1e-5 * np.abs(c0_ref).max()
        np.testing.assert_allclose(bs["c0"], c0_ref, rtol=1e-5, atol=tol)
        assert int(bs["steps_in_window"]) == len(seen)
        assert int(bs["window_count"]) == sum(len(s) for s in seen)
        assert int(bs["windows_closed"]) == len(closes_at)
    assert len(closes_at) >= 2  # two windows closed: the second C0 holds only its own tokens
    assert int(bs["count"]) == len(batches) and int(bs["skipped"]) == 0


def test_c0_init_is_used_until_the_first_window_closes():
    x, mask = _batch(0)
    given = np.diag(np.arange(1.0, D + 1))
    model = linen_istar.IsoScoreStar(
        window=2, window_unit="steps", c0_init=nn.initializers.constant(given)
    )
    bs = _init(model, x.astype(np.float32), mask)["batch_stats"]
    score, bs = _train_step(model)({"batch_stats": bs}, jnp.asarray(x, jnp.float32), mask)
    np.testing.assert_allclose(bs["c0"], given)
    ref = _np_score(np.cov(_tokens(x, mask), rowvar=False), given, 0.2)
    np.testing.assert_allclose(score, ref, rtol=2e-5)


@pytest.mark.parametrize("debias", [False, True])
def test_ema_matches_numpy_transcription(debias):
    momentum, zeta = 0.8, 0.25
    given = np.diag(np.linspace(0.5, 2.0, D))
    model = linen_istar.IsoScoreStar(
        stabilizer="ema",
        zeta=zeta,
        momentum=momentum,
        debias=debias,
        c0_init=nn.initializers.constant(given),
    )
    batches = [_batch(10 + s) for s in range(5)]
    bs = _init(model, batches[0][0].astype(np.float32), batches[0][1])["batch_stats"]
    step = _train_step(model)
    ema = np.zeros((D, D)) if debias else given.copy()
    c0 = given.copy()
    for t, (x, mask) in enumerate(batches, start=1):
        score, bs = step({"batch_stats": bs}, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
        cov = np.cov(_tokens(x, mask), rowvar=False)
        np.testing.assert_allclose(score, _np_score(cov, c0, zeta), rtol=2e-5, atol=2e-6)
        ema = momentum * ema + (1 - momentum) * cov
        c0 = ema / (1 - momentum**t) if debias else ema
        tol = 1e-5 * np.abs(c0).max()
        np.testing.assert_allclose(bs["ema"], ema, rtol=1e-5, atol=tol)
        np.testing.assert_allclose(bs["c0"], c0, rtol=1e-5, atol=tol)
        assert int(bs["count"]) == t


@pytest.mark.parametrize("mode", ["epoch", "ema"])
def test_gradient_flows_through_batch_covariance_only(mode):
    zeta = 0.4
    model = linen_istar.IsoScoreStar(stabilizer=mode, zeta=zeta, window=1, window_unit="steps")
    x0, mask0 = _batch(20)
    variables = _init(model, x0.astype(np.float32), mask0)
    # One update, so that C0 is a data covariance rather than the identity.
    _, bs = _train_step(model)(variables, jnp.asarray(x0, jnp.float32), mask0)
    assert not np.allclose(bs["c0"], np.eye(D))
    x, mask = _batch(21)
    x = jnp.asarray(x, jnp.float32)

    def penalty(batch_stats, h):
        score, _ = model.apply(
            {"batch_stats": batch_stats}, h, mask, use_running_average=False, mutable=True
        )
        return 1 - score

    grad_x = jax.jit(jax.grad(penalty, argnums=1))(bs, x)
    c0 = bs["c0"]
    ref = jax.jit(
        jax.grad(
            lambda h: (
                1
                - isotropy.isoscore_star(
                    h, c0=c0, zeta=zeta, mask=np.broadcast_to(mask, x.shape[:-1])
                )
            )
        )
    )(x)
    assert float(jnp.max(jnp.abs(ref))) > 1e-4  # the penalty has a gradient to compare
    np.testing.assert_allclose(grad_x, ref, rtol=1e-4, atol=1e-6 * float(jnp.max(jnp.abs(ref))))
    np.testing.assert_array_equal(grad_x[:, ~mask.astype(bool)], 0.0)  # padding gets nothing
    # Nothing flows into the running state: neither from C0 nor into the updated state.
    grad_state = jax.jit(jax.grad(penalty, argnums=0, allow_int=True))(bs, x)
    for leaf in jax.tree.leaves(grad_state):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            np.testing.assert_array_equal(leaf, 0.0)

    def new_state_sum(h):
        _, updates = model.apply(
            {"batch_stats": bs}, h, mask, use_running_average=False, mutable=["batch_stats"]
        )
        return sum(jnp.sum(v) for v in jax.tree.leaves(updates) if v.dtype == jnp.float32)

    np.testing.assert_array_equal(jax.jit(jax.grad(new_state_sum))(x), 0.0)


def test_bad_batches_leave_state_unchanged_and_are_counted():
    model = linen_istar.IsoScoreStar(window=2, window_unit="steps")
    x, mask = _batch(30)
    bs = _init(model, x.astype(np.float32), mask)["batch_stats"]
    _, bs = _train_step(model)({"batch_stats": bs}, jnp.asarray(x, jnp.float32), mask)

    @jax.jit
    def step(batch_stats, h, m):
        return model.apply(
            {"batch_stats": batch_stats},
            h,
            m,
            use_running_average=False,
            mutable=["batch_stats", "intermediates"],
        )

    nan_x = jnp.asarray(x, jnp.float32).at[0, 0, 0, 0].set(jnp.nan)
    no_tokens = jnp.zeros_like(jnp.asarray(mask))
    for h, m, skipped in [(nan_x, mask, 1), (jnp.asarray(x, jnp.float32), no_tokens, 2)]:
        _, updates = step(bs, h, m)
        assert bool(updates["intermediates"]["skipped_batch"][0])
        new = updates["batch_stats"]
        assert int(new["skipped"]) == skipped and int(new["count"]) == 1
        for key in ("c0", "window_count", "window_mean", "window_m2", "steps_in_window"):
            np.testing.assert_array_equal(new[key], bs[key])
        bs = new
    _, updates = step(bs, jnp.asarray(x, jnp.float32), mask)
    assert not bool(updates["intermediates"]["skipped_batch"][0])
    assert int(updates["batch_stats"]["windows_closed"]) == 1


@pytest.mark.parametrize("mode", ["epoch", "ema", "pass"])
def test_frozen_state_in_evaluation_and_pass_mode(mode):
    model = linen_istar.make_isoscore_star(mode, zeta=0.2, window=1, window_unit="steps")
    x, mask = _batch(40)
    variables = _init(model, x.astype(np.float32), mask)
    score = model.apply(variables, jnp.asarray(x, jnp.float32), mask, use_running_average=True)
    ref = isotropy.isoscore_star(
        jnp.asarray(x, jnp.float32), mask=np.broadcast_to(mask, x.shape[:-1]), zeta=0.2
    )
    np.testing.assert_allclose(score, ref, rtol=1e-5)
    _, bs = _train_step(model)(variables, jnp.asarray(x, jnp.float32), mask)
    if mode == "pass":  # the reference stabiliser: only the explicit pass changes C0
        chex.assert_trees_all_equal(bs, variables["batch_stats"])
    c0 = np.cov(_tokens(x, mask), rowvar=False)
    replaced = istar.replace_c0(bs, c0)
    score = model.apply({"batch_stats": replaced}, x, mask, use_running_average=True)
    np.testing.assert_allclose(score, _np_score(c0, c0, 0.2), rtol=2e-5)
    with pytest.raises(ValueError, match="shape"):
        istar.replace_c0(bs, np.eye(D + 1))
    # The train-step helpers: data-free initial state, penalty and state in one call.
    chex.assert_trees_all_equal(linen_istar.init_batch_stats(model, D), variables["batch_stats"])
    penalty, new_bs = jax.jit(functools.partial(linen_istar.penalty_and_update, model))(
        variables["batch_stats"], [jnp.asarray(h, jnp.float32) for h in x], mask
    )
    np.testing.assert_allclose(penalty, 1 - ref, rtol=1e-5)
    chex.assert_trees_all_close(new_bs, bs, rtol=1e-6)


def test_epoch_window_equals_the_reference_pass_and_penalty():
    """One window over the batches of an explicit pass gives the pass's C0 (regularizers)."""
    zeta = 0.2
    batches = [_batch(45 + s) for s in range(3)]
    n_tokens = sum(len(_tokens(x, m)) for x, m in batches)
    pass_state = penalties.c0_pass_init(D)
    for x, mask in batches:
        layers = [jnp.asarray(h, jnp.float32) for h in x]  # L arrays [batch, len, d]
        pass_state = penalties.c0_pass_update(pass_state, layers, mask)
    c0_pass = penalties.c0_pass_finalize(pass_state)
    model = linen_istar.IsoScoreStar(stabilizer="epoch", zeta=zeta, window=n_tokens)
    bs = _init(model, batches[0][0].astype(np.float32), batches[0][1])["batch_stats"]
    step = _train_step(model)
    for x, mask in batches:
        _, bs = step({"batch_stats": bs}, jnp.asarray(x, jnp.float32), mask)
    assert int(bs["windows_closed"]) == 1
    np.testing.assert_allclose(bs["c0"], c0_pass, rtol=1e-5, atol=1e-6)
    # With the pass's C0 in the 'pass' stabiliser, the module's penalty is the reference's.
    ref_model = linen_istar.make_isoscore_star("pass", zeta=zeta)
    layers = [jnp.asarray(h, jnp.float32) for h in batches[0][0]]
    ref_bs = istar.replace_c0(_init(ref_model, layers, batches[0][1])["batch_stats"], c0_pass)
    score = ref_model.apply(
        {"batch_stats": ref_bs}, layers, batches[0][1], use_running_average=True
    )
    penalty = penalties.istar_penalty(layers, batches[0][1], c0=c0_pass, zeta=zeta)
    np.testing.assert_allclose(1 - score, penalty, rtol=1e-6, atol=1e-7)


def test_no_retrace_across_window_closes():
    model = linen_istar.IsoScoreStar(window=2, window_unit="steps")
    x, mask = _batch(50)
    bs = _init(model, x.astype(np.float32), mask)["batch_stats"]

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(batch_stats, h, m):
        _, updates = model.apply(
            {"batch_stats": batch_stats}, h, m, use_running_average=False, mutable=["batch_stats"]
        )
        return updates["batch_stats"]

    for _ in range(5):
        bs = step(bs, jnp.asarray(x, jnp.float32), mask)
    assert int(bs["windows_closed"]) == 2


@pytest.mark.parametrize("mode", ["epoch", "ema"])
def test_sharded_jit_and_shard_map_match_one_device(mode):
    devices = np.array(jax.devices()[:4])
    assert len(devices) == 4
    kwargs = dict(stabilizer=mode, zeta=0.3, window=2, window_unit="steps", momentum=0.7)
    model = linen_istar.IsoScoreStar(**kwargs)
    batches = [_batch(60 + s) for s in range(3)]
    bs0 = _init(model, batches[0][0].astype(np.float32), batches[0][1])["batch_stats"]

    # One device.
    step = _train_step(model)
    bs, scores = bs0, []
    for x, mask in batches:
        score, bs = step({"batch_stats": bs}, jnp.asarray(x, jnp.float32), mask)
        scores.append(score)

    mesh = Mesh(devices, ("data",))
    x_sharding = NamedSharding(mesh, P(None, "data"))  # [L, batch, len, d]: batch sharded
    mask_sharding = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    # jit over a sharded batch: XLA makes the moments global, no axis name.
    sharded_step = jax.jit(step, out_shardings=(replicated, replicated))
    bs_jit, scores_jit = jax.device_put(bs0, replicated), []
    for x, mask in batches:
        xs = jax.device_put(jnp.asarray(x, jnp.float32), x_sharding)
        score, bs_jit = sharded_step(
            {"batch_stats": bs_jit}, xs, jax.device_put(mask, mask_sharding)
        )
        scores_jit.append(score)
    assert len(xs.sharding.device_set) == 4

    # shard_map: every device sees a quarter of the batch and reduces over axis_name.
    mapped_model = linen_istar.IsoScoreStar(axis_name="data", **kwargs)

    @jax.jit
    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), P(None, "data"), P("data")),
        out_specs=(P(), P()),
    )
    def mapped_step(batch_stats, h, m):
        score, updates = mapped_model.apply(
            {"batch_stats": batch_stats}, h, m, use_running_average=False, mutable=["batch_stats"]
        )
        return score, updates["batch_stats"]

    bs_map, scores_map = bs0, []
    for x, mask in batches:
        score, bs_map = mapped_step(bs_map, jnp.asarray(x, jnp.float32), jnp.asarray(mask))
        scores_map.append(score)

    for other_bs, other_scores in [(bs_jit, scores_jit), (bs_map, scores_map)]:
        np.testing.assert_allclose(other_scores, scores, rtol=1e-6)
        chex.assert_trees_all_close(other_bs, bs, rtol=1e-5, atol=1e-5)
    assert mode != "epoch" or int(bs_map["windows_closed"]) == 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_input_gives_float32_statistics_without_overflow(dtype):
    # float16 values ~300: squares (9e4) overflow float16, so statistics must be float32.
    x, mask = _batch(70, scale=60.0, shift=5.0)
    assert np.abs(x).max() > 250
    xh = jnp.asarray(x, dtype)
    for mode in ("epoch", "ema"):
        # A one-step window, or the debiased EMA (the default): C0 = cov(first batch).
        model = linen_istar.IsoScoreStar(stabilizer=mode, window=1, window_unit="steps")
        bs = _init(model, xh, mask)["batch_stats"]
        score, bs = _train_step(model)({"batch_stats": bs}, xh, mask)
        assert score.dtype == jnp.float32
        assert all(v.dtype in (jnp.float32, jnp.int32) for v in jax.tree.leaves(bs))
        assert int(bs["skipped"]) == 0
        ref = np.cov(_tokens(np.asarray(xh, np.float64), mask), rowvar=False)
        assert np.abs(ref).max() > 65504  # the covariance itself would overflow float16
        np.testing.assert_allclose(bs["c0"], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        ref_score = _np_score(ref, np.eye(D), 0.2)
        np.testing.assert_allclose(score, ref_score, rtol=1e-4)


def test_collection_survives_checkpoint_round_trip(tmp_path):
    model = linen_istar.IsoScoreStar(window=3, window_unit="steps")
    x, mask = _batch(80)
    bs = _init(model, x.astype(np.float32), mask)["batch_stats"]
    step = _train_step(model)
    for s in range(4):  # one window closed, one open: every field non-trivial
        _, bs = step({"batch_stats": bs}, jnp.asarray(_batch(80 + s)[0], jnp.float32), mask)
    state = {
        "step": jnp.asarray(4, jnp.int32),
        "params": {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3)}},
        "opt_state": (jnp.zeros(3), {"mu": jnp.ones(3)}),
        "istar_stats": bs,
    }
    checkpointer = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    checkpointer.save(path, state)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = checkpointer.restore(path, abstract)
    checkpointer.close()
    chex.assert_trees_all_equal(restored, state)
    chex.assert_trees_all_equal_dtypes(restored, state)
    assert int(restored["istar_stats"]["windows_closed"]) == 1
    # Training resumes from the restored state exactly as from the original.
    nxt = jnp.asarray(_batch(90)[0], jnp.float32)
    chex.assert_trees_all_equal(
        step({"batch_stats": restored["istar_stats"]}, nxt, mask),
        step({"batch_stats": bs}, nxt, mask),
    )


def test_bad_configuration_raises():
    x, mask = _batch(0)
    for kwargs, match in [
        (dict(stabilizer="swa"), "unknown stabilizer"),
        (dict(zeta=1.5), "zeta"),
        (dict(window_unit="epochs"), "window_unit"),
        (dict(window=0), "window"),
        (dict(stabilizer="ema", momentum=1.0), "momentum"),
        (dict(stabilizer="ema", momentum=0.0), r"momentum 0.0 not in \(0, 1\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            _init(linen_istar.IsoScoreStar(**kwargs), x.astype(np.float32), mask)
    with pytest.raises(ValueError, match="no field"):
        linen_istar.make_isoscore_star("ema", moment=0.9)
    with pytest.raises(ValueError, match="unknown stabilizer"):
        linen_istar.make_isoscore_star("swa")
    model = linen_istar.IsoScoreStar()
    bs = _init(model, x.astype(np.float32), mask)["batch_stats"]
    with pytest.raises(ValueError, match=r"feature size 4\).*\(4, 4\)"):
        model.apply({"batch_stats": bs}, jnp.ones((3, 5, 4)), use_running_average=True)
