"""Tests for isojax.linen.norms: IsoBN against a float64 NumPy transcription of SPEC.md §1, the
other
normalisers against Flax, gradient semantics, mixed precision, bad batches and composition with
nn.scan, nn.remat, jax.vmap and jax.grad."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax.core import normalizers
from isojax.linen import norms

D = 8


def correlated_batches(num, batch, d=D, seed=0):
    """Anisotropic, correlated batches with a non-zero mean: `z @ A + mu`, float64."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.geomspace(4.0, 0.1, d)[:, None]
    mean = rng.normal(size=d) * 3.0
    return [rng.normal(size=(batch, d)) @ mixing + mean for _ in range(num)]


class ReferenceIsoBN:
    """Float64 NumPy transcription of the reference IsoBN (SPEC.md §1), zero-initialised."""

    def __init__(self, d, rate=0.05, eps=1e-3, beta=0.5):
        self.cov, self.std = np.zeros((d, d)), np.zeros(d)
        self.rate, self.eps, self.beta = rate, eps, beta

    def gain(self, cov, std):
        corr = np.clip(cov / np.outer(std, std), -1, 1)
        gamma = np.mean(corr**2, axis=1)
        scale = 1.0 / (gamma * std + self.eps) ** self.beta
        total = np.trace(cov)
        new_total = np.sum(np.diag(cov) * scale**2)
        return scale * np.sqrt(total / (new_total + self.eps))

    def __call__(self, x, training, debias_step=None):
        if training:
            y = x - x.mean(0)
            cov = y.T @ y / len(x)
            std = np.sqrt(np.mean(y**2, axis=0))
            self.cov += self.rate * (cov - self.cov)
            self.std += self.rate * (std - self.std)
        cov, std = self.cov, self.std
        if debias_step is not None:
            correction = 1 - (1 - self.rate) ** debias_step
            cov, std = cov / correction, std / correction
        return x * self.gain(cov, std)


def train_and_eval_fns(model):
    train = jax.jit(
        functools.partial(model.apply, use_running_average=False, mutable=["batch_stats"])
    )
    evaluate = jax.jit(functools.partial(model.apply, use_running_average=True))
    return train, evaluate


@pytest.mark.parametrize("debias", [False, True])
def test_isobn_matches_reference_over_20_batches(debias):
    batches = correlated_batches(21, 32)
    ref = ReferenceIsoBN(D)
    model = norms.IsoBN(momentum=0.95, debias=debias)
    variables = model.init(jax.random.key(0), jnp.zeros((2, D)), use_running_average=True)
    train, evaluate = train_and_eval_fns(model)
    for step, x in enumerate(batches[:20], start=1):
        expected = ref(x, training=True, debias_step=step if debias else None)
        y, updates = train(variables, jnp.asarray(x, jnp.float32))
        variables = {**variables, **updates}
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    running = variables["batch_stats"]
    scale = np.abs(ref.cov).max()
    np.testing.assert_allclose(running["cov"], ref.cov, rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(running["std"], ref.std, rtol=1e-5)
    assert int(running["count"]) == 20 and int(running["skipped"]) == 0
    # Evaluation: frozen statistics, the gain still applied.
    x_eval = batches[20]
    expected = ref(x_eval, training=False, debias_step=20 if debias else None)
    y = evaluate(variables, jnp.asarray(x_eval, jnp.float32))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert not np.allclose(expected, x_eval, rtol=1e-2)  # the gain really changes the input


def test_isobn_gain_is_one_before_any_update():
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    model = norms.IsoBN()
    variables = model.init(jax.random.key(0), x, use_running_average=False)
    assert int(variables["batch_stats"]["count"]) == 0
    np.testing.assert_array_equal(variables["batch_stats"]["cov"], np.zeros((D, D)))
    y = jax.jit(functools.partial(model.apply, use_running_average=True))(variables, x)
    np.testing.assert_array_equal(y, x)
    # The reference divides 0 by 0 here.
    with np.errstate(invalid="ignore"):
        assert np.isnan(ReferenceIsoBN(D)(np.asarray(x, np.float64), training=False)).all()


def test_isobn_gain_pure_function_handles_dead_dimension():
    cov = np.diag([4.0, 1.0, 0.0])
    gain = normalizers.isobn_gain(jnp.asarray(cov), jnp.asarray([2.0, 1.0, 0.0]))
    assert gain.dtype == jnp.float32 and np.isfinite(gain).all()
    # rho = I on the live dims: gamma_i = 1/3, g_i = (s_i / 3 + eps)^-1/2, c keeps tr(S).
    g = (np.array([2.0, 1.0, 0.0]) / 3 * np.array([1, 1, 0]) + 1e-3) ** -0.5
    c = np.sqrt(5.0 / (4 * g[0] ** 2 + g[1] ** 2 + 1e-3))
    np.testing.assert_allclose(gain, c * g, rtol=1e-6)


def test_isobn_jacobian_is_the_diagonal_gain():
    x = jnp.asarray(correlated_batches(2, 6, d=4)[1], jnp.float32)
    model = norms.IsoBN()
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    _, updates = model.apply(
        variables, x * 2.0 + 1.0, use_running_average=False, mutable=["batch_stats"]
    )
    variables = {**variables, **updates}

    def forward(x):  # training mode: the statistics are updated from x itself
        y, new = model.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
        return y, new["batch_stats"]

    jac = jax.jit(jax.jacrev(lambda x: forward(x)[0]))(x)  # [6, 4, 6, 4]
    stats_after = forward(x)[1]
    gain = normalizers.isobn_gain(stats_after["cov"], stats_after["std"])
    expected = np.einsum("ij,ab,b->iajb", np.eye(6), np.eye(4), gain)
    np.testing.assert_allclose(jac, expected, rtol=1e-6, atol=0)
    assert not np.allclose(gain, 1.0)


@pytest.mark.parametrize("name", norms.NORMALIZERS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_gives_float32_stats_and_finite_outputs(name, dtype):
    rng = np.random.default_rng(1)
    # float16 values near 300: their squares (9e4) overflow float16's 65504.
    x64 = 300.0 + 20.0 * rng.normal(size=(32, D)) * np.linspace(0.5, 2.0, D)
    x = jnp.asarray(x64, dtype)
    model = norms.make_normalizer(name)
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    train, evaluate = train_and_eval_fns(model)
    y, updates = train(variables, x)
    y_eval = evaluate({**variables, **updates}, x)
    for out in (y, y_eval):
        assert out.dtype == dtype and out.shape == x.shape
        assert np.isfinite(np.asarray(out, np.float32)).all()
    for leaf in jax.tree.leaves(updates.get("batch_stats", {})):
        assert leaf.dtype in (jnp.float32, jnp.int32)
    if name == "isobn":
        exact = np.asarray(x, np.float64)  # the values the module actually saw
        centred = exact - exact.mean(0)
        batch_cov = centred.T @ centred / len(exact)
        np.testing.assert_allclose(updates["batch_stats"]["cov"], 0.05 * batch_cov, rtol=1e-5)


@pytest.mark.parametrize("name", ["isobn", "batchnorm", "recenter", "whiten", "iternorm"])
def test_bad_batch_leaves_running_stats_and_is_reported(name):
    x = jnp.asarray(correlated_batches(2, 8)[0], jnp.float32)
    model = norms.make_normalizer(name)
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    step = jax.jit(
        functools.partial(
            model.apply, use_running_average=False, mutable=["batch_stats", "intermediates"]
        )
    )
    ones = jnp.ones(len(x))
    _, updates = step(variables, x, mask=ones)
    variables = {**variables, "batch_stats": updates["batch_stats"]}
    before = variables["batch_stats"]
    bad_batches = {
        "nan": (x.at[3, 2].set(jnp.nan), ones),
        "inf": (x.at[0, 0].set(-jnp.inf), ones),
        "all rows masked": (x, jnp.zeros(len(x))),
        "one unmasked row": (x, ones.at[1:].set(0.0)),
    }
    if name == "recenter":  # one point is a valid mean: it is used
        x_one, mask_one = bad_batches.pop("one unmasked row")
        _, updates = step(variables, x_one, mask=mask_one)
        assert int(updates["batch_stats"]["count"]) == 2
    for what, (x_bad, mask) in bad_batches.items():
        _, updates = step(variables, x_bad, mask=mask)
        after = updates["batch_stats"]
        for key in before:
            if key not in ("count", "skipped"):
                np.testing.assert_array_equal(after[key], before[key], err_msg=what)
        assert int(after["count"]) == 1 and int(after["skipped"]) == 1, what
        assert bool(updates["intermediates"]["skipped_batch"][0]), what
    # A batch of one row (no mask) outside jit's cache: same guard, no crash.
    if name != "recenter":
        _, updates = step(variables, x[:1])
        assert int(updates["batch_stats"]["skipped"]) == 1
    # A good batch afterwards is used again and reported as not skipped.
    _, updates = step(variables, x, mask=ones)
    assert int(updates["batch_stats"]["count"]) == 2
    assert not bool(updates["intermediates"]["skipped_batch"][0])


def test_isobn_mask_leaves_padding_rows_out():
    x = jnp.asarray(correlated_batches(1, 12)[0], jnp.float32)
    padded = jnp.concatenate([x, jnp.full((4, D), 7.0)])
    mask = jnp.concatenate([jnp.ones(12), jnp.zeros(4)])
    model = norms.IsoBN()
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    train, _ = train_and_eval_fns(model)
    y_ref, ref = train(variables, x)
    y, got = train(variables, padded, mask=mask)
    chex.assert_trees_all_close(got, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(y[:12], y_ref, rtol=1e-6)


def test_feature_size_mismatch_is_a_trace_time_error():
    model = norms.IsoBN()
    variables = model.init(jax.random.key(0), jnp.ones((4, D)), use_running_average=True)
    with pytest.raises(ValueError, match=r"\(3, 5\).*feature size 5.*\(5, 5\).*\(8, 8\)"):
        jax.jit(functools.partial(model.apply, use_running_average=True))(
            variables, jnp.ones((3, 5))
        )
    bn = norms.make_normalizer("recenter")
    variables = bn.init(jax.random.key(0), jnp.ones((4, D)), use_running_average=True)
    with pytest.raises(ValueError, match=r"\(5,\).*\(8,\)"):
        bn.apply(variables, jnp.ones((3, 5)), use_running_average=True)


def test_make_normalizer_rejects_unknown_names_and_hparams():
    with pytest.raises(ValueError, match="unknown normalizer 'zca'.*isobn, whiten"):
        norms.make_normalizer("zca")
    with pytest.raises(ValueError, match=r"'layernorm' has no hyper-parameter\(s\) \['momentum'\]"):
        norms.make_normalizer("layernorm", momentum=0.9)
    model = norms.make_normalizer("isobn", axis_name="data", momentum=0.9, beta=0.7)
    assert (model.axis_name, model.momentum, model.beta) == ("data", 0.9, 0.7)


@pytest.mark.parametrize("name", norms.NORMALIZERS)
def test_every_normalizer_shares_the_interface(name):
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    model = norms.make_normalizer(name)
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    train, evaluate = train_and_eval_fns(model)
    y, updates = train(variables, x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert set(updates) == ({"batch_stats"} if "batch_stats" in variables else set())
    assert evaluate(variables, x).shape == x.shape


def test_recenter_uses_batch_mean_in_training_and_running_mean_in_eval():
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    model = norms.make_normalizer("recenter", momentum=0.9)
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    train, evaluate = train_and_eval_fns(model)
    y, updates = train(variables, x)
    batch_mean = np.asarray(x, np.float64).mean(0)
    np.testing.assert_allclose(y, x - batch_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(updates["batch_stats"]["mean"], 0.1 * batch_mean, rtol=1e-5)
    y_eval = evaluate({**variables, **updates}, x)
    np.testing.assert_allclose(y_eval, x - 0.1 * batch_mean, rtol=1e-5, atol=1e-5)


def test_batchnorm_matches_flax_batchnorm():
    batches = [jnp.asarray(b, jnp.float32) for b in correlated_batches(4, 16)]
    ours = norms.make_normalizer("batchnorm", momentum=0.9)
    flax_bn = nn.BatchNorm(momentum=0.9, use_fast_variance=False)
    variables = ours.init(jax.random.key(0), batches[0], use_running_average=True)
    flax_vars = flax_bn.init(jax.random.key(0), batches[0], use_running_average=True)
    assert jax.tree.structure(flax_vars["params"]) == jax.tree.structure(variables["params"])
    params = {"scale": jnp.linspace(0.5, 2.0, D), "bias": jnp.linspace(-1.0, 1.0, D)}
    variables, flax_vars = {**variables, "params": params}, {**flax_vars, "params": params}
    for x in batches[:3]:
        y, upd = ours.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
        y_ref, upd_ref = flax_bn.apply(
            flax_vars, x, use_running_average=False, mutable=["batch_stats"]
        )
        variables, flax_vars = {**variables, **upd}, {**flax_vars, **upd_ref}
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    for key in ("mean", "var"):
        np.testing.assert_allclose(
            variables["batch_stats"][key], flax_vars["batch_stats"][key], rtol=1e-5
        )
    np.testing.assert_allclose(
        ours.apply(variables, batches[3], use_running_average=True),
        flax_bn.apply(flax_vars, batches[3], use_running_average=True),
        rtol=1e-5,
        atol=1e-5,
    )


def test_layernorm_matches_flax_layernorm():
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    ours = norms.make_normalizer("layernorm")
    variables = ours.init(jax.random.key(0), x, use_running_average=False)
    params = {"scale": jnp.linspace(0.5, 2.0, D), "bias": jnp.linspace(-1.0, 1.0, D)}
    y = ours.apply({"params": params}, x, use_running_average=False)
    y_ref = nn.LayerNorm().apply({"params": params}, x)
    assert jax.tree.structure(variables) == jax.tree.structure({"params": params})
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_jitted_step_traces_once():
    model = norms.IsoBN()
    batches = [jnp.asarray(b, jnp.float32) for b in correlated_batches(3, 8)]
    variables = model.init(jax.random.key(0), batches[0], use_running_average=True)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(variables, x):
        return model.apply(variables, x, use_running_average=False, mutable=["batch_stats"])

    for x in batches:
        _, updates = step(variables, x)
        variables = {**variables, **updates}
    assert int(variables["batch_stats"]["count"]) == 3


# Composition: nn.scan, nn.remat, jax.vmap over an ensemble, jax.grad.


class Block(nn.Module):
    """Dense -> tanh -> IsoBN, the unit of the composition tests."""

    train: bool

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(x.shape[-1])(x))
        return norms.IsoBN(use_running_average=not self.train)(h)


class ScannedBlocks(nn.Module):
    train: bool
    length: int = 3

    @nn.compact
    def __call__(self, x):
        def body(block, carry, _):
            return block(carry), None

        scanned = nn.scan(
            body,
            variable_axes={"params": 0, "batch_stats": 0},
            split_rngs={"params": True},
            length=self.length,
        )
        x, _ = scanned(Block(self.train), x, None)
        return x


def test_isobn_inside_nn_scan_matches_unrolled_layers():
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    model = ScannedBlocks(train=True)
    variables = model.init(jax.random.key(0), x)
    assert variables["batch_stats"]["Block_0"]["IsoBN_0"]["cov"].shape == (3, D, D)
    for _ in range(2):  # two training steps, so the gain is not 1
        y, updates = jax.jit(functools.partial(model.apply, mutable=["batch_stats"]))(variables, x)
        variables = {**variables, **updates}
    # Unrolled: apply layer i's slice of params and (pre-step) stats by hand, twice.
    single = Block(train=True)
    single_step = jax.jit(functools.partial(single.apply, mutable=["batch_stats"]))
    layer_vars = [jax.tree.map(lambda v, i=i: v[i], variables) for i in range(3)]
    start = model.init(jax.random.key(0), x)["batch_stats"]
    stats = [jax.tree.map(lambda v, i=i: v[i], start) for i in range(3)]
    for _ in range(2):
        h = x
        for i in range(3):
            block_vars = {
                "params": layer_vars[i]["params"]["Block_0"],
                "batch_stats": stats[i]["Block_0"],
            }
            h, upd = single_step(block_vars, h)
            stats[i] = {"Block_0": upd["batch_stats"]}
    np.testing.assert_allclose(y, h, rtol=1e-4, atol=1e-5)  # eager vs jit, 3 layers x 2 steps
    for i in range(3):
        np.testing.assert_allclose(
            variables["batch_stats"]["Block_0"]["IsoBN_0"]["cov"][i],
            stats[i]["Block_0"]["IsoBN_0"]["cov"],
            rtol=1e-5,
            atol=1e-7,
        )


def test_isobn_inside_nn_remat_has_the_same_values_and_gradients():
    x = jnp.asarray(correlated_batches(1, 16)[0], jnp.float32)
    plain, remat = Block(train=True), nn.remat(Block)(train=True)
    variables = plain.init(jax.random.key(0), x)
    assert jax.tree.structure(remat.init(jax.random.key(0), x)) == jax.tree.structure(variables)

    def loss(params, model):
        y, updates = model.apply({**variables, "params": params}, x, mutable=["batch_stats"])
        return jnp.sum(y**2), updates

    (l1, u1), g1 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        variables["params"], plain
    )
    (l2, u2), g2 = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(
        variables["params"], remat
    )
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    chex.assert_trees_all_close(u1, u2, rtol=1e-6)
    chex.assert_trees_all_close(g1, g2, rtol=1e-5, atol=1e-7)
    assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(g1))


def test_isobn_under_vmap_over_an_ensemble_axis():
    members = 3
    xs = jnp.asarray(np.stack(correlated_batches(members, 16)), jnp.float32)  # [E, b, d]
    model = Block(train=True)
    keys = jax.random.split(jax.random.key(0), members)
    variables = jax.vmap(model.init)(keys, xs)
    step = jax.jit(jax.vmap(functools.partial(model.apply, mutable=["batch_stats"])))
    ys, updates = step(variables, xs)
    single = jax.jit(functools.partial(model.apply, mutable=["batch_stats"]))
    for e in range(members):
        member = jax.tree.map(lambda v, e=e: v[e], variables)
        y, upd = single(member, xs[e])
        np.testing.assert_allclose(ys[e], y, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(
            jax.tree.map(lambda v, e=e: v[e], updates), upd, rtol=1e-5, atol=1e-7
        )


@pytest.mark.parametrize("beta, epsilon", [(0.25, 1e-3), (1.0, 1e-3), (0.5, 1e-5), (1.0, 1e-5)])
def test_isobn_non_default_beta_and_epsilon_match_reference(beta, epsilon):
    """β and ε reach the gain as SPEC.md §1 writes them: `(γ σ + ε)^-β` and the trace
    rescaling's `+ ε`, over 10 training batches and an evaluation batch. The batches are
    small (std ~ 1e-3 to 0.1), so that ε weighs in both places."""
    batches = [x * 0.01 for x in correlated_batches(11, 32, seed=3)]
    ref = ReferenceIsoBN(D, eps=epsilon, beta=beta)
    default = ReferenceIsoBN(D)
    model = norms.IsoBN(momentum=0.95, beta=beta, epsilon=epsilon)
    variables = model.init(jax.random.key(0), jnp.zeros((2, D)), use_running_average=True)
    train, evaluate = train_and_eval_fns(model)
    for x in batches[:10]:
        expected = ref(x, training=True)
        default(x, training=True)
        y, updates = train(variables, jnp.asarray(x, jnp.float32))
        variables = {**variables, **updates}
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    x_eval = batches[10]
    expected = ref(x_eval, training=False)
    y = evaluate(variables, jnp.asarray(x_eval, jnp.float32))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # The setting matters: the default β = 0.5, ε = 1e-3 gives another output.
    assert not np.allclose(expected, default(x_eval, training=False), rtol=1e-4, atol=0)
