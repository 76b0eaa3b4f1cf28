"""Audit findings on the loop's numbers: the vendor peak table matches whole device names
(finding 8)."""

import jax.numpy as jnp
import pytest

from isojax.training import hardware


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
    assert hardware.peak_flops(kind, dtype)[0] == peak


@pytest.mark.parametrize("kind", ["NVIDIA GH200 480GB", "NVIDIA H800 PCIe", "TPU v4 lite", "L4x"])
def test_variants_not_in_the_table_have_an_unknown_peak(kind):
    """Finding 8: a variant the table does not hold gets no other chip's figure."""
    peak, why = hardware.peak_flops(kind, jnp.bfloat16)
    assert peak is None and kind in why
