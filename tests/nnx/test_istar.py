"""isojax.nnx.IsoScoreStar against the linen IsoScoreStar (issue 23): parity of the score, the
running stabiliser and the gradient for the pass, epoch and ema stabilisers under nnx.jit, tree
mode, nnx.remat and nnx.view; a broken twin caught; C0 installed from the explicit pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_parity import Twins, failures, linen_run

from isojax import nnx as inx
from isojax.core import istar, penalties
from isojax.linen import istar as linen_istar

D = 4
SETTINGS = {
    "pass": {},
    "epoch": {"window": 2, "window_unit": "steps"},
    "ema": {"momentum": 0.9},
}


def batches(seed=0):
    """4 batches of 2 layers `[2, 3, 5, D]` with one `[3, 5]` token mask; the second batch has
    no unmasked token (refused and counted), the last is for evaluation."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(D, D)) * np.geomspace(2.0, 0.3, D)[:, None]
    out = []
    for i in range(4):
        h = jnp.asarray(rng.normal(size=(2, 3, 5, D)) @ mixing, jnp.float32)
        mask = (rng.random((3, 5)) > 0.3).astype(np.float32) * (i != 1)
        out.append((h, jnp.asarray(mask)))
    return out


def linen_result(mode, zeta=0.3, **overrides):
    module = linen_istar.make_isoscore_star(mode, zeta=zeta, **(SETTINGS[mode] | overrides))
    c0 = jnp.eye(D) + 0.1  # a non-trivial pass C0, so the pass mode is checked too
    batch_stats = istar.replace_c0(linen_istar.init_batch_stats(module, D), c0)

    def apply(variables, h, mask, train):
        penalty, new = linen_istar.penalty_and_update(
            module, variables["batch_stats"], h, mask, train=train
        )
        return penalty, new

    return linen_run(apply, {"batch_stats": batch_stats}, batches())


def nnx_model(mode):
    module = inx.make_isoscore_star(D, mode, zeta=0.3, **SETTINGS[mode])
    inx.install_c0(module, jnp.eye(D) + 0.1)
    return module


def call(module, h, mask):
    return inx.penalty_and_update(module, h, mask)  # in the module's mode


TWINS = Twins(linen_result, nnx_model, call, batches)


# Every stabiliser under graph-mode nnx.jit, the windowed one in tree mode and under nnx.remat
# (nnx.view reaches it through `RunningModule.set_view`, tested in tests/nnx/test_norms.py).
CASES = [(mode, "jit") for mode in SETTINGS] + [("epoch", "tree"), ("epoch", "remat")]


@pytest.mark.parametrize("mode, variant", CASES)
def test_nnx_isoscore_star_matches_its_linen_twin(mode, variant):
    result = TWINS.nnx(mode, variant)
    assert failures(TWINS.linen(mode), result) == {}
    if mode != "pass":
        assert (int(result["stats"]["count"]), int(result["stats"]["skipped"])) == (2, 1)


@pytest.mark.parametrize("mode, broken", [("pass", {"zeta": 0.35}), ("ema", {"momentum": 0.8})])
def test_parity_check_reports_a_broken_twin(mode, broken):
    assert failures(linen_result(mode, **broken), TWINS.nnx(mode))


def test_install_c0_from_the_explicit_pass_matches_linen_replace_c0():
    data = batches()
    update = jax.jit(lambda state, batch: penalties.c0_pass_update(state, *batch))
    state = penalties.estimate_c0(update, data, penalties.c0_pass_init(D), num_points=40)
    c0 = penalties.c0_pass_finalize(state)
    module = inx.make_isoscore_star(D, "pass")
    inx.install_c0(module, state)
    np.testing.assert_array_equal(module.c0.get_value(), c0)
    linen = linen_istar.make_isoscore_star("pass")
    batch_stats = istar.replace_c0(linen_istar.init_batch_stats(linen, D), c0)
    h, mask = data[0]
    want, _ = linen_istar.penalty_and_update(linen, batch_stats, h, mask, train=False)
    np.testing.assert_allclose(
        inx.penalty_and_update(module, h, mask, train=False), want, atol=1e-6
    )
    with pytest.raises(ValueError, match=r"c0 has shape \(3, 3\), the state holds \(4, 4\)"):
        inx.install_c0(module, jnp.eye(3))


def test_settings_are_checked_by_the_shared_rules():
    for bad, match in [
        ({"momentum": 1.0}, r"momentum 1.0 not in \(0, 1\)"),
        ({"window_unit": "epochs"}, "window_unit must be one of"),
        ({"name": "x"}, r"IsoScoreStar has no field\(s\) \['name'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            inx.make_isoscore_star(D, "ema", **bad)
    with pytest.raises(ValueError, match="zeta must lie in"):
        inx.make_isoscore_star(D, "epoch", zeta=1.5)
    with pytest.raises(ValueError, match="unknown stabilizer"):
        inx.IsoScoreStar(D, stabilizer="running")
    module = inx.IsoScoreStar(D, stabilizer="ema")
    assert sorted(nnx.to_pure_dict(nnx.state(module, nnx.BatchStat))) == sorted(
        linen_istar.init_batch_stats(linen_istar.make_isoscore_star("ema"), D)
    )
    with pytest.raises(ValueError, match=r"feature size 3\).*\(3, 3\).*\(4, 4\)"):
        module(jnp.ones((5, 3)), use_running_average=True)
    h, mask = batches()[0]
    with pytest.raises(ValueError, match="IsoScoreStar: no use_running_average"):
        module(h, mask)
    nnx.view(module, use_running_average=False)(h, mask)
    module.eval()
    module(h, mask)
    assert int(module.count[...]) == 1


@pytest.mark.parametrize("mode", ["epoch", "ema"])
def test_linen_module_is_exactly_its_pure_step(mode):
    """The linen IsoScoreStar computes nothing but the pure step the NNX module runs."""
    module = linen_istar.make_isoscore_star(mode, zeta=0.3, **SETTINGS[mode])
    batch_stats = linen_istar.init_batch_stats(module, D)
    h, mask = batches()[0]
    score, updates = module.apply(
        {"batch_stats": batch_stats}, h, mask, use_running_average=False, mutable=["batch_stats"]
    )
    x, token_mask = istar.prepare(h, mask)
    settings = istar.checked_settings(module)
    want, new, _ = istar.step(dict(batch_stats), x, token_mask, update=True, zeta=0.3, **settings)
    np.testing.assert_array_equal(score, want)
    for key, value in new.items():
        np.testing.assert_array_equal(updates["batch_stats"][key], value)
