"""The NNX fine-tuning loop (`experiments/nnx_finetune.py`) on tiny-bert: it trains and
evaluates, and an orbax checkpoint of its NNX state (model, optimizer, dropout streams)
written mid-epoch and restored by a fresh run continues to the same parameters as the run
that never stopped."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import REPO

from isojax.training import config as config_lib

pytestmark = pytest.mark.e2e  # whole runs: the e2e lane


def _loop():
    spec = importlib.util.spec_from_file_location(
        "nnx_finetune", REPO / "experiments/nnx_finetune.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plain(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


def _config(glue_dir, minilm_dir):
    config = config_lib.default_config()
    config.task, config.normalizer, config.model = "rte", "isobn", config_lib.TINY_MODEL
    config.tokenizer, config.data_dir = str(minilm_dir), str(glue_dir)
    config.max_train_examples, config.max_eval_examples = 40, 16
    config.batch_size, config.eval_batch_size, config.max_length = 8, 16, 32
    config.num_epochs, config.packing = 1, True
    return config


def test_resume_continues_to_identical_parameters(tmp_path, glue_dir, minilm_dir):
    loop = _loop()
    config = _config(glue_dir, minilm_dir)
    straight, results = loop.finetune(config, tmp_path / "straight")
    assert set(results[0]) >= {"accuracy"}
    loop.finetune(config, tmp_path / "resumed", stop_after=2)  # then everything is dropped
    resumed, _ = loop.finetune(config, tmp_path / "resumed")
    want, got = nnx.state(straight), nnx.state(resumed)
    leaves = nnx.to_flat_state(want)
    assert len(leaves) > 10
    for (path, a), (path_b, b) in zip(leaves, nnx.to_flat_state(got), strict=True):
        assert path == path_b
        np.testing.assert_array_equal(
            _plain(b.get_value()), _plain(a.get_value()), err_msg=str(path)
        )


def test_istar_loop_installs_c0_and_trains(glue_dir, minilm_dir, monkeypatch):
    """With I-STAR the loop runs the C0 pass before the epoch and installs its C0 (no longer
    the identity) into the NNX IsoScore*, then trains with the penalty."""
    loop = _loop()
    config = _config(glue_dir, minilm_dir)
    config.normalizer = "none"
    config.penalty, config.max_train_examples, config.istar.stabilizer.tokens = "istar", 16, 400
    installed = []
    from isojax import nnx as isojax_nnx

    install = isojax_nnx.install_c0

    def spy(module, c0):
        installed.append(np.asarray(c0))
        install(module, c0)

    monkeypatch.setattr(isojax_nnx, "install_c0", spy)
    _, results = loop.finetune(config)
    assert len(installed) == 1 and not np.allclose(installed[0], np.eye(len(installed[0])))
    assert np.isfinite(results[0]["accuracy"])
