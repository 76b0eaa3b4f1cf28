"""Throughput of the training loop: per-window rates, model FLOPs and MFU, the compiled
step's memory and XLA's FLOPs count, and a profiler window.

    flops = functools.partial(throughput.model_flops, encoder_config, num_labels=2)
    meter = throughput.Meter(run.mesh, compute_dtype, flops=flops)
    for batch in ...:
        compiled = compiled_by_shape[key]   # the loop's `train_fn.lower(...).compile()`
        meter.read(key, compiled, batch["input_ids"].shape)
        state, metrics = compiled(state, batch)
        position.add_step(metrics | meter.counts(), steps_per_epoch)
        meter.step(state)                   # host-side only
    figures = meter.window(means)           # at a log step, after the means' host sync
    meter.mark()                            # after an evaluation or a checkpoint (not counted)

`Meter` measures each `log_every` window: step time, tokens/s, examples/s, model FLOPs per
step, MFU; the compiled step's memory at start. Each new batch shape (a length bucket, a packed
row bucket) is compiled once ahead of its first call, `train_fn.lower(state, batch).compile()`
(the program `jax.jit` would compile for the call; the loop then runs that executable for every
batch of the shape), which gives its memory and XLA's FLOPs count (`step_flops`): the first
shape's memory line is printed, and a shape that cannot fit the device stops the run before it
runs (`memory_line`). A shape's first run is left out of the window's rates. Real tokens and
examples are the step's own metrics (`steps.train_step`: `real_tokens`, `examples`, global
counts from the sharded batch), so every process agrees without a host collective; padded
tokens are the batch's token slots and FLOPs the shape's, added to the same sums (`counts`).

A window's figures (its steps ran between two host synchronisations: the log step's means,
or `mark` after an evaluation or a save, which synchronise too):
  step_time_s            wall time of the window / its steps;
  examples_per_s, real_tokens_per_s, padded_tokens_per_s   the window's counts / its time;
  flops_per_step         the model FLOPs of one step over all devices (`model_flops` of the
                         global batch's shape), the mean over the log window's steps (shapes
                         differ by bucket); not a time: a resumed run logs the uninterrupted
                         run's;
  xla_flops_per_step     XLA's cost analysis of the compiled step (per device x devices),
                         beside it, for comparison only;
  mfu                    flops_per_step / devices / step time / one device's peak (absent
                         when the peak is unknown: `peak_flops` says why, once, at start).

MFU (Chowdhery et al., PaLM, 2022, appendix B) is model FLOPs per second over the device's
peak dense FLOP/s in the step's compute dtype (`PEAK_FLOPS`, vendor data sheets; no sparsity).
The model FLOPs are counted from the encoder's config (`model_flops`: 2 x in x out per dense
layer a token passes through, 4 x keys seen x width per layer for the attention, the pooler
and head, x 3 for a training step), not read from the compiled program: they are the same
whatever the implementation recomputes (remat), pads or fuses, and they do not count the
optimizer, norms or softmax. A device or dtype not in the table has an unknown peak: MFU is
then None and the run says so; `config.peak_flops` sets the peak explicitly.

    flops = throughput.model_flops(encoder_config, rows, length)   # a training step
    peak, why = throughput.peak_flops(jax.devices()[0].device_kind, "bfloat16")
    mfu = throughput.mfu(flops / devices, step_seconds, peak)       # None: peak unknown
    print(throughput.memory_line(compiled, jax.devices()[0]))   # ValueError if it cannot fit

XLA's count (`step_flops`) is the `HloCostAnalysis` of the compiled, SPMD-partitioned program:
the FLOPs one device runs per step (forward, backward, optimizer; matmuls counted 2·m·n·k,
one per element-wise op). On small configs on CPU it is within about 1 % of `model_flops`
(`tests/training/test_model_flops.py`). XLA counts a while loop's body once: a step with
`grad_accum_steps = k` (`lax.scan` over micro-batches) reports `k ×` the compiled count
(`step_flops(..., loop_trips=k)`), which also counts the rest of the step, the optimizer
update, `k` times, so `xla_flops_per_step` under accumulation is an upper bound (MiniLM-L6 at
32 × 128 +0.8 % at k = 4 and +7.4 % at k = 32, tiny-bert at 32 × 48 +45 % at k = 4 on XLA:CPU,
audit of 2026-12-03); the model count, and so MFU, has no such excess.

A profiler window: a `jax.profiler` trace of training steps `start` to `stop` (`Window`).

    config.profile_steps = (10, 15)    # steps 11..15 (after update 10, up to update 15)
    # -> <workdir>/profile/plugins/profile/<time>/<host>.xplane.pb (TensorBoard's profile
    #    plugin: tensorboard --logdir <workdir>/profile; Perfetto: the same trace)

The trace starts after step `start` (its state synchronised, so the window holds no earlier
work) and stops after step `stop` once that step's work is done (`jax.block_until_ready`), so
it holds exactly the `stop - start` steps, their host work, transfers and device kernels. Off
(`config.profile_steps = None`, the default) the loop builds no `Window`: nothing is called per
step. A run whose window is not reached (resumed past it, or shorter) writes no trace; a trace
still open when the loop ends is stopped there.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import re
import time
from collections.abc import Callable

import jax
import numpy as np

logger = logging.getLogger(__name__)


COUNT_KEYS = ("examples", "real_tokens", "padded_tokens")  # per-step counts -> rates
# The figures that depend on the wall clock (a resumed run's differ; flops_per_step does not).
TIMED_KEYS = ("step_time_s", "examples_per_s", "real_tokens_per_s", "padded_tokens_per_s", "mfu")


class Meter:
    """Per-window throughput of the train step the loop runs (see the module doc). The loop
    compiles the step; the meter reads the compiled step's cost (`read`) and times the steps.

    Args:
      mesh: the step's devices (FLOPs are per device; the step's over the mesh is that x
        mesh.size).
      compute_dtype: the step's compute dtype (picks the peak).
      peak_override: `config.peak_flops`, FLOP/s of one device; None: `PEAK_FLOPS`.
      loop_trips: micro-batches per step (`config.grad_accum_steps`; see `step_flops`).
      verbose: log the memory and peak lines (process 0).
      flops: `(rows, length) -> ` the model FLOPs of a step over a global batch of that
        shape (`model_flops` of the run's encoder and head); None: no `flops_per_step`, no MFU.
    """

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        compute_dtype,
        *,
        peak_override: float | None = None,
        loop_trips: int = 1,
        verbose: bool = True,
        flops: Callable[[int, int], float] | None = None,
    ):
        self.mesh, self.loop_trips, self.verbose, self.flops = mesh, loop_trips, verbose, flops
        self.device = mesh.devices.flat[0]
        self.peak, why = peak_flops(self.device.device_kind, compute_dtype, peak_override)
        self._costs: dict[tuple, tuple] = {}  # batch shapes -> (model, XLA FLOPs, slots)
        self._new, self._key = False, None
        self._steps = 0
        self._start = time.perf_counter()
        if verbose:
            line = f"peak {self.peak:.4g} FLOP/s per device ({why})" if self.peak else why
            logger.info("isojax: MFU: %s", line)

    def read(self, key: tuple, compiled, shape: tuple[int, ...]) -> None:
        """Reads the cost of `compiled`, the step the loop runs next, for batch shapes `key`
        whose token ids are `shape` (`[..., rows, length]`, global): its model FLOPs and
        XLA's count; for the first shape the memory line and check (`memory_line` raises if
        it cannot fit). A shape's first run is left out of the rates."""
        if key not in self._costs:
            line = memory_line(compiled, self.device)
            if not self._costs and self.verbose:
                logger.info("isojax: %s", line)
            slots, length = int(np.prod(shape)), int(shape[-1])
            model = None if self.flops is None else self.flops(slots // length, length)
            xla = step_flops(compiled, self.loop_trips)
            self._costs[key] = (model, None if xla is None else xla * self.mesh.size, slots)
            self._new = True
        self._key = key

    def counts(self) -> dict[str, np.float32]:
        """The counts of the step last `read`, for the step metrics' sums
        (`position.Position.add_step`, checkpointed with them, so a resumed window's means are the
        uninterrupted one's): `flops_per_step` (the model FLOPs, `model_flops`, absent without
        `flops`), `xla_flops_per_step` (XLA's count of the compiled step per device x devices,
        absent when XLA gives none) and `padded_tokens` (the batch's token slots), float32 as
        the device metrics."""
        model, xla, padded = self._costs[self._key]
        out = {"padded_tokens": np.float32(padded)}
        if model is not None:
            out["flops_per_step"] = np.float32(model)
        if xla is not None:
            out["xla_flops_per_step"] = np.float32(xla)
        return out

    def step(self, state) -> None:
        """Times the step last `read`, which returned `state`."""
        if self._new:  # a shape's first run: left out of the rates
            self._new = False
            jax.block_until_ready(state)
            self.mark()
            return
        self._steps += 1

    def mark(self) -> None:
        """Starts timing anew now (the time since the last log step is not counted)."""
        self._steps, self._start = 0, time.perf_counter()

    def window(self, means: dict[str, float]) -> dict[str, float]:
        """`means` (the log window's step-metric means, after their host sync) with the counts
        (`COUNT_KEYS`) replaced by rates over the window's timed steps; starts the next."""
        seconds, steps = time.perf_counter() - self._start, self._steps
        out = {k: v for k, v in means.items() if k not in COUNT_KEYS}
        if steps and seconds > 0:
            step_time = seconds / steps
            out["step_time_s"] = step_time
            for name in COUNT_KEYS:
                if name in means:
                    out[f"{name}_per_s"] = means[name] / step_time
            if "flops_per_step" in means:
                value = mfu(means["flops_per_step"] / self.mesh.size, step_time, self.peak)
                if value is not None:
                    out["mfu"] = value
        self.mark()
        return out


def run_meter(run, lead: bool) -> Meter | None:
    """The training loop's `Meter` of `run` (`loop.Run`; None with its `LoopSpec.throughput`
    False): the model FLOPs of its encoder and head (`model_flops`, `cls_only` as
    `steps.train_step` runs it), its compute dtype's peak, its micro-batches."""
    spec, objective = run.spec, run.state.objective
    if not spec.loop.throughput:
        return None
    flops = functools.partial(
        model_flops,
        run.model.encoder.config,
        num_labels=run.model.num_labels,
        cls_only=objective.cls_only and not objective.reads_tokens,
    )
    return Meter(
        run.mesh,
        spec.state.policy.compute_dtype,
        peak_override=spec.loop.peak_flops,
        loop_trips=spec.feed.grad_accum_steps,
        verbose=lead and spec.loop.progress,  # its lines join the progress display's
        flops=flops,
    )


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


def attention_keys(cfg, length: int) -> list[int]:
    """Keys each query sees in each layer call of `cfg` (an `isojax.models.EncoderConfig`)
    at sequence length `length`: the length on a global layer, ModernBERT's window
    (`local_attention`) on a sliding one, capped at the length."""
    kinds = cfg.layer_types or ("full_attention",) * cfg.num_layer_calls
    window = min(cfg.local_attention, length)
    return [window if kind == "sliding_attention" else length for kind in kinds]


def model_flops(
    cfg, batch: int, length: int, *, train: bool = True, num_labels: int = 2,
    cls_only: bool = False,
) -> float:  # fmt: skip
    """Model FLOPs of a step of `batch` rows of `length` tokens through the encoder `cfg`
    (an `isojax.models.EncoderConfig`) and its classification head (PaLM, appendix B; as
    Megatron counts): per token, 2 x in x out for every dense layer it passes through (the
    fused query/key/value, the attention output, the feed-forward's two, or ModernBERT's GeGLU
    `[hidden, 2 intermediate]` and `[intermediate, hidden]`; ALBERT's embedding projection);
    4 x keys seen x hidden per layer for Q K^T and the weights times V (`attention_keys`); per
    row, the pooler (BERT's dense + tanh, ModernBERT's prediction head) and the classifier
    `[hidden, num_labels]`; x 3 for a training step (the backward pass costs twice the forward).
    `cls_only`: the last layer runs its query, attention, output and feed-forward at one token
    per row (`isojax.training.steps`, BERT family only), its keys and values at every token.
    Embedding lookups, norms, activations, softmax and the optimizer are not counted.
    """
    h, inner = cfg.hidden_size, cfg.intermediate_size
    modern = cfg.family == "modernbert"
    mlp = 2 * h * (2 * inner if modern else inner) + 2 * inner * h  # GeGLU: W1 -> 2 inner
    keys = attention_keys(cfg, length)
    per_token = 2 * cfg.embed_dim * h if cfg.family == "albert" else 0
    per_token += len(keys) * (2 * h * 3 * h + 2 * h * h + mlp) + sum(4 * k * h for k in keys)
    per_row = 2 * h * h * (modern or cfg.has_pooler) + 2 * h * num_labels
    if cls_only and not modern:  # the last layer's query, attention, output, MLP at [CLS] only
        last = 2 * h * h + 4 * keys[-1] * h + 2 * h * h + mlp
        per_token -= last
        per_row += last
    forward = batch * length * per_token + batch * per_row
    return float(3 * forward if train else forward)


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


PROFILE_DIR = "profile"


def check_steps(steps) -> None:
    """Raises ValueError unless `steps` is None or `(start, stop)` with `0 <= start < stop`."""
    if steps is None:
        return
    if len(steps) != 2 or not 0 <= int(steps[0]) < int(steps[1]):
        raise ValueError(f"profile_steps must be (start, stop) with 0 <= start < stop, got {steps}")


class Window:
    """Starts `jax.profiler` after step `start` and stops it after step `stop`.

    Args:
      workdir: the run folder; the trace goes to `workdir / PROFILE_DIR`.
      start, stop: training steps (updates done), `0 <= start < stop`.
      enabled: False on processes that trace nothing.
    """

    def __init__(self, workdir: pathlib.Path, start: int, stop: int, enabled: bool = True):
        check_steps((start, stop))
        self.directory = pathlib.Path(workdir) / PROFILE_DIR
        self.start, self.stop, self.enabled = int(start), int(stop), enabled
        self.tracing = False

    def step(self, step: int, state) -> None:
        """After training step `step` returned `state`."""
        if not self.enabled:
            return
        if step == self.start and not self.tracing:
            jax.block_until_ready(state)
            jax.profiler.start_trace(str(self.directory))
            self.tracing = True
        elif step == self.stop and self.tracing:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
