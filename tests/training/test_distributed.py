"""Data parallelism: the sharded step equals the single-device step (4 simulated CPU devices,
parameters replicated or FSDP-sharded), and two processes through `jax.distributed.initialize`
give the result of one process."""

import json
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from children import child_env, finish
from jax.sharding import PartitionSpec as P

from isojax.training import config as config_lib
from isojax.training import distributed, feeds, loop, steps


def tiny_config(glue_dir, minilm_dir, **overrides):
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {
            "data_dir": str(glue_dir),
            "model": config_lib.TINY_MODEL,
            "tokenizer": str(minilm_dir),
            "task": "mrpc",
            "normalizer": "isobn",
            "max_train_examples": 16,
            "max_eval_examples": 8,
            "batch_size": 8,
            "eval_batch_size": 8,
            "max_length": 32,
            "buckets": (),
            "log_every": 1,
            "progress": False,
            "tensorboard": False,
            "optimizer.warmup_fraction": 0.0,
            "optimizer.learning_rate": 1e-3,
            **overrides,
        }
    )
    return config


def _close(a, b, tol=1e-5):
    jax.tree_util.tree_map_with_path(
        lambda path, x, y: np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path)
        ),
        a,
        b,
    )


def test_sharded_step_equals_single_device_step(glue_dir, minilm_dir):
    """Two IsoBN steps (dropout on) on a batch split over 4 devices give the params and
    batch_stats of the same steps on one device: IsoBN's moments are over the global batch.
    Also with FSDP, where the embedding matrix is really split. Dropout keys "rbg" (XLA's
    RngBitGenerator), whose masks must not depend on the sharding either; the default
    threefry keys: test_two_processes_match_one_process."""
    config = tiny_config(glue_dir, minilm_dir, rng_impl="rbg")
    single = loop.setup(config, mesh=distributed.make_mesh(jax.devices()[:1]))
    host_state = jax.device_get(single.state)
    batches = list(feeds.train_batches(single.train_encoded, config, 0))
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
        _close(got, want)
        assert got_loss == pytest.approx(want_loss, abs=1e-5)


_CHILD = textwrap.dedent(
    """
    import sys
    from isojax.training import distributed, loop
    from isojax.training import config as config_lib

    assert distributed.initialize_distributed()
    import jax

    workdir, glue_dir, tokenizer = sys.argv[1:]
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    config = config_lib.default_config()
    config.update_from_flattened_dict({
        "data_dir": glue_dir, "model": "tiny-bert", "tokenizer": tokenizer, "task": "mrpc",
        "normalizer": "isobn", "max_train_examples": 16, "max_eval_examples": 8, "batch_size": 8,
        "eval_batch_size": 8, "max_length": 32, "buckets": (), "log_every": 1,
        "progress": False, "tensorboard": False, "optimizer.warmup_fraction": 0.0,
        "optimizer.learning_rate": 1e-3, "num_epochs": 1,
    })
    loop.train_and_evaluate(config, workdir)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, glue_dir, minilm_dir):
    """Two CPU processes of 2 devices each (a 4-device global mesh, each process reading half
    of every batch) end one epoch where one process with 4 devices does (1e-5)."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    port = _free_port()
    children = []
    for rank in range(2):
        env = child_env(
            devices=2,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(rank),
        )
        children.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(script),
                    str(tmp_path / "two"),
                    str(glue_dir),
                    str(minilm_dir),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    # Meanwhile, the same run in this process (4 simulated devices).
    config = tiny_config(glue_dir, minilm_dir, num_epochs=1)
    want = loop.train_and_evaluate(config, tmp_path / "one")
    for child in children:
        done = finish(child)
        assert done.returncode == 0, done.stdout[-3000:]
    got = json.loads((tmp_path / "two" / "results.json").read_text())
    assert got["step"] == want["step"] == 2
    for key, value in want["dev"].items():
        assert got["dev"][key] == pytest.approx(value, abs=1e-4), key
    one = ocp.StandardCheckpointer().restore(tmp_path / "one" / "checkpoints" / "2" / "state")
    # Saved from another topology (2 processes): restore onto this process's first device.
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), one)
    two = ocp.StandardCheckpointer().restore(
        tmp_path / "two" / "checkpoints" / "2" / "state", target
    )
    _close((two["params"], two["batch_stats"]), (one["params"], one["batch_stats"]))
