"""Tests for isojax.precision: policy parsing, loss scaling, and skipped float16 overflow steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from isojax import precision


@pytest.mark.parametrize(
    "spec, want",
    [
        ("p=f32,c=bf16,o=f32", ("float32", "bfloat16", "float32")),
        ("params=float32,compute=float16,output=float32", ("float32", "float16", "float32")),
        ("c=bf16", ("float32", "bfloat16", "float32")),
        ("half", ("float16", "float16", "float16")),
        (" P = f32 , C = F16 ", ("float32", "float16", "float32")),
    ],
)
def test_get_policy_parses(spec, want):
    policy = precision.get_policy(spec)
    got = (policy.param_dtype.name, policy.compute_dtype.name, policy.output_dtype.name)
    assert got == want
    assert precision.get_policy(str(policy)) == policy


@pytest.mark.parametrize(
    "spec, match",
    [
        ("p=f32,c=int8", "unknown dtype 'int8'"),
        ("x=f32", "bad precision policy item"),
        ("", "non-empty string"),
    ],
)
def test_get_policy_rejects(spec, match):
    with pytest.raises(ValueError, match=match):
        precision.get_policy(spec)


def test_policy_casts_only_floating_leaves():
    policy = precision.get_policy("p=f32,c=bf16,o=f32")
    tree = {"w": jnp.ones(3), "ids": jnp.arange(3)}
    out = policy.cast_to_compute(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["ids"].dtype == jnp.int32
    assert policy.needs_loss_scaling is False
    assert precision.get_policy("c=f16").needs_loss_scaling is True


def test_make_loss_scale_auto():
    assert isinstance(
        precision.make_loss_scale(precision.get_policy("c=f16")), precision.DynamicLossScale
    )
    assert isinstance(
        precision.make_loss_scale(precision.get_policy("c=bf16")), precision.NoOpLossScale
    )
    with pytest.raises(ValueError, match="loss_scale must be"):
        precision.make_loss_scale(precision.get_policy("f32"), "static")


def test_dynamic_loss_scale_schedule():
    """Halves on overflow (resetting the counter), doubles after `period` finite steps."""
    ls = precision.DynamicLossScale(jnp.asarray(1024.0), period=3, factor=2.0, min_loss_scale=1.0)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    scales = []
    for finite in [True, True, False, True, True, True, True]:
        ls = adjust(ls, jnp.asarray(finite))
        scales.append(float(ls.loss_scale))
    assert scales == [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0]
    floor = precision.DynamicLossScale(jnp.asarray(1.0), min_loss_scale=1.0)
    assert float(floor.adjust(jnp.asarray(False)).loss_scale) == 1.0


def test_scale_unscale_round_trip_float16():
    ls = precision.DynamicLossScale(jnp.asarray(2.0**15))
    g = {"a": jnp.asarray([1e-3, -2e-4], jnp.float16)}
    scaled = ls.scale(g)
    assert scaled["a"].dtype == jnp.float16
    back = ls.unscale(scaled)
    np.testing.assert_allclose(np.asarray(back["a"], np.float32), [1e-3, -2e-4], rtol=1e-3)


def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(2), "b": (jnp.zeros(3),)}
    bad = {"a": jnp.asarray([1.0, jnp.inf]), "b": (jnp.asarray([jnp.nan, 0.0, 0.0]),)}
    assert bool(precision.all_finite(good)) and not bool(precision.all_finite(bad))
    picked = precision.select_tree(precision.all_finite(bad), bad, good)
    np.testing.assert_array_equal(picked["a"], good["a"])
