"""Isotropy scores and penalties under `jax.shard_map` over 4 simulated CPU devices
(tests/conftest.py): with `axis_name` the value and the gradient are those of the global batch
on one device; without it each device scores only its own slice (the check can fail)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from isojax.core import isotropy, penalties

DEVICES = 4
LAYERS, BATCH, LEN, D = 2, 8, 3, 8  # 2 examples x 3 tokens per device: fewer points than d


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < DEVICES:
        pytest.fail(
            f"need {DEVICES} devices (tests/conftest.py sets XLA_FLAGS); got {jax.devices()}"
        )
    return jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("data",))


@pytest.fixture(scope="module")
def data():
    """Anisotropic hidden states `[L, batch, len, d]` whose slices differ, a ragged mask, C0."""
    rng = np.random.default_rng(0)
    scale = np.geomspace(3.0, 0.2, D)
    hidden = rng.normal(size=(LAYERS, BATCH, LEN, D)) * scale + rng.normal(size=(BATCH, 1, D))
    mask = (np.arange(LEN)[None] < rng.integers(1, LEN + 1, size=BATCH)[:, None]).astype(np.int32)
    mask[0] = 1
    a = rng.normal(size=(D, D))
    return (
        jnp.asarray(hidden, jnp.float32),
        jnp.asarray(mask),
        jnp.asarray(a @ a.T / D, jnp.float32),
    )


# Each case: (x, mask) -> scalar; `x` is sharded over the batch axis given by `spec`.
CASES = {
    "isoscore": (
        lambda x, m, c0, axis_name: isotropy.isoscore(x[0], m, axis_name=axis_name),
        P(None, "data"),
    ),
    "isoscore_star": (
        lambda x, m, c0, axis_name: isotropy.isoscore_star(
            x, c0=c0, zeta=0.3, mask=jnp.broadcast_to(m, x.shape[:-1]), axis_name=axis_name
        ),
        P(None, "data"),
    ),
    "istar_penalty": (
        lambda x, m, c0, axis_name: penalties.istar_penalty(
            x, m, c0=c0, zeta=0.2, axis_name=axis_name
        ),
        P(None, "data"),
    ),
    "cosreg_penalty": (
        lambda x, m, c0, axis_name: penalties.cosreg_penalty(x[-1], m, axis_name=axis_name),
        P(None, "data"),
    ),
}


def value_and_grad_on(mesh, fn, spec, axis_name):
    """`(value, grad)` of `fn` under shard_map; the value of device 0, the gradient gathered."""

    def local(x, m, c0):
        return jax.value_and_grad(fn)(x, m, c0, axis_name)

    # Without axis_name each device returns its own value: gather them along a new axis.
    mapped = jax.shard_map(
        lambda x, m, c0: (lambda v, g: (v[None], g))(*local(x, m, c0)),
        mesh=mesh,
        in_specs=(spec, P("data"), P()),
        out_specs=(P("data"), spec),
    )
    return jax.jit(mapped)


@pytest.mark.parametrize("name", list(CASES))
def test_shard_map_with_axis_name_equals_one_device(mesh, data, name):
    hidden, mask, c0 = data
    fn, spec = CASES[name]
    want, want_grad = jax.jit(jax.value_and_grad(functools.partial(fn, axis_name=None)))(
        hidden, mask, c0
    )
    assert np.all(np.isfinite(want_grad)) and float(jnp.abs(want_grad).max()) > 0

    values, grad = value_and_grad_on(mesh, fn, spec, "data")(hidden, mask, c0)
    np.testing.assert_allclose(values, np.full(DEVICES, want), rtol=1e-6, atol=1e-7)
    scale = float(jnp.abs(want_grad).max())
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-6 * scale)

    # Without axis_name every device scores its own slice: the test above can fail.
    per_shard, per_shard_grad = value_and_grad_on(mesh, fn, spec, None)(hidden, mask, c0)
    assert np.max(np.abs(np.asarray(per_shard) - float(want))) > 1e-3
    assert float(jnp.abs(per_shard_grad - want_grad).max()) > 1e-3 * scale
