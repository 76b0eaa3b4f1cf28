"""Tests for experiments/report.py: fixed small results JSONLs (written here) give the medians,
paired bootstrap intervals, Pearson r and verdicts that NumPy / SciPy give."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import scipy.stats

REPO = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("report", REPO / "experiments" / "report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

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
    data = report.build(report.read_records(path))
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
            assert (p[kind]["lo"], p[kind]["hi"]) == pytest.approx((lo, hi), abs=1e-12)
            # SciPy's percentile bootstrap (other draws) agrees within Monte-Carlo error.
            sp = scipy.stats.bootstrap(
                (np.array(diffs),), np.mean, n_resamples=10_000, method="percentile", random_state=1
            ).confidence_interval
            assert p[kind]["lo"] == pytest.approx(sp.low, abs=0.003)
            assert p[kind]["hi"] == pytest.approx(sp.high, abs=0.003)
        assert p["pre_logits_ev3"]["mean"] == pytest.approx(-0.10, abs=1e-12)
    # The average over both tasks, per seed.
    avg = data["task_average"]["isobn"]["best"]
    diffs = [
        np.mean([max(SCORES[t, "isobn"][s]) - max(SCORES[t, "none"][s]) for t in ("stsb", "rte")])
        for s in (1, 2, 3, 4)
    ]
    assert avg["mean"] == pytest.approx(np.mean(diffs), abs=1e-12)
    assert (avg["lo"], avg["hi"]) == pytest.approx(_reference_ci(diffs), abs=1e-12)
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
    assert "IsoBN improves fine-tuning (best dev epoch, as the protocol), stsb: **confirmed**" in md
    assert "IsoBN improves fine-tuning (best dev epoch, as the protocol), rte: **not detected" in md
    assert "IsoBN lowers EV3 of the classifier input (the paper: a lot), stsb: **confirmed**" in md
    # IsoBN's EV3 shift (-0.10) beats batchnorm's (-0.04) on every shared seed (1-3).
    contrast = data["per_task"]["stsb"]["ev3_isobn_vs_batchnorm"]
    assert contrast["n"] == 3 and contrast["mean"] == pytest.approx(-0.06, abs=1e-12)
    assert "ev3_isobn_vs_batchnorm" not in data["per_task"]["rte"]  # no batchnorm arm
    assert (
        "IsoBN lowers EV3 of the classifier input more than batch normalisation does, stsb: "
        "**confirmed** (EV3 isobn − batchnorm -0.060" in md
    )
    assert "pre-trained sentence vectors are anisotropic" in md and "**reversed**" in md
    assert "| rte-isobn-s5 | ValueError: config: bad |" in md
    assert "10000 resamples" in md


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


def test_sweep_report_gives_scipy_pearson_with_and_without_collapsed_runs(tmp_path):
    records, points = _sweep_records()
    path = _write(tmp_path, "sweep", records)
    data = report.build(report.read_records(path))
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

    md = report.write_report(path).read_text()
    assert (tmp_path / "sweep_sweep.png").stat().st_size > 1000
    assert "isotropy (IsoScore) is negatively correlated with the metric, stsb: **reversed**" in md
    assert "without collapsed runs: confirmed" in md
    assert "λ < 0 helps, stsb, istar lambda=-5: **reversed**" in md
    assert "| stsb | IsoScore | 12 |" in md and "-0.677 / 0.001" in md


@pytest.mark.parametrize(
    "lo, hi, direction, expected",
    [
        (0.01, 0.05, +1, "confirmed"),
        (-0.05, -0.01, +1, "reversed"),
        (-0.01, 0.05, +1, "not detected at this n"),
        (-0.05, -0.01, -1, "confirmed"),
        (0.01, 0.05, -1, "reversed"),
        (float("nan"), float("nan"), +1, "not detected at this n (no interval: n < 2)"),
    ],
)
def test_verdict_rule(lo, hi, direction, expected):
    assert report.verdict(lo, hi, direction) == expected


def test_cosreg_verdicts_read_the_last_layer_token_statistics(tmp_path):
    """CosReg λ = ±1 against λ = 0 over 3 seeds: λ = +1 lowers the last-layer token mean cosine
    on every seed (confirmed); λ = −1 grows the outlier dimension's |mean| on every seed
    (confirmed); λ = +1 leaves the outlier alone (differences of both signs: not detected)."""
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
    assert "λ = +1 lowers the last-layer token mean cosine, rte: **confirmed**" in md
    assert "λ = -1 raises the |mean| of the outlier dimension, rte: **confirmed**" in md
    assert "λ = +1 lowers the |mean| of the outlier dimension, rte: **not detected" in md
    # The I-STAR paper's correlations belong beside I-STAR's sweep, not CosReg's.
    sweep_table = md.split("## Isotropy against the task score")[1].split("## Verdicts")[0]
    assert "| rte | IsoScore | 9 |" in sweep_table
    assert "BERT" not in sweep_table and "35 runs" not in sweep_table
    assert "λ = +1 leaves the token IsoScore alone, rte: **confirmed (no change detected)**" in md

    # One seed gives no interval: the IsoScore line says so instead of "confirmed".
    one_seed = [r for r in records if r["seed"] == 1]
    md = report.write_report(_write(tmp_path, "cosreg1", one_seed)).read_text()
    assert "λ = +1 leaves the token IsoScore alone, rte: **not tested (no interval: n < 2)**" in md
    assert "confirmed" not in md.split("## Verdicts")[1].split("[CosReg]", 1)[1]


def test_header_names_devices_and_a_mixed_jsonl_is_refused_unless_allowed(tmp_path):
    records = _normalizers_records()
    for r in records:
        r |= {"device": "cpu cpu x1", "jax_version": "0.10.2"}
    md = report.render(records, report.build(records), {}, "one")
    assert f"device: cpu cpu x1 (jax 0.10.2) x{len(records)}." in md
    assert "Mixed devices" not in md

    # One GPU line among CPU lines: refused, naming the file and both devices.
    records[1] |= {"device": "gpu NVIDIA H200 x1", "jax_version": "0.11.2"}
    records[2].pop("jax_version")
    path = _write(tmp_path, "mixed", records)
    with pytest.raises(ValueError, match=r"mixed.jsonl: records from 2 devices \(cpu cpu x1 x"):
        report.main([str(path)])
    assert not (tmp_path / "mixed.md").exists()
    assert report.main([str(path), "--allow-mixed-devices"]) == 0
    md = (tmp_path / "mixed.md").read_text()
    assert "gpu NVIDIA H200 x1 (jax 0.11.2) x1" in md
    assert "cpu cpu x1 (jax not recorded) x1" in md
    assert "**Mixed devices**" in md
