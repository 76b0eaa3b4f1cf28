"""Data parallelism: the sharded step equals the single-device step (4 simulated CPU devices,
parameters replicated or FSDP-sharded); two processes: tests/e2e/test_distributed.py."""

import jax
import pytest
from helpers import assert_tree_close, one_device_mesh, sharded_config
from jax.sharding import PartitionSpec as P

from isojax.training import distributed, feeds, loop, steps


def test_sharded_step_equals_single_device_step(glue_dir, minilm_dir):
    """Two IsoBN steps (dropout on) on a batch split over 4 devices give the params and
    batch_stats of the same steps on one device: IsoBN's moments are over the global batch.
    Also with FSDP, where the embedding matrix is really split. Dropout keys "rbg" (XLA's
    RngBitGenerator), whose masks must not depend on the sharding either; the default
    threefry keys: tests/e2e/test_distributed.py."""
    config = sharded_config(glue_dir, minilm_dir, rng_impl="rbg")
    single = loop.setup(config, mesh=one_device_mesh())
    host_state = jax.device_get(single.state)
    batches = list(feeds.train_batches(single.train_encoded, single.spec.feed, 0))
    assert len(batches) == 2

    def two_steps(state, train_fn, mesh):
        for batch in batches:
            state, m = train_fn(state, distributed.global_batch(batch, mesh))
        return jax.device_get((state.params, state.batch_stats)), float(m["loss"])

    want, want_loss = two_steps(single.state, single.train_fn, single.mesh)
    assert int(want[1]["norm"]["count"]) == 2
    mesh = distributed.make_mesh()
    assert mesh.size == 4
    for fsdp in (False, True):
        shardings = distributed.state_sharding(host_state, mesh, fsdp=fsdp)
        state = jax.device_put(host_state, shardings)
        embedding = state.params["encoder"]["embeddings"]["word"]["embedding"]
        assert embedding.sharding.spec == (P(None, "data") if fsdp else P())
        train_fn, _, _ = steps.jit_steps(state, mesh, fsdp=fsdp)
        got, got_loss = two_steps(state, train_fn, mesh)
        assert_tree_close(got, want)
        assert got_loss == pytest.approx(want_loss, abs=1e-5)
