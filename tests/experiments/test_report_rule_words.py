"""The rule's words beyond confirmed and reversed (experiments/report/rule.py and its helpers,
added by issues 47 and 48): the pooled test paired by seed against an exact enumeration written
here and SciPy's `permutation_test`, "smaller than claimed" under Holm, "equivalent within
±0.010", the epoch-sensitive flag, the NaN refusal, the model-bound wording, the
`whitening_why` families on a synthetic JSONL, and the forest plot."""

import itertools
import json
import math

import numpy as np
import pytest
import scipy.stats
from report_data import _markdown

from experiments.report import findings, numbers, pooled_lines, rule, sizes, stats
from experiments.report import page as report
from experiments.report import pooled as pool
from experiments.report import records as report_records


def _enumerated(diffs, direction) -> float:
    """The sign-flip p by listing every pattern: one-sided (±1) or two-sided (0)."""
    d = np.asarray(diffs, np.float64)
    observed = d.sum()
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=len(d)):
        s = float(np.dot(signs, np.abs(d)))
        tol = 1e-12 * np.abs(d).sum()
        if direction == 0:
            hits += abs(s) >= abs(observed) - tol
        else:
            hits += direction * s >= direction * observed - tol
    return hits / 2 ** len(d)


# The layer-norm and re-centring best-epoch differences of issue 48's 12 (task, seed) pairs are
# the audit's; here: fixed samples with both signs, with ties and with one sign.
PAIRED = [
    [0.012, -0.004, 0.020, 0.007, -0.011, 0.015, 0.003, 0.009, -0.002, 0.018, 0.006, -0.007],
    [0.03, 0.03, -0.03, 0.01, 0.02],
    [0.004, 0.001, 0.003, 0.002, 0.005, 0.006],
]


@pytest.mark.parametrize("diffs", PAIRED)
@pytest.mark.parametrize("direction", [1, -1, 0])
def test_sign_flip_equals_an_enumeration_and_scipy_permutation_test(diffs, direction):
    got = stats.sign_flip_p(diffs, direction)
    assert got["method"] == f"exact, 2^{len(diffs)} patterns"
    assert got["p"] == pytest.approx(_enumerated(diffs, direction), abs=1e-15)
    # SciPy: the statistic mean(x − y) over pairs, permuting x and y within each pair.
    x = np.asarray(diffs, np.float64)
    alternative = {1: "greater", -1: "less", 0: "two-sided"}[direction]
    ref = scipy.stats.permutation_test(
        (x, np.zeros_like(x)),
        lambda a, b, axis: np.mean(a - b, axis=axis),
        permutation_type="samples",
        alternative=alternative,
        n_resamples=np.inf,
        vectorized=True,
    )
    assert got["p"] == pytest.approx(ref.pvalue, abs=1e-12)


def test_sign_flip_monte_carlo_above_the_exact_limit_says_so_and_matches_scipy():
    rng = np.random.default_rng(3)
    diffs = (rng.normal(0.004, 0.01, 40)).tolist()  # 40 pairs: 2^40 patterns, sampled
    got = stats.sign_flip_p(diffs, 1)
    assert got["method"] == "Monte Carlo, 100000 draws, default_rng(0)"
    x = np.asarray(diffs)
    ref = scipy.stats.permutation_test(
        (x, np.zeros_like(x)),
        lambda a, b, axis: np.mean(a - b, axis=axis),
        permutation_type="samples",
        alternative="greater",
        n_resamples=100_000,
        vectorized=True,
        rng=np.random.default_rng(1),
    )
    # Two samples of 1e5 patterns: within 5 binomial standard errors of each other.
    se = math.sqrt(ref.pvalue * (1 - ref.pvalue) / 1e5)
    assert abs(got["p"] - ref.pvalue) < 5 * se + 1e-4


def test_pooled_paired_differences_take_every_shared_task_seed():
    arm = [{1: 0.8, 2: 0.9, 3: 0.7}, {1: 0.5, 3: 0.6}]
    base = [{1: 0.7, 2: 0.95, 4: 0.1}, {1: 0.4, 2: 0.3, 3: 0.65}]
    got = pool.paired_differences(arm, base)
    np.testing.assert_allclose(got, [0.1, -0.05, 0.1, -0.05], rtol=0, atol=1e-15)


def _c(p_lo, p_hi, toward, against, diff_lo=-1.0, diff_hi=1.0, cluster=None, **bounds):
    """A pooled comparison's dict; the seed-clustered p values default to the pairs'."""
    cluster = (toward, against) if cluster is None else cluster
    return {"p_lo": p_lo, "p_hi": p_hi, "flip_toward": toward, "flip_against": against,
            "cluster_toward": cluster[0], "cluster_against": cluster[1],
            "diff_lo": diff_lo, "diff_hi": diff_hi} | bounds  # fmt: skip


@pytest.mark.parametrize(
    ("c", "margin", "expected"),
    [
        (_c(0.6, 0.9, 0.002, 0.99), None, "confirmed"),
        # P's interval clear of 0.5, the paired test not (issue 48's layer norm, p = 0.084).
        (_c(0.633, 0.950, 0.084, 0.92), None, "not detected with these runs"),
        # The pairs pass, the seeds not (issue 62's layer norm: 0.015 over the pairs, 0.094
        # with every task's difference of a seed flipped together).
        (_c(0.587, 0.845, 0.015, 0.985, cluster=(0.094, 0.938)), None,
         "not detected with these runs"),
        (_c(0.1, 0.4, 0.99, 0.01), None, "reversed"),
        (_c(0.1, 0.4, 0.99, 0.01, cluster=(1.0, 0.125)), None, "not detected with these runs"),
        (_c(0.1, 0.4, 0.99, 0.06), None, "not detected with these runs"),
        # The paired test alone passes but P's interval holds 0.5.
        (_c(0.45, 0.9, 0.001, 0.99), None, "not detected with these runs"),
        # Equivalence needs the interval inside ±m and both paired tests of "inside" (issue 62).
        (_c(0.45, 0.9, 0.001, 0.99, -0.009, 0.009, flip_inside=0.01, cluster_inside=0.016),
         0.010, "equivalent within ±0.010"),
        (_c(0.45, 0.9, 0.001, 0.99, -0.009, 0.009, flip_inside=0.01, cluster_inside=0.031),
         0.010, "not detected with these runs"),
        (_c(0.45, 0.9, 0.001, 0.99, -0.011, 0.009, flip_inside=0.01, cluster_inside=0.01),
         0.010, "not detected with these runs"),
        # Issue 62's iternorm − none: [+0.010, +0.031] rules equivalence out; the words of what
        # it tests are the caller's ("better").
        (_c(0.626, 0.960, 0.001, 0.999, 0.0102, 0.0309, cluster=(0.031, 1.0),
            flip_inside=0.903, cluster_inside=0.969), 0.010, "confirmed"),
    ],
)  # fmt: skip
def test_pooled_rule_needs_the_interval_and_both_paired_tests(c, margin, expected):
    assert pool.pooled_verdict(c, margin) == expected


@pytest.mark.parametrize(
    ("c", "expected"),
    [
        (_c(0.45, 0.9, 0.1, 0.9, -0.02, 0.009, flip_below=0.001, cluster_below=0.016,
            flip_above=0.99, cluster_above=0.99), "smaller"),
        # The seeds cannot reach 0.025 (five: floor 0.031).
        (_c(0.45, 0.9, 0.1, 0.9, -0.02, 0.009, flip_below=0.001, cluster_below=0.031,
            flip_above=0.99, cluster_above=0.99), "undecided"),
        (_c(0.45, 0.9, 0.1, 0.9, -0.02, 0.011, flip_below=0.001, cluster_below=0.001,
            flip_above=0.99, cluster_above=0.99), "undecided"),
        (_c(0.7, 0.9, 0.001, 0.99, 0.011, 0.03, flip_below=0.99, cluster_below=0.99,
            flip_above=0.001, cluster_above=0.016), "holds"),
    ],
)  # fmt: skip
def test_pooled_size_needs_the_interval_and_both_paired_tests(c, expected):
    assert pool.pooled_size_verdict(c, 0.010) == expected


def test_pooled_statistics_refuse_a_nan_score():
    with pytest.raises(ValueError, match=r"task 0, run 1 has the non-finite score nan"):
        pool.probability_of_improvement([[0.9, math.nan, 0.9], [0.9]], [[0.5, 0.5], [0.5]])
    with pytest.raises(ValueError, match="non-finite"):
        pool.iqm([[0.1, math.nan, 0.3, 0.4], [0.5, 0.6]])
    with pytest.raises(ValueError, match="non-finite"):
        pool.paired_differences([{1: math.nan}], [{1: 0.5}])


def _record(cell, task, method, seed, scores, study="fixture"):
    evals = [
        {"epoch": e + 1, "step": 10 * (e + 1), "split": "dev", "score": s, "pre_logits_ev3": 0.5}
        for e, s in enumerate(scores)
    ]
    return {
        "study": study, "cell": cell, "tier": 1, "kind": "run", "status": "ok", "error": None,
        "fields": {"task": task, "method": method, "seed": seed}, "seed": seed,
        "config_hash": "0" * 16, "git_commit": "a" * 40, "git_dirty": False,
        "device": "cpu cpu x1", "host": {"cpu": "AMD EPYC", "cores": 2},
        "config": {"model": "m", "num_epochs": 2}, "sweep": "", "baseline": {"method": "none"},
        "metric": "score", "eval": evals, "train_loss": [], "train_loss_epoch": [], "steps": 20,
        "wall_minutes": 1.0, "finished": "2026-12-01T00:00:00+00:00",
    }  # fmt: skip


def _write(tmp_path, name, records):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_nan_score_is_refused_in_one_line_naming_the_record(tmp_path, capsys):
    records = [_record(f"stsb-none-s{s}", "stsb", "none", s, [0.8, 0.81]) for s in (1, 2)]
    records[1]["eval"][1]["score"] = math.nan  # JSON allows NaN
    path = _write(tmp_path, "nan", records)
    with pytest.raises(report_records.RecordsError, match=r"nan.jsonl:2: .*'stsb-none-s2', eval "):
        report_records.load(path)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the score nan is not a finite number" in err
    records[1]["eval"] = []
    with pytest.raises(report_records.RecordsError, match="a finished run without a dev eval"):
        report_records.load(_write(tmp_path, "empty", records))


def _t(diffs):
    return numbers.paired(dict(enumerate(diffs)), dict.fromkeys(range(len(diffs)), 0.0))


def test_smaller_than_claimed_is_holm_adjusted_over_the_family():
    """Two lines whose t 95 % intervals each exclude +0.010 (one-sided p 0.014 alone, < 0.025)
    but not after Holm over a family of three (0.042, 0.042): "smaller than claimed" alone, "not
    detected" in the family; SciPy gives the one-sided p."""
    a, b = [0.004, 0.0, 0.008, -0.004, 0.006], [0.003, -0.002, 0.009, -0.001, 0.006]
    pa = scipy.stats.ttest_1samp(a, 0.010, alternative="less").pvalue
    pb = scipy.stats.ttest_1samp(b, 0.010, alternative="less").pvalue
    assert stats.t_below(a, 0.010) == pytest.approx(pa, rel=1e-10)
    assert stats.t_below(b, 0.010) == pytest.approx(pb, rel=1e-10)
    assert pa < 0.025 and pb < 0.025
    for diffs in (a, b):
        alone = rule.difference_verdict(_t(diffs), 0.5, +1, 0.010)
        assert alone["direction"] == "not detected at this n" and alone["size"] == "smaller"
    fam = rule.Family("claim", +1, size=0.010)
    wide = [0.03, -0.02, 0.05, 0.01, -0.01]  # interval holds +0.010: one-sided p large
    for where, diffs in (("a", a), ("b", b), ("wide", wide)):
        fam.add(where, _t(diffs), "x − y")
    judged = fam.judged()
    want = stats.holm([pa, pb, scipy.stats.ttest_1samp(wide, 0.010, alternative="less").pvalue])
    assert [v["below_holm"] for _, _, v in judged] == pytest.approx(want, rel=1e-10)
    assert min(want[:2]) > 0.025
    undecided = "the direction: not detected at this n; '+0.010': not decided at this n"
    assert [v["verdict"] for _, _, v in judged] == [undecided] * 3
    text = fam.render()[3]
    assert (
        f"'+0.010' (at least 0.010): one-sided t-test p of less than it = {pa:.3f} (Holm "
        f"{want[0]:.3f}), of more than it = " in text
    )
    # Direction −1: "smaller" means above −size.
    neg = rule.difference_verdict(_t([-x for x in a]), 0.5, -1, 0.010)
    assert neg["size"] == "smaller" and neg["below"] == pytest.approx(pa)


def test_equivalent_within_the_margin_needs_the_whole_interval_inside():
    inside = [0.002, -0.001, 0.003, 0.000, 0.001, -0.002]  # t 95 % about [-0.002, +0.003]
    astride = [0.012, -0.004, 0.008, 0.000, 0.010, -0.006]  # its interval reaches past +0.010
    for diffs, expected in ((inside, "equivalent within ±0.010"),
                            (astride, "not detected at this n")):  # fmt: skip
        t = _t(diffs)
        assert (-0.010 < t["lo"] and t["hi"] < 0.010) == (expected != "not detected at this n")
        upper = scipy.stats.ttest_1samp(diffs, 0.010, alternative="less").pvalue
        lower = scipy.stats.ttest_1samp(diffs, -0.010, alternative="greater").pvalue
        assert rule.equivalence_p(t, 0.010) == pytest.approx(max(upper, lower), rel=1e-10)
        got = rule.difference_verdict(_t(diffs), 1.0, +1, None, margin=0.010)
        assert got["verdict"] == expected
    # Inside but far from 0 with a tight interval: equivalent, before "confirmed".
    tight = [0.006, 0.0061, 0.0059, 0.006, 0.0062, 0.0058]
    assert rule.difference_verdict(_t(tight), 1e-6, +1, None, margin=0.010)["verdict"] == (
        "equivalent within ±0.010"
    )
    assert rule.difference_verdict(_t(tight), 1e-6, +1, None)["verdict"] == "confirmed"


def test_a_line_whose_last_epoch_verdict_differs_is_epoch_sensitive():
    best = [0.050, 0.051, 0.049, 0.050, 0.052, 0.048]  # confirmed
    last = [0.030, -0.020, 0.010, 0.000, 0.020, -0.010]  # not detected
    fam = rule.Family("claim", +1, epochs=("best", "last"))
    fam.add("stsb", _t(best), "a − b", other=_t(last))
    fam.add("rte", _t(best), "a − b", other=_t(best))
    lines = fam.render()
    assert "(and again at the last epoch)" in lines[1]
    assert lines[3].startswith("- claim, stsb: **confirmed, epoch-sensitive** (a − b +0.0500")
    assert "last epoch: not detected at this n (+0.0050 [" in lines[3]
    assert lines[4].startswith("- claim, rte: **confirmed** (")
    rows = fam.forest()
    assert [r["epoch_sensitive"] for r in rows] == [True, False]
    assert rows[0]["mean"] == pytest.approx(0.05) and rows[0]["verdict"] == "confirmed"


def _why_records(gaps: dict[str, float], seeds: int = 5) -> list[dict]:
    """The `whitening_why` arms on CoLA, MRPC and STS-B: score = base + gaps[arm] + a wobble,
    two epochs (the last 0.01 below the best for every arm but `iternorm-sg`, whose last epoch
    is 0.05 below)."""
    rng = np.random.default_rng(5)
    out = []
    for task, base in (("cola", 0.40), ("mrpc", 0.82), ("stsb", 0.86)):
        for method, gap in gaps.items():
            for seed in range(1, seeds + 1):
                best = base + gap + 0.002 * seed + float(rng.uniform(-0.001, 0.001))
                drop = 0.05 if method == "iternorm-sg" else 0.01
                out.append(_record(f"{task}-{method}-s{seed}", task, method, seed,
                                   [best, best - drop], "whitening_why"))  # fmt: skip
    return out


WHY_GAPS = {"none": 0.0, "whiten": -0.20, "iternorm": 0.001, "iternorm-sg": -0.10,
            "iternorm-g16": 0.0, "whiten-nodrop": -0.10, "whiten-a05": -0.199}  # fmt: skip


def test_whitening_why_families_contrast_named_arms(tmp_path):
    """Six seeds: the seed-clustered floor 2^-6 = 0.016 lets the pooled equivalence (both
    paired p of "inside" < 0.025) pass; five could not (0.031)."""
    path = _write(tmp_path, "whitening_why", _why_records(WHY_GAPS, 6))
    md = report.write_report(path).read_text()
    data = report.build(report_records.load(path))
    lines = [x for x in md.splitlines() if x.startswith("- [Whitening why]")]
    # 3 tasks + the pooled line per family, and iternorm − none's leave-one-task-out lines.
    assert len(lines) == 5 * 4 + 3
    grad = "[Whitening why] the gradient through the batch statistics helps: iternorm − iternorm-sg"
    assert f"**{grad}**: a family of 3 lines, Holm-adjusted over 3 (and again at the last" in md
    arms = data["per_task"]["mrpc"]["arms"]
    diffs = np.subtract(arms["iternorm"]["runs"]["best"], arms["iternorm-sg"]["runs"]["best"])
    ref = scipy.stats.ttest_1samp(diffs, 0.0)
    ci = ref.confidence_interval(0.95)
    line = next(x for x in lines if x.startswith(f"- {grad}, mrpc: "))
    assert (
        f"**confirmed** (iternorm − iternorm-sg {diffs.mean():+.4f}, t 95 % [{ci.low:+.4f}, "
        in (line)
    )
    pooled = next(x for x in lines if x.startswith(f"- {grad}, pooled over 3 tasks"))
    assert "**confirmed** (P(iternorm > iternorm-sg) = 1.000" in pooled
    assert "18 (task, seed) pairs, Monte Carlo, 100000 draws" in pooled
    assert "(6 seeds, every task's difference of a seed flipped together, exact" in pooled
    nodrop = "[Whitening why] the head's dropout noise hurts whiten: whiten-nodrop − whiten"
    assert f"- {nodrop}, stsb: **confirmed** (" in md
    shrink = "[Whitening why] shrinkage (α = 0.5) helps whiten: whiten-a05 − whiten"
    assert f"- {shrink}, cola: **" in md
    same = "[Whitening why] iternorm trains as well as none: iternorm − none"
    for where in ("cola", "mrpc", "stsb"):
        assert f"- {same}, {where}: **equivalent within ±0.010** (" in md
    assert f"- {same}, pooled over 3 tasks (cola, mrpc, stsb): **equivalent within ±0.010**" in md
    for out, rest in (("cola", "mrpc, stsb"), ("mrpc", "cola, stsb"), ("stsb", "cola, mrpc")):
        assert f"- {same}, leaving out {out}, pooled over 2 tasks ({rest}): **" in md
    groups = "[Whitening why] groups of 16 help: iternorm-g16 − iternorm"
    assert f"**{groups}**: a family of 3 lines" in md
    assert "host: AMD EPYC, 2 cores x126." in md
    assert (tmp_path / "whitening_why_forest.png").stat().st_size > 5000


def test_a_grid_without_the_arms_has_no_why_family(tmp_path):
    path = _write(tmp_path, "part", _why_records({"none": 0.0, "whiten": -0.2}, 3))
    md = _markdown(path)  # the words only
    assert "[Whitening why]" not in md


def test_findings_page_shows_whitening_why_where_its_jsonl_exists(tmp_path):
    results = tmp_path / "results"
    (results / "gpu").mkdir(parents=True)
    page = findings.build_page(results)
    assert "no verdict line: the `whitening_why` grid has no records yet" in page
    assert "![forest" not in page
    _write(results / "gpu", "whitening_why", _why_records(WHY_GAPS, 3))
    forest = tmp_path / "forest.png"
    page = findings.build_page(results, forest=forest)
    assert (
        "[gpu/whitening_why](../../experiments/results/gpu/whitening_why.md): [Whitening why]"
        in (page)
    )
    assert "**equivalent within ±0.010" in page and forest.stat().st_size > 5000
    assert "![forest plot of the fine-tuning verdict lines](findings_forest.png)" in page


def test_the_anisotropy_of_bert_base_holds_or_not_for_minilm(tmp_path):
    records = [_record("stsb-none-s1", "stsb", "none", 1, [0.8])]
    for ev3, word in ((0.1, "does not hold for MiniLM-L6"), (0.9, "holds for MiniLM-L6")):
        pre = _record("stsb-pretrained", "stsb", "pretrained", 1, [0.0])
        pre |= {"kind": "pretrained"}
        pre["eval"][0]["sentence_ev3"] = ev3
        md = report.render(records + [pre], report.build(records + [pre]), {}, "x")
        line = next(x for x in md.splitlines() if "pre-trained sentence vectors" in x)
        assert "tested on MiniLM-L6; " in line and f": **{word}** (pooled EV3 stsb " in line
        assert "**reversed**" not in line and "**confirmed**" not in line


def test_the_bootstrap_note_names_the_seeds_of_the_table(tmp_path):
    records = []
    for seed in range(1, 6):
        for method, shift in (("none", 0.0), ("isobn", 0.01)):
            records.append(_record(f"stsb-{method}-s{seed}", "stsb", method, seed,
                                   [0.8 + shift + 0.001 * seed]))  # fmt: skip
    md = report.render(records, report.build(records), {}, "x")
    assert "with n = 5 seeds the resampled mean takes at most C(2n − 1, n) values (126 at" in md
    assert "n = 3 seeds" not in md


def test_pooled_below_size_p_is_the_sign_flip_of_the_shifted_pairs():
    """ "smaller than claimed" pooled (issues 48, 62): the one-sided sign-flip p that the paired
    differences lie below the size, i.e. of d − size below 0, over the (task, seed) pairs and
    over the seeds (each seed's shifted differences summed over tasks), checked against an
    enumeration of the sign patterns."""
    diffs, size = [0.004, -0.012, 0.001, 0.006, -0.003], 0.010
    cells = [("a", 1, diffs[0]), ("a", 2, diffs[1]), ("b", 1, diffs[2]), ("b", 2, diffs[3]),
             ("b", 3, diffs[4])]  # fmt: skip
    got = pooled_lines.bound_tests({"paired_cells": cells}, sizes.Size("x", size), None)

    def enumerate_below(values):
        shifted = np.asarray(values)
        observed = -shifted.sum()
        patterns = itertools.product((-1.0, 1.0), repeat=len(values))
        hits = sum(-(np.asarray(s) * np.abs(shifted)).sum() >= observed - 1e-15 for s in patterns)
        return hits / 2 ** len(values)

    assert got["flip_below"] == pytest.approx(enumerate_below(np.subtract(diffs, size)), abs=0)
    seeds = [diffs[0] + diffs[2] - 2 * size, diffs[1] + diffs[3] - 2 * size, diffs[4] - size]
    assert got["cluster_below"] == pytest.approx(enumerate_below(seeds), abs=0)
    assert got["flip_below"] < 0.1
    assert "flip_below" not in pooled_lines.bound_tests({"paired_cells": cells}, None, None)
