"""The loop's stop on a training loss that stays non-finite (`isojax.training.stops`), and
the finite hyper-parameters it needs (`optim.check_hparams`); the whole run that stops with
status 3: tests/e2e/test_run_safety.py."""

import json

import jax.numpy as jnp
import pytest

from isojax.training import optim, run_folder, specs, stops


@pytest.mark.parametrize(
    "key, value",
    [
        ("weight_decay", float("inf")),
        ("weight_decay", float("nan")),
        ("learning_rate", float("inf")),
        ("adam_eps", float("inf")),
        ("clip_norm", float("inf")),
    ],
)
def test_non_finite_hyperparameters_are_refused(key, value):
    with pytest.raises(ValueError, match=f"{key} must be a finite number"):
        optim.OptimSpec(**({"learning_rate": 1e-4} | {key: value}))


def test_max_nonfinite_steps_is_validated_and_may_change_on_resume(tmp_path):
    from isojax.training import config as config_lib

    config = config_lib.default_config()
    assert config.max_nonfinite_steps == 10
    config.max_nonfinite_steps = 0
    with pytest.raises(ValueError, match="max_nonfinite_steps must be None or >= 1, got 0"):
        config_lib.validate_config(config)
    config.max_nonfinite_steps = None
    config_lib.validate_config(config)
    (tmp_path / "checkpoints").mkdir()
    saved = json.loads(config_lib.default_config().to_json())
    del saved["max_nonfinite_steps"]  # a run folder of an isojax before the field
    (tmp_path / "config.json").write_text(json.dumps(saved))
    default = specs.RunSpec.of(config_lib.default_config()).fields
    run_folder.check_same_run(default, tmp_path)  # the default: same run
    # changed: it touches no state
    run_folder.check_same_run(specs.RunSpec.of(config).fields, tmp_path)


def test_the_watch_counts_consecutive_losses_and_is_off_under_a_dynamic_loss_scale(tmp_path):
    from isojax.training import precision

    nan = float("nan")
    watch = stops.LossWatch(3, precision.NoOpLossScale(), tmp_path, lead=True)
    for step, loss in enumerate([1.0, nan, nan, 2.0, nan, nan], 1):
        watch.update(step, jnp.float32(loss))
        watch.check(step, 0)  # never 3 in a row
    with pytest.raises(stops.NonFiniteLoss, match="not checkpointing a NaN model"):
        watch.check(6, 0, before="checkpointing")
    watch.update(7, jnp.float32(nan))
    with pytest.raises(stops.NonFiniteLoss, match="3 consecutive step.s. from step 5"):
        watch.check(7, 0)
    bf16 = precision.make_loss_scale(precision.get_policy("p=f32,c=bf16,o=f32"))
    f16 = precision.make_loss_scale(precision.get_policy("p=f32,c=f16,o=f32"))
    assert stops.LossWatch(3, bf16, tmp_path, True).limit == 3
    off = stops.LossWatch(3, f16, tmp_path, True)
    for step in range(1, 5):
        off.update(step, jnp.float32(nan))
    off.check(4, 0, before="evaluating")  # the loss scale skips these steps: no stop
