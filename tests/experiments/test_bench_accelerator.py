"""experiments/bench/accelerator.py runs end to end in its tiny CPU configuration."""

import pytest

from experiments.bench import accelerator


@pytest.mark.e2e  # a whole run
def test_tiny_run_prints_the_table(capsys):
    rows = accelerator.main(["--tiny", "--batches", "4", "--iters", "1", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "not measured: no accelerator" in out
    assert [row["variant"] for row in rows] == ["plain", "isobn", "istar"]
    for row in rows:
        assert row["batch"] == "4x16" and row["step_ms"] > 0 and row["tokens_per_s"] > 0
        assert row["mfu"] is None and row["mfu_6n"] is None  # no peak on CPU
        if row["xla_gflop"] is not None:  # XLA:CPU reports the step's FLOPs
            assert row["xla_gflop"] > 0
    assert rows[0]["ratio"] == 1.0
    # N without the embedding tables, L=1 H=32 I=64: attention 4 (32·32 + 32) = 4224, layer
    # norms 3·64 = 192, MLP 2112 + 2080, pooler 1056, classifier 66.
    assert "N (non-embedding params) = 9,730" in out


def test_peak_table():
    assert accelerator.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert accelerator.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert accelerator.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert accelerator.peak_flops("TPU v5 lite") == 197e12
    assert accelerator.peak_flops("TPU v4") == 275e12
    assert accelerator.peak_flops("cpu") is None
