"""Tests for the sweeps of experiments/report/ (sweeps): the collapse rule, Pearson /
Spearman r with and without collapsed runs against SciPy, and the lines of the CosReg lambda and
I-STAR zeta sweeps."""

import numpy as np
import pytest
import scipy.stats
from report_data import (
    _iso,
    _markdown,
    _record,
    _sweep_records,
    _write,
    _zeta_line,
    _zeta_records,
)

from experiments.report import page as report
from experiments.report import records as report_records


@pytest.mark.parametrize(
    ("base", "applied"), [(0.531, False), (0.5271 + 1 / 277**0.5 + 0.002, True)]
)
def test_collapse_rule_needs_a_baseline_that_beats_chance_by_its_noise(tmp_path, base, applied):
    """RTE (277 dev pairs, chance 0.5271): a lambda = 0 median within 1/sqrt(277) = 0.060 of
    chance leaves nothing to collapse from, so no run is counted collapsed and the line says
    why; a median just beyond it flags the run below halfway."""
    margin = 1 / 277**0.5
    assert report_records.chance_margin("rte") == pytest.approx(margin, abs=1e-15)
    assert report_records.beats_chance("rte", base) is applied
    records = []
    for weight, score in ((-5.0, 0.473), (0.0, base), (1.0, base + 0.01)):
        for seed in (1, 2):
            iso = _iso(seed) | {"tokens_isoscore": 0.1 * (weight + 6), "tokens_isoscore_star": 0.1}
            records.append(
                _record(
                    f"rte-istar-istar.weight={weight:g}-s{seed}",
                    "rte",
                    "istar",
                    seed,
                    [score, score + 0.001 * seed],
                    extra={"istar.weight": weight},
                    iso=iso,
                )
            )
    path = _write(tmp_path, "rte_sweep", records)
    sw = report.build(report_records.read_records(path))["per_task"]["rte"]["sweep"]
    assert sw["n_collapsed"] == (2 if applied else 0)
    assert [p["collapsed"] for p in sw["points"]] == [
        applied and p["value"] == -5.0 for p in sw["points"]
    ]
    md = _markdown(path)  # the words only: the sweep figure is drawn in the next test
    line = next(x for x in md.splitlines() if "isotropy (IsoScore) is negatively" in x)
    row = next(x for x in md.splitlines() if x.startswith("| rte | IsoScore |"))
    note = "collapse rule not applied: the baseline's median 0.532 is within 1/√277 = 0.060"
    if applied:
        assert note[:26] not in line and "without collapsed runs: r = " in line
        assert row.split(" | ")[8] == "2"
    else:
        assert note + " of chance 0.527" in line and "without collapsed" not in line
        assert row.split(" | ")[8] == "n/a"
    # Before any baseline run has landed (a grid in progress) the line says that instead.
    path = _write(tmp_path, "no_base", [r for r in records if r["fields"]["istar.weight"] != 0])
    line = next(x for x in _markdown(path).splitlines() if "isotropy (IsoScore) is negatively" in x)
    assert "collapse rule not applied: no baseline run yet" in line


def test_sweep_report_gives_scipy_pearson_with_and_without_collapsed_runs(tmp_path):
    records, points = _sweep_records()
    path = _write(tmp_path, "sweep", records)
    data = report.build(report_records.read_records(path))
    assert data["baseline"] == "istar lambda=0" and data["sweep"] == "istar.weight"
    sw = data["per_task"]["stsb"]["sweep"]
    assert sw["n_collapsed"] == 3
    assert [p["collapsed"] for p in sw["points"]] == [c for *_, c in points]
    for key, column in (("tokens_isoscore", 3), ("tokens_isoscore_star", 4)):
        x = np.array([p[column] for p in points])
        y = np.array([p[2] for p in points])
        kept = np.array([not p[5] for p in points])
        for name, mask in (("all", np.ones_like(kept)), ("without_collapsed", kept)):
            ref = scipy.stats.pearsonr(x[mask], y[mask])
            got = sw[key][name]
            assert got["n"] == mask.sum()
            assert got["r"] == pytest.approx(ref.statistic, abs=1e-12)
            assert got["r"] == pytest.approx(np.corrcoef(x[mask], y[mask])[0, 1], abs=1e-12)
            assert got["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    # With the collapsed runs: a positive r (low isotropy, low score); without: negative.
    assert sw["tokens_isoscore"]["all"]["r"] > 0.9
    assert sw["tokens_isoscore"]["without_collapsed"]["r"] < -0.8

    # Spearman and the leave-one-lambda-out range, against SciPy.
    x = np.array([p[3] for p in points])
    y = np.array([p[2] for p in points])
    got = sw["tokens_isoscore"]
    assert got["spearman"]["r"] == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert got["spearman"]["p"] == pytest.approx(scipy.stats.spearmanr(x, y).pvalue, rel=1e-9)
    weights = np.array([p[0] for p in points])
    loo = {w: np.corrcoef(x[weights != w], y[weights != w])[0, 1] for w in set(weights)}
    assert got["leave_one_out"]["min"] == pytest.approx(min(loo.values()), abs=1e-12)
    assert got["leave_one_out"]["max"] == pytest.approx(max(loo.values()), abs=1e-12)
    assert got["leave_one_out"]["argmin"] == -5.0

    md = report.write_report(path).read_text()
    assert (tmp_path / "sweep_sweep.png").stat().st_size > 1000
    # Pearson r = +0.91 (p < 0.001) over all runs, but leaving out lambda = -5 gives -0.89: one
    # value of the sweep decides the sign, so the line says "fragile" and why.
    line = next(x for x in md.splitlines() if "isotropy (IsoScore) is negatively" in x)
    assert "correlated with the metric, stsb: **fragile** (Pearson r = +0.912" in line
    assert "Pearson alone: reversed; leaving out the runs at -5 gives r = -0.891" in line
    assert "without collapsed runs: r = -0.891" in line
    assert "**[I-STAR] isotropy is negatively correlated with the metric**: a family of 2" in md
    # lambda = -5 loses 0.70 on every seed: reversed, but three seeds give sign-flip p >= 0.125.
    assert "λ < 0 helps, stsb, istar lambda=-5: **reversed (parametric only)**" in md
    assert "sign-flip p = 0.125 (one-sided, against the claim" in md
    assert "| stsb | IsoScore | 12 | +0.912 |" in md and "-0.677 / 0.001" in md
    assert "[-0.891 (-5 out), +0.980 (" in md


def test_cosreg_verdicts_read_the_last_layer_token_statistics(tmp_path):
    """CosReg λ = ±1 against λ = 0 over 3 seeds: λ = +1 lowers the last-layer token mean cosine
    on every seed (confirmed, parametric only at n = 3); λ = −1 grows the outlier dimension's
    |mean| on every seed (likewise); λ = +1 leaves the outlier alone (differences of both signs:
    not detected)."""
    cosine = {0.0: 0.50, 1.0: 0.20, -1.0: 0.52}
    outlier = {0.0: 10.0, 1.0: 10.0, -1.0: 25.0}
    records = []
    for weight in (0.0, 1.0, -1.0):
        for seed in (1, 2, 3):
            wobble = (seed - 2) * 0.5  # -0.5, 0, +0.5: both signs around λ = 0
            iso = _iso(seed) | {
                "last_tokens_mean_cosine": cosine[weight] + 0.01 * seed,
                "last_tokens_max_abs_mean": outlier[weight] + (wobble if weight == 1.0 else 0),
            }
            record = _record(f"rte-cosreg-w{weight}-s{seed}", "rte", "cosreg", seed,
                             [0.6, 0.6], extra={"cosreg.weight": weight}, iso=iso)  # fmt: skip
            record["sweep"], record["baseline"] = "cosreg.weight", {"cosreg.weight": 0.0}
            records.append(record)
    md = _markdown(_write(tmp_path, "cosreg", records))
    assert "λ = +1 lowers the last-layer token mean cosine, rte: **confirmed (parametric" in md
    assert "λ = -1 raises the |mean| of the outlier dimension, rte: **confirmed (parametric" in md
    assert "λ = +1 lowers the |mean| of the outlier dimension, rte: **not detected" in md
    assert "mean cosine (λ > 0 lowers, λ < 0 raises)**: a family of 2 lines" in md
    # The I-STAR paper's correlations belong beside I-STAR's sweep, not CosReg's.
    sweep_table = md.split("## Isotropy against the task score")[1].split("## Verdicts")[0]
    assert "| rte | IsoScore | 9 |" in sweep_table
    assert "BERT" not in sweep_table and "35 runs" not in sweep_table
    # A claim that nothing moves is not "confirmed" by a test that finds nothing.
    assert "λ = +1 leaves the token IsoScore alone, rte: **no change detected at this n**" in md

    # One seed gives no interval: the IsoScore line says so instead of "confirmed".
    one_seed = [r for r in records if r["seed"] == 1]
    md = _markdown(_write(tmp_path, "cosreg1", one_seed))
    assert "λ = +1 leaves the token IsoScore alone, rte: **not tested (n < 2: no interval)**" in md
    assert "confirmed" not in md.split("## Verdicts")[1].split("[CosReg]", 1)[1]


def test_zeta_sweep_tests_both_ends_against_every_zeta_inside(tmp_path):
    """ζ = 0 loses 0.05 and ζ = 1 loses 0.02 to every ζ in [0.2, 0.8] on every seed: each line
    confirmed (parametric only at 3 seeds, confirmed at 6), and so the best ζ lies inside; with
    ζ = 1 far ahead of every ζ inside, the best-ζ line says reversed."""
    offsets = {0.0: -0.05, 0.2: 0.0, 0.5: 0.004, 0.8: -0.001, 1.0: -0.02}
    records = _zeta_records(offsets, 3)
    md = _markdown(_write(tmp_path, "zeta3", records))
    data = report.build(records)
    assert data["baseline"] == "istar zeta=0.2" and data["sweep"] == "istar.zeta"
    hurts = "[I-STAR] ζ = 0 (plain IsoScore of the batch as the penalty) hurts"
    assert f"**{hurts}**: a family of 3 lines, Holm-adjusted over 3 (and again at the best" in md
    # One line against SciPy: ζ = 0 − ζ = 0.5, paired by seed.
    by = {(r["fields"]["istar.zeta"], r["seed"]): r["eval"][-1]["score"] for r in records}
    diffs = [by[0.0, s] - by[0.5, s] for s in (1, 2, 3)]
    ref = scipy.stats.ttest_1samp(diffs, 0.0)
    lo, hi = scipy.stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=scipy.stats.sem(diffs))
    line = _zeta_line(md, f"- {hurts}, stsb, against ζ = 0.5: ")
    assert "**confirmed (parametric only)** (ζ = 0 − ζ = 0.5 " in line
    assert f"{np.mean(diffs):+.4f}, t 95 % [{lo:+.4f}, {hi:+.4f}]; t-test p = " in line
    p_shown = float(line.split("t-test p = ")[1].split(",")[0])
    assert p_shown == pytest.approx(ref.pvalue, rel=0.02)
    ends = "is slightly worse than the optimum, stsb, against ζ = 0.8: **confirmed (parametric"
    assert ends in md
    best = _zeta_line(md, "- [I-STAR] the best ζ lies in [0.2, 0.8], stsb: ")
    assert "stsb: **confirmed (parametric only)** (" in best
    assert "the highest mean last-epoch score is at ζ = 0.5, inside the range" in best
    assert "**not tested here**" not in md  # that line belongs to the λ sweep

    md6 = _markdown(_write(tmp_path, "zeta6", _zeta_records(offsets, 6)))
    assert "stsb: **confirmed** (" in _zeta_line(md6, "- [I-STAR] the best ζ lies in")
    assert f"- {hurts}, stsb, against ζ = 0.2: **confirmed** (" in md6

    # ζ = 1 ahead of every ζ inside by about 0.05 on every seed: the claim is reversed.
    ahead = _markdown(_write(tmp_path, "ahead", _zeta_records(offsets | {1.0: 0.05}, 6)))
    best = _zeta_line(ahead, "- [I-STAR] the best ζ lies in")
    assert "stsb: **reversed** (" in best and "at ζ = 1, outside the range" in best
    # Without the ends there is nothing to test.
    lone = _zeta_records({0.2: 0.0, 0.5: 0.004}, 3)
    assert "stsb: **not tested (an end or the range has no runs)** (" in _zeta_line(
        _markdown(_write(tmp_path, "lone", lone)), "- [I-STAR] the best ζ lies in"
    )


def test_zeta_best_is_tested_against_the_other_zetas_inside(tmp_path):
    """ζ = 0.5 has the highest mean: its family holds ζ = 0.5 − ζ = 0.2 and − ζ = 0.8 (paired t
    as SciPy's), and the end lines against ζ = 0.5 are marked as against the best."""
    offsets = {0.0: -0.05, 0.2: 0.0, 0.5: 0.004, 0.8: -0.001, 1.0: -0.02}
    records = _zeta_records(offsets, 3)
    md = _markdown(_write(tmp_path, "zeta", records))
    best = "[I-STAR] the best ζ (the highest mean, picked on these runs) beats the other ζ in"
    assert f"**{best} [0.2, 0.8]**: a family of 2 lines, Holm-adjusted over 2 (and again" in md
    by = {(r["fields"]["istar.zeta"], r["seed"]): r["eval"][-1]["score"] for r in records}
    for z in (0.2, 0.8):
        diffs = [by[0.5, s] - by[z, s] for s in (1, 2, 3)]
        lo, hi = scipy.stats.t.interval(0.95, 2, loc=np.mean(diffs), scale=scipy.stats.sem(diffs))
        line = _zeta_line(md, f"- {best} [0.2, 0.8], stsb, ζ = 0.5 against ζ = {z:g}: **")
        assert f"(ζ = 0.5 − ζ = {z:g} {np.mean(diffs):+.4f}, t 95 % [{lo:+.4f}, {hi:+.4f}]" in line
    for end in ("ζ = 0 (plain IsoScore of the batch as the penalty) hurts", "optimum"):
        line = next(x for x in md.splitlines() if f"{end}, stsb, against ζ = 0.5:" in x)
        assert line.endswith("; against the best ζ (the highest mean))")
    # ζ = 1 far ahead: the best is an end, and its lines are the ζ = 1 family's.
    ahead = _markdown(_write(tmp_path, "ahead", _zeta_records(offsets | {1.0: 0.05}, 3)))
    assert best not in ahead
