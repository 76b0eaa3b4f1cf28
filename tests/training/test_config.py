"""The fine-tuning config and optimizer (`isojax.training.config`, `isojax.training.optim`,
`isojax.training.configs`): validation names the bad field, the presets, the schedule, weight
decay, clipping and the task loss against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from isojax.linen import istar as linen_istar
from isojax.training import config as config_lib
from isojax.training import configs, optim, steps

# ---------------------------------------------------------------------------------------------
# Configuration and optimizer.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("task", "squad", "config: task: unknown GLUE task 'squad'"),
        ("normalizer", "whitening", "unknown normalizer 'whitening'"),
        ("penalty", "isobn", "unknown penalty 'isobn'"),
        ("istar.zeta", 1.5, r"istar.zeta: zeta must lie in \[0, 1\], got 1.5"),
        ("isobn.momentum", 1.0, r"isobn: momentum 1.0 not in \(0, 1\)"),
        ("isobn.epsilon", 0.0, r"isobn: epsilon must be > 0"),
        ("istar.stabilizer.kind", "running", "istar.stabilizer: unknown stabilizer 'running'"),
        ("istar.stabilizer.momentum", 1.0, r"istar.stabilizer: momentum 1.0 not in \(0, 1\)"),
        ("istar.stabilizer.momentum", 0.0, r"istar.stabilizer: momentum 0.0 not in \(0, 1\)"),
        ("istar.stabilizer.unit", "epochs", "istar.stabilizer: window_unit must be one of"),
        ("istar.stabilizer.tokens", 2**25, r"istar.stabilizer: a token window above 2\*\*24"),
        ("rng_impl", "philox", "rng_impl 'philox' not in"),
        ("optimizer.warmup_fraction", 1.0, r"optimizer: warmup_fraction 1.0 not in \[0, 1\)"),
        ("optimizer.clip_norm", 0.0, "optimizer: clip_norm must be > 0 .None disables"),
        ("policy", "p=f32,c=int4", "config: policy: unknown dtype 'int4'"),
        ("sentence", "mean", "sentence must be"),
        ("max_steps", 0, "max_steps must be None or >= 1, got 0"),
        ("max_train_examples", 0, "max_train_examples must be None or >= 1"),
    ],
)
def test_validate_config_names_the_bad_field(key, value, match):
    """Each value is checked by the module that owns it; the config adds the field's path."""
    config = config_lib.default_config()
    config.update_from_flattened_dict({key: value})
    with pytest.raises(ValueError, match=match) as info:
        config_lib.validate_config(config)
    assert "\n" not in str(info.value)


def test_the_config_and_the_module_share_one_rule_for_the_stabilizer_momentum():
    """IsoScoreStar refuses what the config refuses (momentum 0 used to pass the module)."""
    for momentum in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"momentum .* not in \(0, 1\)"):
            linen_istar.make_isoscore_star("ema", momentum=momentum)


def test_default_config_is_valid_and_presets_set_the_references():
    config_lib.validate_config(config_lib.default_config())
    config = configs.load("isobn")
    config_lib.validate_config(config)
    assert (config.normalizer, config.batch_size, config.max_length, config.num_epochs) == (
        "isobn",
        16,
        256,
        10,
    )
    assert (config.optimizer.learning_rate, config.optimizer.adam_eps) == (5e-5, 1e-6)
    assert (config.optimizer.warmup_fraction, config.optimizer.weight_decay) == (0.06, 0.0)
    assert config.optimizer.clip_norm is None
    config = configs.load("istar")
    config_lib.validate_config(config)
    assert (config.penalty, config.istar.zeta, config.istar.weight) == ("istar", 0.2, -5.0)
    assert (config.optimizer.learning_rate, config.optimizer.schedule) == (1e-5, "constant")
    assert (config.istar.stabilizer.kind, config.istar.stabilizer.tokens) == ("pass", 250_000)
    with pytest.raises(ValueError, match="unknown preset"):
        configs.load("nope")


def test_schedule_matches_transformers_linear_warmup():
    """transformers' get_linear_schedule_with_warmup: t/W, then (T - t)/(T - W)."""
    total, warmup_fraction, lr = 50, 0.06, 5e-5
    warmup = int(total * warmup_fraction)
    schedule = optim.learning_rate_schedule(lr, total, warmup_fraction=warmup_fraction)
    for t in range(total + 1):
        want = lr * (t / warmup if t < warmup else max(0.0, (total - t) / (total - warmup)))
        np.testing.assert_allclose(float(schedule(t)), want, rtol=1e-6, atol=1e-12)
    constant = optim.learning_rate_schedule(lr, total, kind="constant")
    assert float(constant(0)) == float(constant(49)) == pytest.approx(lr)


def test_weight_decay_skips_biases_and_norm_scales():
    params = {
        "dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones(2)},
        "LayerNorm": {"scale": jnp.ones(2), "bias": jnp.ones(2)},
    }
    spec = optim.OptimSpec(learning_rate=0.1, warmup_fraction=0.0, weight_decay=0.5, clip_norm=None)
    tx = optim.make_optimizer(spec, total_steps=10)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    # With zero gradient only decay moves a weight: kernel * (1 - lr * wd); 1-D leaves stay.
    np.testing.assert_allclose(new["dense"]["kernel"], 1 - 0.1 * 0.5, rtol=1e-6)
    for leaf in (new["dense"]["bias"], new["LayerNorm"]["scale"], new["LayerNorm"]["bias"]):
        np.testing.assert_array_equal(leaf, 1.0)


def test_clipping_sees_the_global_norm():
    spec = optim.OptimSpec(learning_rate=1.0, clip_norm=1.0, b1=0.0, b2=0.0, adam_eps=1e-8)
    tx = optim.make_optimizer(spec, total_steps=1)
    assert len(tx.init({"w": jnp.ones(2)})) == 2  # clip_by_global_norm, then adamw


def test_task_loss_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 3)).astype(np.float32)
    labels = np.array([0, 2, 1, 1, 0], np.int32)
    mask = np.array([1, 1, 1, 0, 1], np.int32)
    log_p = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = -(log_p[np.arange(5), labels] * mask).sum() / mask.sum()
    got = steps.task_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask), False)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    scores = rng.normal(size=5).astype(np.float32)
    want = (((logits[:, 0] - scores) ** 2) * mask).sum() / mask.sum()
    got = steps.task_loss(jnp.asarray(logits[:, :1]), jnp.asarray(scores), jnp.asarray(mask), True)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
