"""experiments/device/accel_check.py: its frame (the lines it prints and returns; its dry run on
the CPU, tiny models at one shape, runs whole in tests/e2e/test_device_scripts.py), and its
profile summary read from a trace with a device lane (what a GPU's trace holds)."""

import gzip
import json
import re

from experiments.device import accel_check


def test_main_prints_and_returns_its_lines_and_names_a_skipped_torch(tmp_path, capsys, monkeypatch):
    """The check's frame, its measurements left out (`measure`: the whole dry run, torch
    included, runs in tests/e2e/test_device_scripts.py, `run.sh bench`, whose test reads every
    arm's line, the equality and the profile from its log)."""
    monkeypatch.setattr(accel_check, "measure", lambda named, shapes, *_: print(sorted(named)))
    lines = accel_check.main(["--dry", "--no-torch", "--out", str(tmp_path)])
    out = capsys.readouterr().out.splitlines()
    assert out == [lines[0], lines[1], "['tiny-bert', 'tiny-modernbert']", lines[2]]
    assert lines[0].startswith("device: cpu (cpu), jax ")
    assert lines[1] == "torch: not measured: skipped (--no-torch)"
    assert len(lines) == 3 and lines[-1].startswith("accel_check: done in ")


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
