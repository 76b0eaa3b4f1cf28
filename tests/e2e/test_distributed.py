"""Two processes through `jax.distributed.initialize` (2 simulated CPU devices each) give the
result of one process with 4 devices."""

import json
import subprocess
import sys
import textwrap

import jax
import orbax.checkpoint as ocp
import pytest
from children import child_env, finish, free_port
from helpers import assert_tree_close, sharded_config

from isojax.training import loop

pytestmark = pytest.mark.e2e


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


def test_two_processes_match_one_process(tmp_path, glue_dir, minilm_dir):
    """Two CPU processes of 2 devices each (a 4-device global mesh, each process reading half
    of every batch) end one epoch where one process with 4 devices does (1e-5)."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    port = free_port()
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
    config = sharded_config(glue_dir, minilm_dir, num_epochs=1)
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
    assert_tree_close((two["params"], two["batch_stats"]), (one["params"], one["batch_stats"]))
