"""Throughput and memory in the run, and the profiler window (`isojax.training.throughput`)."""

import json

import jax
import pytest
from helpers import one_device_mesh, tiny_config

from isojax.training import distributed, feeds, loop, throughput


def _config(glue_dir, minilm_dir, **overrides):
    """`helpers.tiny_config` with 40 train and 8 dev rows, logging every other step."""
    return tiny_config(
        glue_dir, minilm_dir, max_train_examples=40, max_eval_examples=8, log_every=2, **overrides
    )


def _train_lines(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@pytest.mark.e2e  # a whole run
def test_logged_flops_are_the_model_count_and_profile_window(
    tmp_path, glue_dir, minilm_dir, capsys, monkeypatch
):
    """5 steps of 8 examples on one device, a log line every 2 steps: each line carries the
    step time, the rates, `flops_per_step` equal to the model count (`model_flops` of the
    encoder, 8 rows of 32 tokens, the last layer at [CLS] only) and `xla_flops_per_step` to
    XLA's cost analysis of the compiled step (the same program, lowered and compiled here
    again from the run's own build, not a second one); MFU is the model count over
    `peak_flops`. The profile window (1, 3) writes a trace under <workdir>/profile; the
    memory line is printed."""
    mesh = one_device_mesh()
    # progress on: the start-of-run lines belong to the progress display
    config = _config(glue_dir, minilm_dir, peak_flops=1e9, profile_steps=(1, 3), progress=True)
    built, build_run = [], loop.build_run

    def recording(*args, **kwargs):  # the run's own build (its state's shapes: the step donates)
        run = build_run(*args, **kwargs)
        built.append((run, jax.tree.map(_abstract, run.state)))
        return run

    monkeypatch.setattr(loop, "build_run", recording)
    loop.train_and_evaluate(config, tmp_path / "run", mesh=mesh)
    err = capsys.readouterr().err
    assert "train step memory per device: arguments" in err
    assert "peak 1e+09 FLOP/s per device (config.peak_flops)" in err

    ((run, state),) = built
    batch = next(iter(feeds.train_batches(run.train_encoded, run.spec.feed, 0, mesh=mesh)))
    compiled = run.train_fn.lower(state, distributed.global_batch(batch, mesh)).compile()
    want = compiled.cost_analysis()
    xla = (want[0] if isinstance(want, list) else want)["flops"]
    assert state.objective.cls_only and not state.objective.reads_tokens
    want = throughput.model_flops(run.model.encoder.config, 8, 32, num_labels=2, cls_only=True)
    lines = _train_lines(tmp_path / "run")
    assert [r["step"] for r in lines] == [2, 4, 5]
    for r in lines[1:]:  # step 1 compiled its shape: the first window starts after it
        assert r["flops_per_step"] == pytest.approx(want, rel=1e-6) and want > 0
        assert r["xla_flops_per_step"] == pytest.approx(xla, rel=1e-6) and xla > 0
        assert r["step_time_s"] > 0
        assert r["mfu"] == pytest.approx(want / r["step_time_s"] / 1e9, rel=1e-6)
        assert r["examples_per_s"] == pytest.approx(8 / r["step_time_s"], rel=1e-6)
        assert 0 < r["real_tokens_per_s"] <= r["padded_tokens_per_s"]
        assert r["padded_tokens_per_s"] == pytest.approx(8 * 32 / r["step_time_s"], rel=1e-6)
        assert "examples" not in r and "real_tokens" not in r
    traces = list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


@pytest.mark.e2e  # a whole run
def test_off_by_default_no_trace_and_unknown_peak_said(tmp_path, glue_dir, minilm_dir, capsys):
    """Without profile_steps no profile folder is written; on CPU the peak is unknown: no
    MFU in the log, and one line says why. With `throughput` False no figures at all."""
    mesh = one_device_mesh()
    config = _config(glue_dir, minilm_dir, progress=True)
    loop.train_and_evaluate(config, tmp_path / "a", mesh=mesh)
    assert "isojax: MFU: no peak known for device 'cpu'" in capsys.readouterr().err
    assert not (tmp_path / "a" / "profile").exists()
    lines = _train_lines(tmp_path / "a")
    assert "mfu" not in lines[-1] and lines[-1]["flops_per_step"] > 0
    config = _config(glue_dir, minilm_dir, throughput=False)
    loop.train_and_evaluate(config, tmp_path / "b", mesh=mesh)
    assert not set(throughput.TIMED_KEYS) & set(_train_lines(tmp_path / "b")[-1])


def test_peak_table_and_override():
    assert throughput.peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")[0] == 989e12
    assert throughput.peak_flops("NVIDIA H100 PCIe", "float32")[0] == 51e12
    assert throughput.peak_flops("NVIDIA H200", "float32")[0] == 67e12
    assert throughput.peak_flops("NVIDIA A100-SXM4-80GB", "float32")[0] == 19.5e12
    assert throughput.peak_flops("TPU v5 lite", "bfloat16")[0] == 197e12
    assert throughput.peak_flops("TPU v5", "bfloat16")[0] == 459e12
    assert throughput.peak_flops("TPU v6 lite", "bfloat16")[0] == 918e12
    peak, why = throughput.peak_flops("TPU v4", "float32")
    assert peak is None and "no published float32 peak" in why
    assert throughput.peak_flops("cpu", "float32")[0] is None
    assert throughput.peak_flops("cpu", "float32", override=2e11) == (2e11, "config.peak_flops")
    assert throughput.mfu(1e12, 0.5, 4e12) == 0.5 and throughput.mfu(None, 1.0, 1.0) is None


class _SmallDevice:
    device_kind = "small"

    def memory_stats(self):
        return {"bytes_limit": 1000}


def test_a_step_that_cannot_fit_fails_with_one_line():
    compiled = jax.jit(lambda x: x @ x).lower(jax.numpy.ones((64, 64))).compile()
    with pytest.raises(throughput.DoesNotFit, match=r"exceeds the 0.0 MiB of small: lower"):
        throughput.memory_line(compiled, _SmallDevice())
    assert "reports no memory limit" in throughput.memory_line(compiled, jax.devices()[0])


def _initialize_calls(monkeypatch, env: dict) -> list:
    from isojax.training import distributed

    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                "ISOJAX_DISTRIBUTED", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize_distributed()
    return calls


def test_launchers_start_the_distributed_runtime(monkeypatch):
    """The README's recipes: explicit variables; `srun` with several tasks and
    `ISOJAX_DISTRIBUTED=auto` (JAX's cluster detection); one process otherwise."""
    explicit = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert _initialize_calls(monkeypatch, explicit) == [
        (("h:1",), {"num_processes": 2, "process_id": 1})
    ]
    assert _initialize_calls(monkeypatch, {"SLURM_NTASKS": "8"}) == [((), {})]
    assert _initialize_calls(monkeypatch, {"SLURM_NTASKS": "1"}) == []
    assert _initialize_calls(monkeypatch, {"ISOJAX_DISTRIBUTED": "auto"}) == [((), {})]
    assert _initialize_calls(monkeypatch, {"ISOJAX_DISTRIBUTED": "off", "SLURM_NTASKS": "8"}) == []
    assert _initialize_calls(monkeypatch, {}) == []
