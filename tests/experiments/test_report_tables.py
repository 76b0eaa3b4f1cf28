"""Tests for the tables, figures and statistics of experiments/report/ (`report.build`,
numbers, tables, figures, the pooled normalisation): constructed results
JSONLs give the medians, paired t intervals and p values, bootstrap intervals and tables that
NumPy / SciPy give."""

import numpy as np
import pytest
import scipy.stats
from report_data import (
    SCORES,
    _markdown,
    _normalizers_records,
    _pooled_records,
    _record,
    _write,
)

from experiments.report import page as report
from experiments.report import records as report_records


def _reference_ci(diffs) -> tuple[float, float]:
    """The percentile bootstrap, transcribed independently."""
    d = np.asarray(diffs, np.float64)
    rng = np.random.default_rng(0)
    means = np.empty(10_000)
    draws = rng.integers(0, len(d), size=(10_000, len(d)))
    for i in range(10_000):
        means[i] = d[draws[i]].sum() / len(d)
    return tuple(np.quantile(means, [0.025, 0.975]))


def test_normalizers_report_gives_numpy_statistics_and_verdicts(tmp_path):
    path = _write(tmp_path, "fixture", _normalizers_records())
    data = report.build(report_records.read_records(path))
    assert data["tasks"] == ["stsb", "rte"] and data["baseline"] == "none"
    for task in ("stsb", "rte"):
        for method in ("none", "isobn"):
            arm = data["per_task"][task]["arms"][method]
            last = [s[-1] for s in SCORES[task, method].values()]
            best = [max(s) for s in SCORES[task, method].values()]
            assert arm["last"]["n"] == len(last)
            assert arm["last"]["median"] == pytest.approx(np.median(last), abs=1e-12)
            assert arm["last"]["mean"] == pytest.approx(np.mean(last), abs=1e-12)
            assert arm["last"]["std"] == pytest.approx(np.std(last, ddof=1), abs=1e-12)
            assert arm["best"]["median"] == pytest.approx(np.median(best), abs=1e-12)
        # Paired over seeds 1-4 (isobn has no seed 5).
        p = data["per_task"][task]["paired"]["isobn"]
        for kind, pick in (("last", lambda s: s[-1]), ("best", max)):
            diffs = [
                pick(SCORES[task, "isobn"][s]) - pick(SCORES[task, "none"][s]) for s in (1, 2, 3, 4)
            ]
            assert p[kind]["n"] == 4 and p[kind]["seeds"] == [1, 2, 3, 4]
            assert p[kind]["mean"] == pytest.approx(np.mean(diffs), abs=1e-12)
            lo, hi = _reference_ci(diffs)
            assert (p[kind]["boot_lo"], p[kind]["boot_hi"]) == pytest.approx((lo, hi), abs=1e-12)
            # SciPy's percentile bootstrap (other draws) agrees within Monte-Carlo error.
            sp = scipy.stats.bootstrap(
                (np.array(diffs),), np.mean, n_resamples=10_000, method="percentile", random_state=1
            ).confidence_interval
            assert p[kind]["boot_lo"] == pytest.approx(sp.low, abs=0.003)
            assert p[kind]["boot_hi"] == pytest.approx(sp.high, abs=0.003)
            # The verdicts' statistics: SciPy's paired t-test and its interval.
            ref = scipy.stats.ttest_1samp(diffs, 0.0)
            ci = ref.confidence_interval(0.95)
            assert p[kind]["p"] == pytest.approx(ref.pvalue, rel=1e-9)
            assert (p[kind]["lo"], p[kind]["hi"]) == pytest.approx((ci.low, ci.high), abs=1e-12)
        assert p["pre_logits_ev3"]["mean"] == pytest.approx(-0.10, abs=1e-12)
    # The average over both tasks, per seed.
    avg = data["task_average"]["isobn"]["best"]
    diffs = [
        np.mean([max(SCORES[t, "isobn"][s]) - max(SCORES[t, "none"][s]) for t in ("stsb", "rte")])
        for s in (1, 2, 3, 4)
    ]
    assert avg["mean"] == pytest.approx(np.mean(diffs), abs=1e-12)
    assert (avg["boot_lo"], avg["boot_hi"]) == pytest.approx(_reference_ci(diffs), abs=1e-12)
    assert avg["p"] == pytest.approx(scipy.stats.ttest_1samp(diffs, 0.0).pvalue, rel=1e-9)
    # Isotropy before / after.
    iso = data["per_task"]["stsb"]["isotropy"]
    assert iso["pretrained"]["sentence_ev3"] == 0.12
    assert iso["isobn"]["pre_logits_ev3"] == pytest.approx(
        np.median([0.001 * s for s in range(1, 5)])
    )

    md_path = report.write_report(path)
    md = md_path.read_text()
    assert md_path == tmp_path / "fixture.md"
    for name in ("scores", "curves", "paired", "isotropy"):
        assert (tmp_path / f"fixture_{name}.png").stat().st_size > 1000
    none_last = [s[-1] for s in SCORES["stsb", "none"].values()]
    assert f"| stsb | none | 5 | {np.median(none_last):.3f} |" in md
    # STS-B: +0.03 on four seeds, t-test p = 0.005 (Holm over stsb, rte, average: 0.016), but
    # the sign-flip p cannot go below 2^-4 = 0.0625 with four seeds.
    claim = "IsoBN improves fine-tuning (best dev epoch, as the protocol)"
    assert (
        f"{claim}**: a family of 3 lines, Holm-adjusted over 3 (and again at the last epoch); "
        "the size: 'about +1.0' read as at least 0.010" in md
    )
    assert f"{claim}, stsb: **improves it: confirmed (parametric only); 'about +1.0': " in md
    assert "(isobn − none +0.0300, t 95 % [" in md
    assert "Holm p = 0.016; sign-flip p = 0.062 (one-sided, toward the claim; floor 2^-4" in md
    assert f"{claim}, rte: **improves it: not detected at this n; " in md
    # The average: t-test p = 0.044 alone, 0.087 after Holm.
    assert f"{claim}, average of the tasks: **improves it: not detected at this n; " in md
    # EV3 drops by 0.10: the direction confirmed, "a lot" (a drop of at least 0.10) undecided.
    assert (
        "IsoBN lowers EV3 of the classifier input (the paper: a lot), stsb: **lowers it: "
        "confirmed" in md
    )
    # IsoBN's EV3 shift (-0.10) beats batchnorm's (-0.04) on every shared seed (1-3).
    contrast = data["per_task"]["stsb"]["ev3_isobn_vs_batchnorm"]
    assert contrast["n"] == 3 and contrast["mean"] == pytest.approx(-0.06, abs=1e-12)
    assert "ev3_isobn_vs_batchnorm" not in data["per_task"]["rte"]  # no batchnorm arm
    assert (
        "IsoBN lowers EV3 of the classifier input more than batch normalisation does, stsb: "
        "**confirmed (parametric only)** (EV3 isobn − batchnorm -0.0600, t 95 %" in md
    )
    assert "pre-trained sentence vectors are anisotropic" in md and "**reversed**" in md
    assert "| rte-isobn-s5 | ValueError: config: bad |" in md
    assert "10000 resamples" in md and "no verdict rests on the bootstrap" in md


def test_pooled_normalisation_by_hand_leaves_out_a_task_at_chance(tmp_path):
    """CoLA (chance 0): none 0.20, 0.25, 0.30 (median 0.25), isobn 0.30, 0.20, 0.35 -> 1.2, 0.8,
    1.4. STS-B (chance 0): none median 0.80, isobn 0.88, 0.84, 0.76 -> 1.1, 1.05, 0.95. RTE: the
    none median 0.56 is within 1/√277 = 0.060 of chance 146/277 = 0.527: left out and named.
    IQM of isobn's six values: sorted 0.8, 0.95, 1.05, 1.1, 1.2, 1.4, one cut from each end,
    mean(0.95, 1.05, 1.1, 1.2) = 1.075."""
    records = _pooled_records(
        {
            ("cola", "none"): [0.20, 0.25, 0.30],
            ("cola", "isobn"): [0.30, 0.20, 0.35],
            ("stsb", "none"): [0.70, 0.80, 0.90],
            ("stsb", "isobn"): [0.88, 0.84, 0.76],
            ("rte", "none"): [0.55, 0.56, 0.57],
            ("rte", "isobn"): [0.58, 0.54, 0.60],
        }
    )
    pooled = report.build(records)["pooled"]
    assert pooled["kind"] == "best" and pooled["normalised_tasks"] == ["cola", "stsb"]
    assert pooled["excluded"] == {"rte": pytest.approx(0.56, abs=1e-12)}
    isobn = pooled["arms"]["isobn"]
    assert isobn["tasks"] == ["cola", "stsb", "rte"]
    np.testing.assert_allclose(isobn["normalised"][0], [1.2, 0.8, 1.4], rtol=0, atol=1e-12)
    np.testing.assert_allclose(isobn["normalised"][1], [1.1, 1.05, 0.95], rtol=0, atol=1e-12)
    assert isobn["iqm"]["iqm"] == pytest.approx(1.075, abs=1e-12)
    md = report.write_report(_write(tmp_path, "hand", records)).read_text()
    assert "rte (median 0.560, chance 0.527, 1/√277 = 0.060)" in md
    assert "| isobn | cola, stsb, rte | 3, 3, 3 |" in md and "1.075 [" in md
    assert (tmp_path / "hand_profile.png").stat().st_size > 1000


def test_a_figure_not_drawn_gets_no_empty_link(tmp_path):
    """A study whose only records are pre-trained rows draws no figure: its report names none
    (an empty `[isotropy]()` link fails the docs build), while a figure that exists is linked."""
    records = [r for r in _normalizers_records() if r["kind"] == "pretrained"]
    loaded = report_records.load(_write(tmp_path, "early", records))
    text = report.render(loaded, report.build(loaded), {}, "early")
    assert "]()" not in text and "Figure" not in text
    drawn = report.render(loaded, report.build(loaded), {"isotropy": "early_iso.png"}, "early")
    assert "Figure: [isotropy](early_iso.png)" in drawn


def test_training_loss_table_gives_each_epochs_median_and_range(tmp_path):
    """Per arm and epoch: the median and range of the runs' mean epoch losses (NumPy here); an
    epoch a run did not record is left out of that epoch only; no section without losses."""
    losses = {  # (method, seed) -> the run's train_loss_epoch losses
        ("none", 1): [0.69, 0.50], ("none", 2): [0.68, 0.40], ("none", 3): [0.75, 0.42],
        ("whiten", 1): [0.66, 0.67], ("whiten", 2): [0.65, 0.69], ("whiten", 3): [0.67],
    }  # fmt: skip
    records = []
    for (method, seed), by_epoch in losses.items():
        r = _record(f"mrpc-{method}-s{seed}", "mrpc", method, seed, [0.7, 0.8])
        r["train_loss_epoch"] = [{"epoch": e + 1, "loss": x} for e, x in enumerate(by_epoch)]
        records.append(r)
    arms = report.build(records)["per_task"]["mrpc"]["arms"]
    for method in ("none", "whiten"):
        for epoch in (1, 2):
            xs = [v[epoch - 1] for (m, _), v in losses.items() if m == method and len(v) >= epoch]
            got = arms[method]["train_loss"][epoch]
            assert got["n"] == len(xs) and got["median"] == pytest.approx(np.median(xs), abs=1e-12)
            assert (got["min"], got["max"]) == (min(xs), max(xs))
    md = _markdown(_write(tmp_path, "losses", records))  # the words: figures are drawn above
    section = md.split("## Training loss")[1].split("\n## ")[0]
    assert "| mrpc | none | 3 | 0.690 [0.680, 0.750] | 0.420 [0.400, 0.500] |" in section
    assert "| mrpc | whiten | 3 | 0.660 [0.650, 0.670] | 0.680 [0.670, 0.690] |" in section
    for r in records:
        r["train_loss_epoch"] = []
    md = _markdown(_write(tmp_path, "no_losses", records))
    assert "## Training loss" not in md
