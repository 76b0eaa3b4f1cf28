"""Tests for experiments/report.py and its modules: fixed small results JSONLs (written here)
give the medians, paired t intervals and p values, bootstrap intervals, Pearson / Spearman r and
verdicts that NumPy / SciPy give; the record loading refuses duplicated cells, mixed commits and
mixed devices with one line."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import scipy.stats
from helpers import REPO

_spec = importlib.util.spec_from_file_location("report", REPO / "experiments" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)
import report_records  # noqa: E402  (on sys.path once report.py is loaded)
import report_rule  # noqa: E402

# Dev score per (task, method, seed): [epoch 1, epoch 2]. isobn beats none on STS-B on every
# seed by 0.02-0.04 at both epochs; on RTE the differences change sign. isobn lacks seed 5.
SCORES = {
    ("stsb", "none"): {1: [0.70, 0.80], 2: [0.72, 0.78], 3: [0.69, 0.81], 4: [0.75, 0.79],
                       5: [0.70, 0.77]},
    ("stsb", "isobn"): {1: [0.74, 0.83], 2: [0.75, 0.81], 3: [0.72, 0.85], 4: [0.77, 0.81]},
    ("stsb", "batchnorm"): {1: [0.71, 0.79], 2: [0.73, 0.80], 3: [0.70, 0.80]},
    ("rte", "none"): {1: [0.55, 0.60], 2: [0.58, 0.57], 3: [0.52, 0.62], 4: [0.60, 0.59],
                      5: [0.53, 0.61]},
    ("rte", "isobn"): {1: [0.57, 0.58], 2: [0.55, 0.61], 3: [0.61, 0.60], 4: [0.58, 0.62]},
}  # fmt: skip
PRE_EV3 = {"stsb": 0.12, "rte": 0.15}


def _iso(seed: float, shift: float = 0.0) -> dict:
    return {
        "sentence_ev1": 0.05 + shift,
        "sentence_ev3": 0.10 + shift + 0.001 * seed,
        "sentence_isoscore": 0.3,
        "sentence_mean_cosine": 0.2 - shift,
        "pre_logits_ev1": 0.05,
        "pre_logits_ev3": 0.10 + 2 * shift + 0.001 * seed,
        "pre_logits_isoscore": 0.3,
        "tokens_isoscore": 0.05,
    }


def _record(cell, task, method, seed, scores, *, kind="run", status="ok", extra=None, iso=None):
    fields = {"task": task, "method": method, "seed": seed} | (extra or {})
    sweep = "istar.weight" if extra else ""
    evals = [
        {"epoch": e + 1, "step": 10 * (e + 1), "split": "dev", "score": s, **(iso or _iso(seed))}
        for e, s in enumerate(scores)
    ]
    return {
        "study": "fixture", "cell": cell, "tier": 1, "kind": kind, "status": status,
        "error": None if status == "ok" else "ValueError: config: bad", "fields": fields,
        "seed": seed, "config_hash": "0" * 16, "git_commit": "a" * 40, "git_dirty": False,
        "config": {"model": "m", "batch_size": 32, "max_length": 128, "buckets": [32, 64, 96],
                   "num_epochs": 2, "optimizer": {"learning_rate": 1e-4}},
        "sweep": sweep, "baseline": {"istar.weight": 0.0} if extra else {"method": "none"},
        "metric": "score", "eval": evals, "train_loss": [], "train_loss_epoch": [],
        "steps": 20, "wall_minutes": 1.5, "finished": "2026-11-30T19:00:00+00:00",
    }  # fmt: skip


def _normalizers_records() -> list[dict]:
    records = []
    for task, ev3 in PRE_EV3.items():
        iso = _iso(0) | {"sentence_ev3": ev3}
        records.append(_record(f"{task}-pretrained", task, "pretrained", 1, [0.0],
                               kind="pretrained", iso=iso))  # fmt: skip
    for (task, method), by_seed in SCORES.items():
        shift = {"none": 0.0, "batchnorm": -0.02, "isobn": -0.05}[method]
        for seed, scores in by_seed.items():
            records.append(
                _record(
                    f"{task}-{method}-s{seed}", task, method, seed, scores, iso=_iso(seed, shift)
                )
            )
    records.append(_record("rte-isobn-s5", "rte", "isobn", 5, [], status="failed"))
    return records


def _write(tmp_path, name, records) -> pathlib.Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


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
        "the paper's size: +0.010" in md
    )
    assert f"{claim}, stsb: **confirmed (parametric only)** (isobn − none +0.0300, t 95 % [" in md
    assert "Holm p = 0.016; sign-flip p = 0.062 (one-sided, toward the claim; floor 2^-4" in md
    assert f"{claim}, rte: **not detected at this n**" in md
    # The average: t-test p = 0.044 alone, 0.087 after Holm.
    assert f"{claim}, average of the tasks: **not detected at this n**" in md
    assert "IsoBN lowers EV3 of the classifier input (the paper: a lot), stsb: **confirmed" in md
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


def _sweep_records() -> tuple[list[dict], dict]:
    """I-STAR lambda x 3 seeds on STS-B; lambda = -5 collapses (score 0.10-0.14)."""
    rng = np.random.default_rng(7)
    records, points = [], []
    for weight in (-5.0, -1.0, 0.0, 1.0):
        for seed in (1, 2, 3):
            collapsed = weight == -5.0
            score = 0.12 + 0.02 * (seed - 2) if collapsed else 0.80 - 0.02 * weight + 0.01 * seed
            iso = float(
                0.005 if collapsed else 0.05 + 0.01 * weight + 0.003 * rng.standard_normal()
            )
            star = iso + 0.1
            values = _iso(seed) | {"tokens_isoscore": iso, "tokens_isoscore_star": star}
            records.append(
                _record(
                    f"stsb-istar-istar.weight={weight:g}-s{seed}",
                    "stsb",
                    "istar",
                    seed,
                    [score - 0.05, score],
                    extra={"istar.weight": weight},
                    iso=values,
                )
            )
            points.append((weight, seed, score, iso, star, collapsed))
    return records, points


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
    md = report.write_report(path).read_text()
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
    line = next(
        x
        for x in report.write_report(path).read_text().splitlines()
        if "isotropy (IsoScore) is negatively" in x
    )
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


def _paired_t(diffs: list[float]) -> dict:
    """A `report_numbers.paired` dict of these differences (through the module itself)."""
    return report.numbers.paired(dict(enumerate(diffs)), dict.fromkeys(range(len(diffs)), 0.0))


@pytest.mark.parametrize(
    "diffs, p_adj, direction, size, expected",
    [
        ([0.05, 0.051, 0.049], 0.001, +1, None, "confirmed (parametric only)"),
        ([0.05, 0.051, 0.049] * 2, 0.001, +1, None, "confirmed"),
        ([-0.05, -0.051, -0.049] * 2, 0.001, +1, None, "reversed"),
        ([-0.05, -0.051, -0.049] * 2, 0.001, -1, None, "confirmed"),
        ([0.05, 0.051, 0.049] * 2, 0.001, -1, None, "reversed"),
        ([0.05, 0.051, 0.049] * 2, 0.2, +1, None, "not detected at this n"),
        # The paper's size outside the interval, 0 inside: smaller than claimed.
        ([0.0046, 0.0009, 0.0034], 0.5, +1, 0.010, "smaller than claimed"),
        ([-0.0046, -0.0009, -0.0034], 0.5, -1, 0.010, "smaller than claimed"),
        ([0.0046, 0.0009, 0.0034], 0.5, +1, 0.005, "not detected at this n"),
        # Significant but below the size: confirmed wins (the line says the size is excluded).
        ([0.003, 0.0031, 0.0029] * 2, 0.001, +1, 0.010, "confirmed"),
        ([0.1], float("nan"), +1, 0.010, "not tested (n < 2: no interval)"),
    ],
)
def test_difference_verdict_rule(diffs, p_adj, direction, size, expected):
    got = report_rule.difference_verdict(_paired_t(diffs), p_adj, direction, size)
    assert got["verdict"] == expected


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
    md = report.write_report(_write(tmp_path, "cosreg", records)).read_text()
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


def _markdown(path: pathlib.Path) -> str:
    """The report's Markdown from the JSONL, through the report's loading (no figures)."""
    records = report_records.load(path)
    return report.render(records, report.build(records), {}, path.stem)


def _two_arm_records(diffs: list[float], task: str = "stsb") -> list[dict]:
    """`none` and `isobn` on one task, one epoch, isobn − none = `diffs` by seed."""
    records = []
    for seed, d in enumerate(diffs, 1):
        base = 0.85 + 0.001 * seed
        records.append(_record(f"{task}-none-s{seed}", task, "none", seed, [base]))
        records.append(_record(f"{task}-isobn-s{seed}", task, "isobn", seed, [base + d]))
    return records


CLAIM = "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol), stsb"


def test_stsb_isobn_differences_are_smaller_than_claimed_not_confirmed(tmp_path):
    """The committed STS-B IsoBN − none differences: every seed positive, so the old bootstrap
    rule said "confirmed"; the t interval [-0.0017, +0.0077] holds 0 and excludes +0.010."""
    md = _markdown(_write(tmp_path, "stsb", _two_arm_records([0.0046, 0.0009, 0.0034])))
    line = next(x for x in md.splitlines() if x.startswith(f"- {CLAIM}"))
    assert f"{CLAIM}: **smaller than claimed** (isobn − none +0.0030, t 95 % " in line
    assert "t 95 % [-0.0017, +0.0077]; " in line
    assert "t-test p = 0.113, Holm p = 0.113; sign-flip p = 0.125 (one-sided, toward" in line
    below = scipy.stats.ttest_1samp([0.0046, 0.0009, 0.0034], 0.010, alternative="less").pvalue
    assert (
        f"floor 2^-3 = 0.125); n = 3; below the paper's +0.010: one-sided t-test p = "
        f"{below:.3f}, Holm p = {below:.3f}; the interval excludes it; last epoch: " in line
    )
    assert "a family of 1 line, Holm-adjusted over 1 (and again at the last epoch); the " in md


def test_near_equal_differences_are_parametric_only_at_three_seeds_confirmed_at_six(tmp_path):
    md3 = _markdown(_write(tmp_path, "three", _two_arm_records([0.050, 0.051, 0.049])))
    assert f"{CLAIM}: **confirmed (parametric only)** (isobn − none +0.0500" in md3
    assert "sign-flip p = 0.125" in md3
    md6 = _markdown(_write(tmp_path, "six", _two_arm_records([0.050, 0.051, 0.049] * 2)))
    assert f"{CLAIM}: **confirmed** (isobn − none +0.0500" in md6
    assert "sign-flip p = 0.016 (one-sided, toward the claim; floor 2^-6 = 0.016)" in md6


def test_holm_adjusts_over_the_lines_of_one_claim(tmp_path):
    """Two tasks, each t-test p ~0.03 alone: Holm over the family (two tasks and their average)
    lifts them above 0.05, so neither is confirmed, and the family names its size."""
    records = _two_arm_records([0.010, 0.012, 0.016], "stsb")
    records += _two_arm_records([0.010, 0.012, 0.016], "rte")
    md = _markdown(_write(tmp_path, "holm", records))
    p_one = scipy.stats.ttest_1samp([0.010, 0.012, 0.016], 0.0).pvalue
    assert 0.01 < p_one < 0.05
    assert "IsoBN improves fine-tuning (best dev epoch, as the protocol)**: a family of 3" in md
    line = next(x for x in md.splitlines() if x.startswith(f"- {CLAIM}"))
    assert f"t-test p = {p_one:.3f}, Holm p = {min(1.0, 3 * p_one):.3f}" in line
    assert "**not detected at this n**" in line


def test_a_duplicated_cell_is_refused_naming_both_lines(tmp_path, capsys):
    records = _normalizers_records()
    path = _write(tmp_path, "twice", records + records)  # a JSONL concatenated with itself
    n = len(records)
    with pytest.raises(report_records.RecordsError, match=rf"twice.jsonl:{n + 1}: cell "):
        report_records.load(path)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is recorded already at line 1" in err
    assert not (tmp_path / "twice.md").exists()


def test_a_missing_file_a_bad_line_or_a_record_without_its_keys_is_one_line(tmp_path, capsys):
    good = json.dumps(_normalizers_records()[0])
    for name, text, expected in (
        ("bad", good + "\n{oops\n", "bad.jsonl:2: not JSON"),
        ("keys", good + '\n{"cell": "x", "kind": "run"}\n', "keys.jsonl:2: not a study record "
         "(no 'status', 'fields', 'seed', 'eval')"),
        ("empty", "\n", "empty.jsonl: no records"),
    ):  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text(text)
        assert report.main([str(tmp_path / f"{name}.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert report.main([str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl: no such results file" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["commit", "dirty"])
def test_mixed_commits_or_a_dirty_tree_are_refused_unless_allowed(tmp_path, capsys, change):
    records = _normalizers_records()
    if change == "commit":
        records[3]["git_commit"] = "b" * 40
        expected = r"records from 2 commits \(aaaaaaaaaa x\d+; bbbbbbbbbb x1\)"
    else:
        records[3]["git_dirty"] = True
        expected = r"records from 2 commits \(aaaaaaaaaa x\d+; aaaaaaaaaa \(dirty\) x1\)"
    path = _write(tmp_path, "mixed", records)
    with pytest.raises(report_records.RecordsError, match=expected):
        report_records.load(path)
    assert report.main([str(path)]) == 2
    assert "--allow-mixed-commits" in capsys.readouterr().err
    assert not (tmp_path / "mixed.md").exists()
    records = report_records.load(path, allow_mixed_commits=True)
    md = report.render(records, report.build(records), {}, "mixed")
    assert "**Mixed commits** (`--allow-mixed-commits`)" in md
    # Every record dirty (one commit): refused too.
    for r in records:
        r |= {"git_commit": "a" * 40, "git_dirty": True}
    with pytest.raises(report_records.RecordsError, match=r"a dirty tree"):
        report_records.load(_write(tmp_path, "dirty", records))


def test_header_names_devices_and_a_mixed_jsonl_is_refused_unless_allowed(tmp_path, capsys):
    records = _normalizers_records()
    for r in records:
        r |= {"device": "cpu cpu x1", "jax_version": "0.10.2"}
    md = report.render(records, report.build(records), {}, "one")
    n = len(records)
    unknown = "CPU model and cores not recorded"
    assert f"device: cpu cpu x1 (jax 0.10.2) x{n}; host: {unknown} x{n}." in md
    records[0]["host"] = {"cpu": "AMD EPYC", "cores": 2}
    md = report.render(records, report.build(records), {}, "one")
    assert f"host: AMD EPYC, 2 cores x1, CPU model and cores not recorded x{n - 1}." in md
    assert "Mixed devices" not in md and "Mixed commits" not in md

    # One GPU line among CPU lines: refused with one line, naming the file and both devices.
    records[1] |= {"device": "gpu NVIDIA H200 x1", "jax_version": "0.11.2"}
    records[2].pop("jax_version")
    path = _write(tmp_path, "mixed", records)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "mixed.jsonl: records from 2 devices (cpu cpu x1 x" in err
    assert not (tmp_path / "mixed.md").exists()
    assert report.main([str(path), "--allow-mixed-devices"]) == 0
    md = (tmp_path / "mixed.md").read_text()
    assert "gpu NVIDIA H200 x1 (jax 0.11.2) x1" in md
    assert "cpu cpu x1 (jax not recorded) x1" in md
    assert "**Mixed devices**" in md


def test_help_names_a_results_file_that_exists(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    out = capsys.readouterr().out
    named = [w.rstrip(".,)") for w in out.split() if ".jsonl" in w]
    assert named and all((REPO / w).is_file() for w in named), named


def _zeta_records(offsets: dict[float, float], seeds: int) -> list[dict]:
    """I-STAR's ζ swept on STS-B: score = 0.85 + offsets[ζ] + a small per-run wobble."""
    records = []
    for seed in range(1, seeds + 1):
        for i, (zeta, offset) in enumerate(offsets.items()):
            wobble = np.random.default_rng(10 * seed + i).uniform(-0.002, 0.002)
            score = 0.85 + 0.002 * seed + offset + wobble
            record = _record(f"stsb-istar-zeta={zeta:g}-s{seed}", "stsb", "istar", seed,
                             [score - 0.05, score], extra={"istar.zeta": zeta})  # fmt: skip
            record["sweep"], record["baseline"] = "istar.zeta", {"istar.zeta": 0.2}
            records.append(record)
    return records


def _zeta_line(md: str, start: str) -> str:
    return next(x for x in md.splitlines() if x.startswith(start))


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


@pytest.mark.parametrize("task", ["cola", "mrpc", "rte"])
def test_constant_scores_are_sklearns_scores_of_one_class_on_the_real_dev_labels(task, glue_dir):
    """`constant_scores(task)[c]` is the task's dev score (scikit-learn) of predicting class c
    for every dev example of the local TSV, and `CHANCE` is the best of them."""
    import sklearn.metrics

    from isojax.data import glue

    labels = np.array([e.label for e in glue.load_tsv(glue_dir, task, "dev")])
    assert tuple(np.bincount(labels)) == report_records.DEV_CLASS_COUNTS[task]
    assert len(labels) == report_records.DEV_SIZE[task]
    expected = []
    for c in range(2):
        pred = np.full_like(labels, c)
        if task == "cola":
            expected.append(sklearn.metrics.matthews_corrcoef(labels, pred))
        elif task == "mrpc":
            f1 = sklearn.metrics.f1_score(labels, pred, zero_division=0.0)
            expected.append((sklearn.metrics.accuracy_score(labels, pred) + f1) / 2)
        else:
            expected.append(sklearn.metrics.accuracy_score(labels, pred))
    np.testing.assert_allclose(report_records.constant_scores(task), expected, rtol=0, atol=1e-12)
    assert report_records.CHANCE[task] == max(expected)
    assert report_records.constant_scores("stsb") == () and report_records.CHANCE["stsb"] == 0.0


def test_evaluations_at_a_constant_prediction_are_counted_per_arm(tmp_path):
    """RTE: an evaluation at 146/277 or 131/277 (to 1e-6) counts, 0.53 does not; the epochs
    before the last and the last epochs are counted apart, per arm, and STS-B has no row."""
    major, minor = 146 / 277, 131 / 277
    records = [
        _record("rte-none-s1", "rte", "none", 1, [major, 0.58]),
        _record("rte-none-s2", "rte", "none", 2, [0.53, minor + 5e-7]),
        _record("rte-isobn-s1", "rte", "isobn", 1, [minor, major]),
        _record("rte-isobn-s2", "rte", "isobn", 2, [major + 1e-5, 0.60]),
        _record("stsb-none-s1", "stsb", "none", 1, [0.0, 0.80]),
    ]
    assert report_records.at_constant_prediction(records[1]) == [False, True]
    data = report.build(records)
    arms = data["per_task"]["rte"]["arms"]
    assert arms["none"]["constant"] == {"earlier": (1, 2), "last": (1, 2)}
    assert arms["isobn"]["constant"] == {"earlier": (1, 2), "last": (1, 2)}
    assert "constant" not in data["per_task"]["stsb"]["arms"]["none"]
    md = report.write_report(_write(tmp_path, "constant", records)).read_text()
    assert "(rte 0.527 / 0.473)" in md
    section = md.split("## Evaluations at a constant prediction's score")[1].split("\n## ")[0]
    assert "| rte | none | 1 of 2 | 1 of 2 |" in section
    assert "| rte | isobn | 1 of 2 | 1 of 2 |" in section and "| stsb |" not in section


def _pooled_records(scores: dict[tuple[str, str], list[float]]) -> list[dict]:
    """One epoch per run: scores[task, method][seed - 1]."""
    return [
        _record(f"{task}-{method}-s{seed}", task, method, seed, [score])
        for (task, method), by_seed in scores.items()
        for seed, score in enumerate(by_seed, 1)
    ]


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


POOLED_CLAIM = "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol), pooled over"
NONE = [0.800, 0.802, 0.804]


@pytest.mark.parametrize(
    ("isobn", "expected"),
    [
        # Every isobn run above every none run on both tasks: P = 1 on every resample.
        ([0.830, 0.832, 0.834], "confirmed"),
        ([0.770, 0.772, 0.774], "reversed"),
        # Interleaved within 0.003: P's interval holds 0.5, the difference's lies below +0.010.
        ([0.801, 0.803, 0.799], "smaller than claimed"),
        # Runs spread by 0.1: P's interval holds 0.5 and the difference's holds +0.010.
        ([0.700, 0.950, 0.760], "not detected with these runs"),
    ],
)
def test_pooled_rule_gives_each_verdict_on_a_constructed_jsonl(tmp_path, isobn, expected):
    spread = {"none": NONE, "isobn": isobn}
    if expected == "not detected with these runs":
        spread["none"] = [0.70, 0.80, 0.90]
    records = _pooled_records(
        {
            (task, m): [s + shift for s in v]
            for task, shift in (("stsb", 0.0), ("cola", -0.5))
            for m, v in spread.items()
        }  # fmt: skip
    )
    md = _markdown(_write(tmp_path, "rule", records))
    line = next(x for x in md.splitlines() if x.startswith(f"- {POOLED_CLAIM}"))
    assert f"pooled over 2 tasks (cola, stsb): **{expected}** (P(isobn > none) = " in line
    assert "n = 3 isobn / 3 none runs on each of 2 tasks; 2000 draws, RandomState(0); " in line
    # The paired test: 6 (task, seed) pairs, exact, its floor 2^-6 = 0.016 below 0.05.
    assert "(one-sided, 6 (task, seed) pairs, exact, 2^6 patterns)" in line
    assert "pooling treats the tasks named on the line as a sample of the benchmark" in md


def test_recenter_and_layernorm_get_per_task_and_pooled_lines(tmp_path):
    scores = {}
    for task, shift in (("stsb", 0.0), ("mrpc", 0.02)):
        scores[task, "none"] = [0.80 + shift, 0.81 + shift, 0.82 + shift]
        scores[task, "recenter"] = [0.83 + shift, 0.84 + shift, 0.85 + shift]
        scores[task, "layernorm"] = [0.79 + shift, 0.80 + shift, 0.815 + shift]
    md = _markdown(_write(tmp_path, "norms", _pooled_records(scores)))
    for name, pooled in (("re-centring", "confirmed"), ("layer-normalising", "not detected")):
        claim = f"[EmbNorm] {name} the sentence vector improves it"
        assert f"**{claim}**: a family of 3 lines" in md
        for where in ("mrpc", "stsb", "average of the tasks"):
            assert f"- {claim}, {where}: **" in md
        assert f"- {claim}, pooled over 2 tasks (mrpc, stsb): **{pooled}" in md


def test_pooled_lambda_lines_name_the_arm(tmp_path):
    records, _ = _sweep_records()
    rte = [
        r | {"fields": r["fields"] | {"task": "rte"}, "cell": "rte" + r["cell"]} for r in records
    ]
    md = _markdown(_write(tmp_path, "two", records + rte))
    line = next(x for x in md.splitlines() if "λ < 0 helps, istar lambda=-5, pooled" in x)
    assert "pooled over 2 tasks (stsb, rte): **reversed** (P(istar lambda=-5 > istar " in line
    assert "task-averaged difference (last epoch) -0.7" in line


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
    md = report.write_report(_write(tmp_path, "losses", records)).read_text()
    section = md.split("## Training loss")[1].split("\n## ")[0]
    assert "| mrpc | none | 3 | 0.690 [0.680, 0.750] | 0.420 [0.400, 0.500] |" in section
    assert "| mrpc | whiten | 3 | 0.660 [0.650, 0.670] | 0.680 [0.670, 0.690] |" in section
    for r in records:
        r["train_loss_epoch"] = []
    md = report.write_report(_write(tmp_path, "no_losses", records)).read_text()
    assert "## Training loss" not in md
