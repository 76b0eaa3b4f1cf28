"""isojax.nnx's normalisers against their linen twins (issue 23): parity of outputs, running
statistics and gradients under nnx.jit, tree mode, nnx.remat and nnx.view, a broken twin caught,
one hyper-parameter table, and the linen modules equal to the pure steps they call."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nnx_parity import VARIANTS, Twins, failures, linen_run

from isojax import nnx as inx
from isojax.core import normalizers, whitening
from isojax.linen import norms

D, B = 5, 8


def batches(seed=0):
    """4 anisotropic batches `[B, D]` with masks; the second keeps one row (a bad batch for
    IsoBN and batch norm, which need 2), the last is for evaluation."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(D, D)) * np.geomspace(3.0, 0.2, D)[:, None]
    out = []
    for i in range(4):
        x = jnp.asarray(rng.normal(size=(B, D)) @ mixing + 1.5, jnp.float32)
        mask = np.ones(B, np.float32)
        mask[-2:] = 0.0
        if i == 1:
            mask[1:] = 0.0
        out.append((x, jnp.asarray(mask)))
    return out


def weights(name):
    """Random `scale`/`bias` for the normalisers that have them (the same in both twins)."""
    if name not in ("batchnorm", "layernorm"):
        return {}
    rng = np.random.default_rng(1)
    return {k: jnp.asarray(rng.normal(size=D) + 1.0, jnp.float32) for k in ("scale", "bias")}


def linen_result(name, **hparams):
    model = norms.make_normalizer(name, **hparams)
    data = batches()
    variables = model.init(jax.random.key(0), data[0][0], use_running_average=True)
    variables = {**variables, **({"params": weights(name)} if weights(name) else {})}

    def apply(variables, x, mask, train):
        y, updates = model.apply(variables, x, not train, mask=mask, mutable=["batch_stats"])
        return y, updates.get("batch_stats", {})

    return linen_run(apply, variables, data)


def nnx_model(name, **hparams):
    model = inx.make_normalizer(name, D, rngs=nnx.Rngs(0), **hparams)
    for key, value in weights(name).items():
        getattr(model, key).set_value(value)
    return model


def call(model, x, mask):
    return model(x, mask=mask)


TWINS = Twins(linen_result, nnx_model, call, batches)


# Every normaliser under graph-mode nnx.jit; the transforms and views (one mechanism,
# `RunningModule`) on IsoBN, and tree mode on batch norm too (parameter gradients there).
CASES = [(name, "jit") for name in norms.NORMALIZERS]
CASES += [("isobn", variant) for variant in VARIANTS[1:]] + [("batchnorm", "tree")]


@pytest.mark.parametrize("name, variant", CASES)
def test_nnx_normalizer_matches_its_linen_twin(name, variant):
    assert failures(TWINS.linen(name), TWINS.nnx(name, variant)) == {}


# A twin broken on purpose: each parity check must report it.
BROKEN = {
    "isobn": {"momentum": 0.9},
    "batchnorm": {"momentum": 0.9},
    "recenter": {"momentum": 0.9},
    "layernorm": {"epsilon": 1e-2},
    "none": {"dtype": jnp.bfloat16},
    "whiten": {"momentum": 0.9},
    "iternorm": {"momentum": 0.2},
}


@pytest.mark.parametrize("name", norms.NORMALIZERS)
def test_parity_check_reports_a_broken_twin(name):
    assert failures(linen_result(name, **BROKEN[name]), TWINS.nnx(name))


def test_isobn_skips_the_one_row_batch_and_counts_it():
    model = nnx_model("isobn")
    model.train()
    step = nnx.jit(call)
    for x, mask in batches()[:3]:
        step(model, x, mask)
    assert (int(model.count[...]), int(model.skipped[...])) == (2, 1)


def test_one_hyper_parameter_table_for_both_front_ends():
    for name in norms.NORMALIZERS:
        takes = set(normalizers.HPARAMS[name]) | set(normalizers.STRUCTURAL[name])
        linen_fields = norms._fields(norms.CLASSES[name]) - {"name"}
        signature = inspect.signature(inx.CLASSES[name].__init__).parameters
        nnx_args = set(signature) - {"self", "num_features", "rngs"}
        assert linen_fields == takes == nnx_args, name
        for arg, default in normalizers.HPARAMS[name].items():
            assert getattr(norms.CLASSES[name], arg) == default
            assert signature[arg].default == default
    for bad, match in [
        ({"momentum": 1.0}, r"momentum 1.0 not in \(0, 1\)"),
        ({"gamma": 1.0}, r"'isobn' has no hyper-parameter\(s\) \['gamma'\]"),
        ({"name": "x"}, r"no hyper-parameter\(s\) \['name'\]"),
    ]:
        with pytest.raises(ValueError, match=match):
            inx.make_normalizer("isobn", D, **bad)
    with pytest.raises(ValueError, match="unknown normalizer 'zca'"):
        inx.make_normalizer("zca", D)


def test_mode_comes_from_the_call_the_attribute_or_a_view():
    x, mask = batches()[0]
    model = inx.IsoBN(D)
    with pytest.raises(ValueError, match=r"IsoBN: no use_running_average.*nnx.view"):
        model(x)

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(D, D, rngs=rngs)
            self.norm = inx.make_normalizer("recenter", D)
            self.ln = inx.make_normalizer("layernorm", D, rngs=rngs)

        def __call__(self, x):
            return self.ln(self.norm(self.dense(x)))

    head = Head(nnx.Rngs(0))
    nnx.view(head, use_running_average=True)(x)
    assert int(head.norm.count[...]) == 0
    nnx.view(head, use_running_average=False)(x)
    assert int(head.norm.count[...]) == 1
    head.eval()
    head(x)
    assert int(head.norm.count[...]) == 1
    head.train()
    head(x)
    assert int(head.norm.count[...]) == 2
    assert model.cov.get_value().dtype == jnp.float32
    with pytest.raises(ValueError, match=r"feature size 3\).*\(3, 3\).*\(5, 5\)"):
        model(jnp.ones((4, 3)), use_running_average=False)


def test_half_precision_keeps_float32_statistics():
    x, mask = batches()[0]
    model = inx.make_normalizer("batchnorm", D, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    y = model(x.astype(jnp.bfloat16), use_running_average=False, mask=mask)
    assert y.dtype == jnp.bfloat16 and model.scale.get_value().dtype == jnp.bfloat16
    assert model.mean.get_value().dtype == model.var.get_value().dtype == jnp.float32


@pytest.mark.parametrize("name", ["isobn", "recenter", "batchnorm", "whiten"])
def test_linen_module_is_exactly_its_pure_step(name):
    """The linen module computes nothing but the pure step that the NNX module runs."""
    x, mask = batches()[0]
    model = norms.make_normalizer(name)
    variables = model.init(jax.random.key(0), x, use_running_average=True)
    state = dict(variables["batch_stats"])
    y, updates = model.apply(variables, x, False, mask=mask, mutable=["batch_stats"])
    step = {
        "isobn": normalizers.isobn,
        "recenter": normalizers.recenter,
        "batchnorm": normalizers.batch_norm,
        "whiten": whitening.whiten,
    }
    hparams = {k: getattr(model, k) for k in normalizers.HPARAMS[name] if not k.endswith("_init")}
    for k in ("use_bias", "use_scale"):
        hparams.pop(k, None)
    extra = {"params": dict(variables["params"])} if "params" in variables else {}
    want, new, _ = step[name](state, x, mask, train=True, update=True, **hparams, **extra)
    np.testing.assert_array_equal(y, want)
    for key, value in new.items():
        np.testing.assert_array_equal(updates["batch_stats"][key], value)


def test_nnx_isobn_inside_a_scan_over_layers_carries_its_statistics():
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        del key
        return inx.IsoBN(D, use_running_average=False)

    stack = make(jnp.arange(2))

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def forward(layer, x):
        return layer(x)

    x, _ = batches()[0]
    forward(stack, x)
    assert stack.count[...].tolist() == [1, 1] and stack.cov[...].shape == (2, D, D)
