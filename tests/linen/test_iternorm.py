"""Both front ends' `IterNorm` against the float64 transcription of SPEC.md §10.3
(tests/core/test_iternorm.py) over 20 training batches then evaluation: batches smaller than
`d`, masks, bf16 input, groups; linen equals NNX within 1e-6."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from isojax import nnx as inx
from isojax.linen import norms
from tests.core.test_iternorm import transcription

STEPS, RHO = 20, 0.1


def stream(n, d, seed):
    """20 training batches and one evaluation batch `[n, d]`, anisotropic and correlated, with
    masks that drop 1–3 rows (a NaN in one dropped row)."""
    rng = np.random.default_rng(seed)
    mixing = rng.normal(size=(d, d)) * np.geomspace(4.0, 0.2, d)[:, None] / np.sqrt(d)
    out = []
    for step in range(STEPS + 1):
        x = rng.normal(size=(n, d)) @ mixing + rng.normal(size=d)
        mask = np.ones(n, np.float32)
        mask[rng.choice(n, size=1 + step % 3, replace=False)] = 0.0
        x[np.argmin(mask)] = np.nan
        out.append((x, mask))
    return out


def reference(batches, *, group_size):
    """The transcription's train outputs and running state, then the evaluation output."""
    d = batches[0][0].shape[1]
    g = group_size or d
    mean, wmat = np.zeros(d), np.stack([np.eye(g)] * (d // g))
    ys = []
    with torch.no_grad():
        for x, mask in batches[:STEPS]:
            y, mu, blocks = transcription(np.nan_to_num(x), mask, iterations=5, epsilon=1e-5,
                                          group_size=group_size)  # fmt: skip
            ys.append(y.numpy())
            mean = (1 - RHO) * mean + RHO * mu.numpy()
            wmat = (1 - RHO) * wmat + RHO * np.stack([b.numpy() for b in blocks])
    x_eval = np.nan_to_num(batches[STEPS][0])
    y_eval = (x_eval - mean) @ torch.block_diag(*map(torch.as_tensor, wmat)).numpy()
    return ys, {"mean": mean, "wmat": wmat}, y_eval


def linen_run(batches, dtype, **hparams):
    model = norms.make_normalizer("iternorm", dtype=jnp.float32, **hparams)
    cast = [(jnp.asarray(x, dtype), jnp.asarray(m)) for x, m in batches]
    variables = model.init(jax.random.key(0), cast[0][0], use_running_average=True)

    @jax.jit
    def train(variables, x, mask):
        return model.apply(variables, x, False, mask=mask, mutable=["batch_stats"])

    ys = []
    for x, mask in cast[:STEPS]:
        y, updates = train(variables, x, mask)
        variables = {**variables, **updates}
        ys.append(np.asarray(y))
    y_eval = jax.jit(lambda v, x: model.apply(v, x, True))(variables, cast[STEPS][0])
    return ys, dict(variables["batch_stats"]), np.asarray(y_eval)


def nnx_run(batches, dtype, **hparams):
    d = batches[0][0].shape[1]
    model = inx.make_normalizer("iternorm", d, dtype=jnp.float32, **hparams)
    step = nnx.jit(lambda model, x, mask, train: model(x, not train, mask=mask), static_argnums=3)
    ys = []
    for x, mask in batches[:STEPS]:
        ys.append(np.asarray(step(model, jnp.asarray(x, dtype), jnp.asarray(mask), True)))
    y_eval = step(model, jnp.asarray(batches[STEPS][0], dtype), None, False)
    return ys, model.state_values(), np.asarray(y_eval)


def assert_close(got, want, rel, what):
    want = np.asarray(want, np.float64)
    err = np.nanmax(np.abs(np.asarray(got, np.float64) - want))
    assert err <= rel * np.nanmax(np.abs(want)), (what, err, np.nanmax(np.abs(want)))


CASES = [
    (8, 6, None, jnp.float32),
    (8, 16, 4, jnp.bfloat16),
    (64, 32, None, jnp.bfloat16),
    (64, 32, 16, jnp.float32),
    (384, 32, None, jnp.float32),
]


@pytest.mark.parametrize("d, n, group_size, dtype", CASES)
def test_both_front_ends_match_the_float64_transcription(d, n, group_size, dtype):
    batches = stream(n, d, seed=d + n)
    # The module sees the input rounded to `dtype`; the transcription gets the same values.
    seen = [(np.asarray(jnp.asarray(x, dtype), np.float64), m) for x, m in batches]
    ys, state, y_eval = reference(seen, group_size=group_size)
    linen = linen_run(batches, dtype, group_size=group_size)
    twin = nnx_run(batches, dtype, group_size=group_size)
    for name, run in (("linen", linen), ("nnx", twin)):
        for step, (got, want) in enumerate(zip(run[0], ys, strict=True)):
            mask = batches[step][1] > 0  # the NaN row's output is NaN; the rest is compared
            assert_close(got[mask], want[mask], 1e-5, f"{name} train step {step}")
        for key in ("mean", "wmat"):
            assert_close(run[1][key], state[key], 1e-5, f"{name} {key}")
        assert (int(run[1]["count"]), int(run[1]["skipped"])) == (STEPS, 0)
        assert_close(run[2], y_eval, 1e-5, f"{name} eval")
    for got, want in zip(twin[0] + [twin[2]], linen[0] + [linen[2]], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.nanmax(np.abs(want)))
