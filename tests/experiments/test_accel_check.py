"""experiments/device/accel_check.py: its dry run on the CPU (tiny models, one shape), and its
profile summary read from a trace with a device lane (what a GPU's trace holds)."""

import gzip
import json
import re

import pytest

from experiments.device import accel_check


@pytest.mark.e2e  # the whole check, at tiny sizes
def test_dry_run_prints_every_arm_the_equality_and_the_profile(tmp_path, capsys):
    lines = accel_check.main(["--dry", "--no-torch", "--out", str(tmp_path)])
    assert lines == capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu (cpu), jax ")
    assert "torch: not measured: skipped (--no-torch)" in lines
    for model, kinds in (("tiny-bert", "global xla"), ("tiny-modernbert", "global xla, local xla")):
        for arm in ("xla", "auto"):
            (line,) = [x for x in lines if x.startswith(f"{model} 4x32 bf16 isojax {arm}: ")]
            assert re.search(r"[0-9.]+ ms/step, [0-9,]+ tokens/s, [0-9,]+ real tokens/s", line)
            assert "model-FLOPs MFU unknown (no peak for this device)" in line
            assert "peak memory " in line and f"attention {kinds};" in line
        (line,) = [x for x in lines if x.startswith(f"{model} 4x32 bf16 equality auto vs xla")]
        assert line.count("0.00e+00") == 3 and ": PASS (cuDNN not measured here" in line
    top = (tmp_path / "profile_top15.txt").read_text().splitlines()
    assert top[0].startswith("profile: one isojax step, the 15 most expensive ops")
    assert 2 <= len(top) <= 16 and (tmp_path / "profile_trace.json.gz").stat().st_size > 0
    assert lines[-1].startswith("accel_check: done in ")


def test_rows_pad_about_a_quarter_at_the_right():
    cfg = accel_check.DRY_MODELS["tiny-bert"]
    ids, mask, labels = accel_check.rows(cfg, 256, 128)
    padded = (mask.sum(axis=1) < 128).mean()
    assert 0.2 <= float(padded) <= 0.25 and ids.shape == (256, 128) and labels.shape == (256,)
    lengths = mask.sum(axis=1)
    assert bool((mask == (jnp_arange(128) < lengths[:, None])).all())  # right padding
    assert bool(((ids == cfg.pad_token_id) == (mask == 0)).all())


def jnp_arange(n):
    import numpy as np

    return np.arange(n)[None]


def test_top_ops_sums_the_device_lanes(tmp_path):
    """A trace with a host and a GPU process: only the GPU's complete events count, summed by
    name, most expensive first; the trace is copied beside the summary."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "host_work", "dur": 1e6},
        {"ph": "X", "pid": 7, "name": "gemm_fusion", "dur": 30.0},
        {"ph": "X", "pid": 7, "name": "cudnn_fmha", "dur": 50.0},
        {"ph": "X", "pid": 7, "name": "gemm_fusion", "dur": 40.0},
    ]
    trace = tmp_path / "trace" / "plugins" / "profile" / "x"
    trace.mkdir(parents=True)
    (trace / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps(events).encode()))
    lines = accel_check.top_ops(tmp_path / "trace", tmp_path / "out")
    assert "device lanes" in lines[0] and len(lines) == 3
    assert re.match(r"\s+70\.0 us\s+2 x  gemm_fusion$", lines[1])
    assert re.match(r"\s+50\.0 us\s+1 x  cudnn_fmha$", lines[2])
    assert (tmp_path / "out" / "profile_top15.txt").read_text().splitlines() == lines
    assert (tmp_path / "out" / "profile_trace.json.gz").is_file()
