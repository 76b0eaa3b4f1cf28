"""Audit findings on the loop's numbers: the vendor peak table matches whole device names
(finding 8)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_device_mesh

from isojax.training import throughput


@pytest.mark.parametrize(
    "kind, dtype, peak",
    [
        ("NVIDIA L40S", jnp.bfloat16, 362.05e12),
        ("NVIDIA L40S", jnp.float32, 91.6e12),
        ("NVIDIA L40", jnp.bfloat16, 181.05e12),
        ("NVIDIA L40", jnp.float16, 181.05e12),
        ("NVIDIA L4", jnp.bfloat16, 121e12),
        ("NVIDIA H100 NVL", jnp.bfloat16, 835.5e12),
        ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", jnp.bfloat16, 756e12),
        ("NVIDIA A100-SXM4-80GB", jnp.bfloat16, 312e12),
        ("NVIDIA A100 80GB PCIe", jnp.float16, 312e12),
        ("NVIDIA H200 NVL", jnp.bfloat16, 835e12),
        ("TPU v5 lite", jnp.bfloat16, 197e12),
    ],
)
def test_peak_flops_matches_whole_device_names(kind, dtype, peak):
    """Finding 8: "l4" is not "NVIDIA L40S" (dense figures, data sheets)."""
    assert throughput.peak_flops(kind, dtype)[0] == peak


@pytest.mark.parametrize("kind", ["NVIDIA GH200 480GB", "NVIDIA H800 PCIe", "TPU v4 lite", "L4x"])
def test_variants_not_in_the_table_have_an_unknown_peak(kind):
    """Finding 8: a variant the table does not hold gets no other chip's figure."""
    peak, why = throughput.peak_flops(kind, jnp.bfloat16)
    assert peak is None and kind in why


def _tiny_state(policy: str, minilm_dir):
    """A tiny-bert RTE train state built as the loop builds it, under `policy`."""
    from isojax.data import tasks
    from isojax.training import build, specs
    from isojax.training import config as config_lib

    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {"model": "tiny-bert", "tokenizer": str(minilm_dir), "task": "rte", "policy": policy}
    )
    task = tasks.get_task("rte")
    module, params, _, hidden = build.build_model(specs.ModelSpec.of(config), task.num_labels)
    mesh = one_device_mesh()
    return build.train_state(
        specs.StateSpec.of(config),
        task,
        module,
        params,
        hidden,
        mesh,
        steps_per_epoch=1,
        total_steps=1,
    )


def test_output_dtype_applies_to_what_the_model_returns(minilm_dir):
    """Finding 18: `o=bf16` casts the logits and sentence vectors the steps read (jmp's
    `cast_to_output`); the hidden states stay in the compute dtype."""
    from isojax.training import evaluation, steps

    state = _tiny_state("p=f32,c=f32,o=bf16", minilm_dir)
    ids = jnp.arange(24, dtype=jnp.int32).reshape(2, 12) + 3
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    kw = dict(attention_mask=jnp.ones_like(ids), deterministic=True, use_running_average=True)
    # Dtypes only: traced, not compiled.
    logits, out = jax.eval_shape(functools.partial(state.apply_fn, **kw), variables, ids)
    assert logits.dtype == out["sentence"].dtype == out["pre_logits"].dtype == jnp.bfloat16
    assert out["encoder"].hidden_states[-1].dtype == jnp.float32
    apply = functools.partial(state.apply_fn, **kw, mutable=["batch_stats"])
    (logits, _), _ = jax.eval_shape(apply, variables, ids)
    assert logits.dtype == jnp.bfloat16
    batch = {"input_ids": ids, "attention_mask": jnp.ones_like(ids),
             "token_type_ids": jnp.zeros_like(ids), "labels": jnp.array([0, 1]),
             "example_mask": jnp.ones([2], jnp.float32)}  # fmt: skip
    hidden = out["sentence"].shape[-1]
    # One compiled program (op by op, each operation compiled alone, took 8 s).
    _, outputs = jax.jit(steps.eval_step)(state, batch, evaluation.eval_accumulator_init(hidden))
    got = np.asarray(outputs["logits"])
    np.testing.assert_array_equal(got, got.astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("spec", ["f64", "p=f32,c=f64,o=f32", "o=float64"])
def test_float64_policy_without_x64_is_refused(spec):
    """Finding 18: float64 without x64 would run in float32: refused in one line."""
    from isojax.training import config as config_lib
    from isojax.training import precision

    with pytest.raises(ValueError, match="x64 mode is off"):
        precision.get_policy(spec)
    config = config_lib.default_config()
    config.policy = spec
    with pytest.raises(config_lib.ConfigError, match="x64"):
        config_lib.validate_config(config)
