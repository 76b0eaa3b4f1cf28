"""The hardware figures of a compiled step: FLOPs (XLA's cost analysis), peak FLOP/s, MFU, memory.

    compiled = run.train_fn.lower(state, batch).compile()
    flops = hardware.step_flops(compiled)               # this device's program, per step
    peak, why = hardware.peak_flops(jax.devices()[0].device_kind, "bfloat16")
    mfu = hardware.mfu(flops, step_seconds, peak)        # None where the peak is unknown
    print(hardware.memory_line(compiled, jax.devices()[0]))   # ValueError if it cannot fit

FLOPs come from XLA's `HloCostAnalysis` of the compiled, SPMD-partitioned program: the FLOPs
one device runs per step (forward, backward, optimizer; matmuls counted 2·m·n·k), so MFU is
`flops / step time / peak of one device`, and a step's model FLOPs over the mesh is that times
the device count. XLA counts a while loop's body once: a step with `grad_accum_steps = k`
(`lax.scan` over micro-batches) reports `k ×` the compiled count (`step_flops(..., loop_trips=k)`),
which also counts the rest of the step, the optimizer update, `k` times: `(k − 1)` updates of a
few FLOPs per parameter too many, against about `6 · parameters · tokens` per micro-batch. The
excess grows as micro-batches shrink: on XLA:CPU, MiniLM-L6 at 32 × 128 +0.8 % at k = 4 and
+7.4 % at k = 32 (one example a micro-batch), tiny-bert at 32 × 48 +45 % at k = 4 (audit of
2026-12-03), so MFU under accumulation is an upper bound.

MFU (Chowdhery et al., PaLM, 2022, appendix B) is measured FLOPs per second over the device's
peak dense FLOP/s in the step's compute dtype (`PEAK_FLOPS`, vendor data sheets; no sparsity).
A device or dtype not in the table has an unknown peak: MFU is then None and the run says so;
`config.peak_flops` sets the peak explicitly.
"""

from __future__ import annotations

import re

import jax
import numpy as np

# Peak dense FLOP/s per chip (per `jax.Device`), by dtype, matched in order on the words of the
# lower-cased `device_kind` (e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite"; `_matches`). Every
# figure is dense (no 2:4 structured sparsity), the tensor-core rate with FP32 accumulation for
# bf16/fp16. Sources:
#   L4 121 TFLOPS bf16 dense, 30.3 FP32: NVIDIA L4 data sheet.
#   L40S 362.05 TFLOPS bf16/fp16 dense (733 with sparsity), 91.6 FP32: NVIDIA L40S data sheet.
#   L40 181.05 TFLOPS bf16/fp16 dense (362.1 with sparsity), 90.5 FP32: NVIDIA L40 data sheet.
#   TPU v4 275 TFLOPS bf16, v5e 197, v5p 459, v6e (Trillium) 918: Google Cloud TPU system
#     architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e). Google publishes
#     no f32 figure (f32 matmuls run as several bf16 passes): f32 is unknown there.
#   A100 (SXM and PCIe): 312 TFLOPS bf16/fp16 tensor, 19.5 TFLOPS FP32: NVIDIA A100 data
#     sheet (the TF32 tensor rate, 156 TFLOPS, applies only where XLA uses TF32 for f32).
#   H100 SXM 989 TFLOPS bf16 dense (1979 with sparsity), 67 TFLOPS FP32; H100 PCIe 756 and
#     51; H100 NVL 835.5 (1671 with sparsity) and 60: NVIDIA H100 data sheet.
#   H200 SXM 989 TFLOPS bf16 dense, 67 TFLOPS FP32; H200 NVL 835 and 60: NVIDIA H200 data
#     sheet.
PEAK_FLOPS = (
    ("h200 nvl", {"bfloat16": 835e12, "float16": 835e12, "float32": 60e12}),
    ("h200", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    ("h100 nvl", {"bfloat16": 835.5e12, "float16": 835.5e12, "float32": 60e12}),
    ("h100 pcie", {"bfloat16": 756e12, "float16": 756e12, "float32": 51e12}),
    ("h100", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12}),
    ("l40s", {"bfloat16": 362.05e12, "float16": 362.05e12, "float32": 91.6e12}),
    ("l40", {"bfloat16": 181.05e12, "float16": 181.05e12, "float32": 90.5e12}),
    ("l4", {"bfloat16": 121e12, "float16": 121e12, "float32": 30.3e12}),
    ("a100", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12}),
    ("tpu v4", {"bfloat16": 275e12}),
    ("tpu v5 lite", {"bfloat16": 197e12}),
    ("tpu v5e", {"bfloat16": 197e12}),
    ("tpu v5p", {"bfloat16": 459e12}),
    ("tpu v5", {"bfloat16": 459e12}),
    ("tpu v6 lite", {"bfloat16": 918e12}),
    ("tpu v6e", {"bfloat16": 918e12}),
)
# Words of a `device_kind` that name no other chip: the vendor, memory size and type, form
# factor. Any other word beside a table entry's (an "nvl", a "lite" the entry lacks) makes the
# device a variant the table does not hold, whose peak is unknown.
_DESCRIPTORS = re.compile(r"nvidia|pcie|sxm[0-9]*|hbm[0-9]*e?|[0-9]+gb")


def _matches(pattern: str, device_kind: str) -> bool:
    """Whether `pattern`'s words appear, whole and in order, among `device_kind`'s words
    (letters and digits, lower-cased) and every other word is a `_DESCRIPTORS` word: "l4" is
    not "NVIDIA L40S", "h100" is not "NVIDIA H100 NVL" nor "NVIDIA GH200"."""
    words, want = re.findall(r"[a-z0-9]+", device_kind.lower()), pattern.split()
    for i in range(len(words) - len(want) + 1):
        if words[i : i + len(want)] == want:
            rest = words[:i] + words[i + len(want) :]
            return all(_DESCRIPTORS.fullmatch(w) for w in rest)
    return False


class DoesNotFit(ValueError):
    """The compiled step needs more memory than the device reports it can allocate."""


def peak_flops(device_kind: str, dtype, override: float | None = None) -> tuple[float | None, str]:
    """`(peak dense FLOP/s of one device, where it comes from)`; `(None, why)` when unknown.

    Args:
      device_kind: `jax.Device.device_kind`.
      dtype: the step's compute dtype (`precision.Policy.compute_dtype`).
      override: `config.peak_flops`: used as given.
    """
    if override is not None:
        return float(override), "config.peak_flops"
    name = np.dtype(dtype).name
    for pattern, peaks in PEAK_FLOPS:
        if _matches(pattern, device_kind):
            if name in peaks:
                return peaks[name], f"{pattern} {name} data sheet"
            return None, f"no published {name} peak for {device_kind}"
    return None, f"no peak known for device {device_kind!r} (set config.peak_flops)"


def step_flops(compiled, loop_trips: int = 1) -> float | None:
    """FLOPs of one call of `compiled` on one device, from XLA's cost analysis (a dict, or a
    list of one dict per computation in older JAX), times `loop_trips` (the micro-batches of
    an accumulating step, whose loop body XLA counts once). None where the backend gives none.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) * loop_trips if flops and flops > 0 else None


def mfu(flops: float | None, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: `flops / seconds / peak` (one device's FLOPs, one device's
    peak); None when either count is unknown."""
    if flops is None or peak is None or not seconds > 0:
        return None
    return flops / seconds / peak


def memory(compiled) -> dict[str, int]:
    """Bytes per device of a compiled step (`memory_analysis()`): arguments, outputs,
    temporaries, the donated bytes outputs reuse (`alias`), and `total` = arguments + outputs
    + temporaries - alias (what the step holds at once, code aside)."""
    stats = compiled.memory_analysis()
    out = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
    }
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["alias"]
    return out


def device_memory_limit(device: jax.Device) -> int | None:
    """Bytes the device can allocate (`memory_stats()["bytes_limit"]`), None where it reports
    none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def memory_line(compiled, device: jax.Device) -> str:
    """One line of the step's memory per device; `DoesNotFit` (one line) when its total exceeds
    what `device` reports it can allocate."""
    m = memory(compiled)
    limit = device_memory_limit(device)
    text = (
        f"train step memory per device: arguments {_mib(m['arguments'])}, outputs "
        f"{_mib(m['outputs'])}, temporaries {_mib(m['temporaries'])}, total {_mib(m['total'])}"
    )
    if limit is None:
        return text + f" ({device.device_kind} reports no memory limit)"
    if m["total"] > limit:
        raise DoesNotFit(
            f"{text} exceeds the {_mib(limit)} of {device.device_kind}: lower batch_size, set "
            "grad_accum_steps, remat or fsdp"
        )
    return text + f" of {_mib(limit)} ({device.device_kind})"
