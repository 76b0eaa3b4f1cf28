"""experiments/bench/stabilizer_gap.py on a random tiny BERT and a few real RTE rows: the
distances it prints are those of the C0 the step uses and of the pass over the same
parameters."""

import numpy as np
import pytest
from helpers import one_device_mesh

from experiments.bench import stabilizer_gap
from isojax.training import config as config_lib

pytestmark = pytest.mark.e2e  # whole runs: the e2e lane


def test_stabilizer_gap_runs_on_a_tiny_model(glue_dir, minilm_dir, capsys):
    argv = [
        "--model", config_lib.TINY_MODEL, "--tokenizer", str(minilm_dir),
        "--data-dir", str(glue_dir), "--max-train-examples", "24", "--batch-size", "8",
        "--max-length", "32", "--tokens", "64", "--every", "1", "--max-steps", "3",
    ]  # fmt: skip
    rows = stabilizer_gap.main(argv, mesh=one_device_mesh())
    out = capsys.readouterr().out
    assert [(r.mode, r.step) for r in rows] == [(m, s) for m in ("epoch", "ema") for s in range(3)]
    assert "dC0" in out and "epoch  over 3 points" in out and "ema    over 3 points" in out
    for r in rows:
        assert all(np.isfinite(v) for v in vars(r).values() if isinstance(v, float)), r
        assert r.c0_distance > 0 and r.grad_distance > 0 and r.grad_norm_pass > 0
    # Before any update both modes hold the identity: same params, batch, pass and distances.
    first = [r for r in rows if r.step == 0]
    assert first[0].c0_distance == first[1].c0_distance
    np.testing.assert_allclose(first[0].grad_distance, first[1].grad_distance, rtol=1e-5)
    # Once the window closes (64 token vectors: every step) the running C0 moves off the
    # identity: the distance to the pass changes.
    epoch = [r for r in rows if r.mode == "epoch"]
    assert abs(epoch[1].c0_distance - epoch[0].c0_distance) > 1e-3
