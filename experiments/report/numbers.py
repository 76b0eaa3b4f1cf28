"""The numbers of a study report: `build(records)`, as nested dicts, and `paired`.

`build(records)` groups the finished runs by task and arm (an arm: the method and every other
varied field but the seed) and gives, as nested dicts:

- per task x arm: n, median, mean ± std (ddof 1) of the dev score at the last epoch and at the
  best dev epoch (the [IsoBN] protocol: evaluate after every epoch, keep the best; selected and
  reported on the same dev set, so optimistic);
- paired differences against the grid's baseline arm over the seeds both have (`paired`): the
  differences, their mean, paired t 95 % interval and two-sided p, and the percentile bootstrap
  interval (a figure only), for the score and the isotropy measures;
- the average over tasks per seed (the [IsoBN] "average of GLUE tasks" claim);
- isotropy before (the grid's step-0 "pretrained" rows) and after fine-tuning (median over
  seeds, last epoch);
- for a sweep (the grid's `sweep` field, e.g. I-STAR's lambda): per task, the all-layer token
  IsoScore and IsoScore* against the score: Pearson r and p with and without collapsed runs,
  Spearman ρ and p, and Pearson r with each swept value left out in turn.
"""

from __future__ import annotations

import collections
import math

import numpy as np

from experiments.report import pooled as pool
from experiments.report import stats
from experiments.report.records import (
    CHANCE,
    DEV_SIZE,
    PRETRAINED,
    arm_label,
    at_constant_prediction,
    beats_chance,
    best_score,
    chance_margin,
    collapsed,
    constant_scores,
    dev_rows,
    is_baseline,
    last_value,
    task_key,
    varied_fields,
)

ISOTROPY = (
    ("sentence_ev3", "EV3 pooled"),
    ("pre_logits_ev3", "EV3 head input"),
    ("sentence_mean_cosine", "mean cos pooled"),
    ("pre_logits_mean_cosine", "mean cos head input"),
    ("tokens_isoscore", "IsoScore tokens"),
    ("tokens_isoscore_star", "IsoScore* tokens"),
)
# The CosReg claim's quantities: last-layer tokens' mean cosine (its penalty) and the mean of
# their outlier dimension (max over dimensions of |mean|).
COSREG_KEYS = ("last_tokens_mean_cosine", "last_tokens_max_abs_mean")
PAIRED_KEYS = (
    "sentence_ev3",
    "pre_logits_ev3",
    "sentence_mean_cosine",
    "tokens_isoscore",
    *COSREG_KEYS,
)
SWEEP_KEYS = (("tokens_isoscore", "IsoScore"), ("tokens_isoscore_star", "IsoScore*"))


def paired(arm: dict[int, float], base: dict[int, float]) -> dict:
    """arm − base over the shared seeds: {"n", "seeds", "diffs", "mean", "lo", "hi" (paired t
    95 %), "p" (two-sided t-test), "boot_lo", "boot_hi" (percentile bootstrap)}."""
    seeds = sorted(set(arm) & set(base))
    diffs = [arm[s] - base[s] for s in seeds]
    boot = stats.bootstrap_ci(diffs)
    return {
        "n": len(seeds),
        "seeds": seeds,
        "diffs": diffs,
        **stats.t_test(diffs),
        "boot_lo": boot[0],
        "boot_hi": boot[1],
    }


# Pairs of arms compared directly, per task (`<metric>_<a>_vs_<b>`: a − b, paired by seed).
CONTRASTS = (("isobn", "batchnorm"), ("whiten", "isobn"))


def build(records: list[dict]) -> dict:
    """Every number of the report, as nested dicts (also what the tests check)."""
    runs = [r for r in records if r["kind"] == "run" and r["status"] == "ok"]
    pre = {r["fields"]["task"]: r for r in records if r["kind"] == PRETRAINED and r["eval"]}
    varied = varied_fields(runs)
    tasks = sorted({r["fields"]["task"] for r in runs}, key=task_key)
    arms: dict[str, dict[str, list[dict]]] = {t: collections.defaultdict(list) for t in tasks}
    baseline_label = None
    for r in runs:
        label = arm_label(r, varied)
        arms[r["fields"]["task"]][label].append(r)
        if is_baseline(r):
            baseline_label = label
    sweep = next((r["sweep"] for r in runs if r.get("sweep")), "")
    out = {"tasks": tasks, "varied": varied, "baseline": baseline_label, "per_task": {}}
    out["sweep"] = sweep
    for task in tasks:
        out["per_task"][task] = _task(task, arms[task], baseline_label, pre.get(task), sweep)
    out["task_average"] = _task_average(out, arms)
    if baseline_label and len(tasks) > 1:
        kind, other = ("last", "best") if sweep else ("best", "last")
        out["pooled"] = pooled(out, kind)
        out["pooled_other"] = pooled(out, other, with_iqm=False)
    return out


def _task(task: str, arms: dict, baseline: str | None, pre: dict | None, sweep: str) -> dict:
    """One task's numbers: per arm (label -> its runs in `arms`) its scores and isotropy
    medians, its paired differences with the baseline, the two-arm contrasts, the sweep."""
    t = {"arms": {}, "paired": {}, "isotropy": {}}
    labels = sorted(arms, key=lambda a: _arm_key(arms[a][0], a, baseline))
    for label in labels:
        rows = sorted(arms[label], key=lambda r: r["seed"])
        t["arms"][label] = {
            "last": stats.summary([last_value(r) for r in arms[label]]),
            "best": stats.summary([best_score(r) for r in arms[label]]),
            "seeds": [r["seed"] for r in rows],
            "runs": {"last": [last_value(r) for r in rows], "best": [best_score(r) for r in rows]},
        }
        t["arms"][label]["train_loss"] = _epoch_losses(arms[label])
        if constant_scores(task):
            t["arms"][label]["constant"] = _constant_counts(arms[label])
        t["isotropy"][label] = {
            key: float(np.median([last_value(r, key) for r in arms[label]])) for key, _ in ISOTROPY
        }
    if pre is not None:
        row = dev_rows(pre)[0]
        t["isotropy"][PRETRAINED] = {k: float(row.get(k, math.nan)) for k, _ in ISOTROPY}
    base_rows = arms.get(baseline, []) if baseline else []
    for label in labels:
        if label != baseline and base_rows:
            t["paired"][label] = _paired_with(arms[label], base_rows)
    # Contrasts between two arms: [IsoBN]'s (IsoBN lowers EV3 of the classifier input more
    # than batchnorm does) and the whitening study's (whiten against IsoBN: EV3 and score).
    for a, b in CONTRASTS:
        la, lb = arm_of(labels, a), arm_of(labels, b)
        if la and lb:
            for key, fn in (
                ("ev3", _metric("pre_logits_ev3")),
                ("score", best_score),
                ("score_last", last_value),
            ):
                t[f"{key}_{a}_vs_{b}"] = paired(_by_seed(arms[la], fn), _by_seed(arms[lb], fn))
    if sweep:
        base_median = t["arms"][baseline]["last"]["median"] if base_rows else math.nan
        t["sweep"] = _sweep([r for rows in arms.values() for r in rows], sweep, base_median)
    return t


def _paired_with(rows: list[dict], base_rows: list[dict]) -> dict:
    """An arm's runs against the baseline's, paired by seed: the scores and `PAIRED_KEYS`."""
    out = {
        "last": paired(_by_seed(rows, last_value), _by_seed(base_rows, last_value)),
        "best": paired(_by_seed(rows, best_score), _by_seed(base_rows, best_score)),
    }
    for key in PAIRED_KEYS:
        fn = _metric(key)
        out[key] = paired(_by_seed(rows, fn), _by_seed(base_rows, fn))
    return out


def _task_average(out: dict, arms: dict) -> dict:
    """The average over tasks per seed (the [IsoBN] "average of GLUE tasks" claim), over the
    tasks where both the arm and the baseline have runs (at least 2; a study where one task
    has only some arms, as RTE in `whitening_why`'s tier 3, averages the others' over the
    rest), at the seeds every one of them has: per arm paired with the baseline, its "last"
    and "best" differences and the "tasks" averaged."""
    tasks, base = out["tasks"], out["baseline"]
    average: dict = {}
    if not base or len(tasks) < 2:
        return average
    for label in dict.fromkeys(a for t in tasks for a in out["per_task"][t]["paired"]):
        mine = [t for t in tasks if label in arms[t] and base in arms[t]]
        if len(mine) < 2:
            continue
        for kind, fn in (("last", last_value), ("best", best_score)):
            arm_avg = _seed_average([_by_seed(arms[t][label], fn) for t in mine])
            base_avg = _seed_average([_by_seed(arms[t][base], fn) for t in mine])
            average.setdefault(label, {})[kind] = paired(arm_avg, base_avg)
        average[label]["tasks"] = mine
    return average


def pooled(data: dict, kind: str, with_iqm: bool = True) -> dict:
    """The pooled statistics (`pooled`) of every arm against the baseline over the tasks
    where both have runs, on the `kind` score ("best": the [IsoBN] protocol; "last": a sweep).
    The IQM (`with_iqm`) is of the normalised scores (score − chance) / (baseline median −
    chance), over the tasks whose baseline median beats chance by 1/√n_dev (`beats_chance`);
    the others are named in "excluded" (task -> baseline median)."""
    base, per_task = data["baseline"], data["per_task"]
    out = {"kind": kind, "arms": {}, "excluded": {}, "normalised_tasks": []}
    reference = {}
    for task in data["tasks"]:
        b = per_task[task]["arms"].get(base)
        if b and beats_chance(task, b[kind]["median"]):
            reference[task] = b[kind]["median"]
            out["normalised_tasks"].append(task)
        else:
            out["excluded"][task] = b[kind]["median"] if b else math.nan
    labels = dict.fromkeys(a for t in data["tasks"] for a in per_task[t]["arms"])
    for label in labels:
        tasks = [t for t in data["tasks"] if {label, base} <= set(per_task[t]["arms"])]
        if len(tasks) < 2:
            continue
        entry = {"tasks": tasks}
        if label != base:
            entry |= pooled_pair(data, label, base, kind)
        runs = [per_task[t]["arms"][label]["runs"][kind] for t in tasks if t in reference]
        entry["normalised_tasks"] = [t for t in tasks if t in reference]
        entry["normalised"] = [
            pool.normalise(r, CHANCE.get(t, 0.0), reference[t]).tolist()
            for r, t in zip(runs, entry["normalised_tasks"], strict=True)
        ]
        if entry["normalised"] and with_iqm:
            entry["iqm"] = pool.iqm_interval(entry["normalised"])
        out["arms"][label] = entry
    return out


def pooled_pair(
    data: dict, label: str, base: str, kind: str, among: list[str] | None = None
) -> dict:
    """`pooled.compare` of arm `label` against arm `base` on the `kind` score over the
    tasks where both have runs (of `among`, default every task: a leave-one-task-out line
    passes the others), with the paired tests (issues 48, 62: `paired_tests`); {"tasks": [...]}
    alone where fewer than 2 tasks have both."""
    arms = {t: data["per_task"][t]["arms"] for t in data["tasks"]}
    among = data["tasks"] if among is None else among
    tasks = [t for t in data["tasks"] if t in among and {label, base} <= set(arms[t])]
    if len(tasks) < 2:
        return {"tasks": tasks}

    def runs(name: str) -> list[list[float]]:
        return [arms[t][name]["runs"][kind] for t in tasks]

    def by_seed(name: str) -> list[dict]:
        return [
            dict(zip(arms[t][name]["seeds"], arms[t][name]["runs"][kind], strict=True))
            for t in tasks
        ]

    out = {"tasks": tasks, **pool.compare(runs(label), runs(base))}
    diffs = iter(pool.paired_differences(by_seed(label), by_seed(base)))  # refuses a NaN
    cells = [
        (task, s, next(diffs))
        for task, a, b in zip(tasks, by_seed(label), by_seed(base), strict=True)
        for s in sorted(set(a) & set(b))
    ]
    return out | paired_tests(cells)


def paired_tests(cells: list[tuple]) -> dict:
    """The paired tests of a pooled line from its (task, seed, arm − base) `cells`: over the
    (task, seed) pairs, "paired_n", "paired_diffs", "flip_toward" / "flip_against" (one-sided
    sign-flip p), "flip_method"; over the seeds (every task's difference of a seed flipped
    together, `pooled.seed_sums`), "cluster_n", "cluster_toward" / "cluster_against",
    "cluster_min_p" (2⁻ⁿ) and "cluster_method"; "seed_corr" (`pooled.within_seed_correlation`)
    and the cells themselves."""
    diffs = [d for _, _, d in cells]
    toward, against = stats.sign_flip_p(diffs, +1), stats.sign_flip_p(diffs, -1)
    seeds, sums = pool.seed_sums(cells)
    c_toward, c_against = stats.sign_flip_p(sums, +1), stats.sign_flip_p(sums, -1)
    return {
        "paired_n": len(diffs),
        "paired_diffs": diffs,
        "paired_cells": cells,
        "flip_toward": toward["p"],
        "flip_against": against["p"],
        "flip_method": toward["method"],
        "cluster_n": len(seeds),
        "cluster_toward": c_toward["p"],
        "cluster_against": c_against["p"],
        "cluster_min_p": c_toward["min_p"],
        "cluster_method": c_toward["method"],
        "seed_corr": pool.within_seed_correlation(cells),
    }


def _sweep(runs: list[dict], sweep: str, base_median: float) -> dict:
    """One task's sweep: the points, and per isotropy measure the correlations with the score."""
    flags = [collapsed(r, base_median) for r in runs]
    task = runs[0]["fields"]["task"] if runs else ""
    out = {"n_collapsed": int(sum(flags)), "points": [], "collapse_note": ""}
    if runs and not math.isfinite(base_median):
        out["collapse_note"] = "collapse rule not applied: no baseline run yet"
    elif runs and not beats_chance(task, base_median):
        out["collapse_note"] = (
            f"collapse rule not applied: the baseline's median {base_median:.3f} is within "
            f"1/√{DEV_SIZE.get(task, '?')} = {chance_margin(task):.3f} of chance "
            f"{CHANCE.get(task, 0.0):.3f}"
        )
    for r, flag in zip(runs, flags, strict=True):
        out["points"].append(
            {
                "value": r["fields"].get(sweep),
                "seed": r["seed"],
                "score": last_value(r),
                "best": best_score(r),
                "tokens_isoscore": last_value(r, "tokens_isoscore"),
                "tokens_isoscore_star": last_value(r, "tokens_isoscore_star"),
                "collapsed": flag,
            }
        )
    pts = out["points"]
    kept = [p for p in pts if not p["collapsed"]]
    for key, _ in SWEEP_KEYS:
        x, y, values = [p[key] for p in pts], [p["score"] for p in pts], [p["value"] for p in pts]
        both = stats.correlation(x, y, values)
        out[key] = {
            "all": both["pearson"],
            "spearman": both["spearman"],
            "leave_one_out": both["leave_one_out"],
            "without_collapsed": stats.pearson([p[key] for p in kept], [p["score"] for p in kept]),
        }
    return out


def _epoch_losses(rows: list[dict]) -> dict[int, dict]:
    """Epoch (1-based) -> the runs' mean training losses of that epoch: `summary` plus "min"
    and "max" over the runs (the loss the optimiser minimised: the task loss plus any
    penalty)."""
    by_epoch: dict[int, list[float]] = {}
    for r in rows:
        for e in r.get("train_loss_epoch") or []:
            by_epoch.setdefault(e["epoch"], []).append(e["loss"])
    return {
        epoch: stats.summary(losses) | {"min": min(losses), "max": max(losses)}
        for epoch, losses in sorted(by_epoch.items())
    }


def _constant_counts(rows: list[dict]) -> dict:
    """How many of the arm's dev evaluations sit at a constant prediction's score
    (`at_constant_prediction`): `{"earlier": (k, m)}` over the epochs before each run's last,
    `{"last": (k, n)}` over the runs' last epochs."""
    flags = [at_constant_prediction(r) for r in rows]
    earlier = [x for f in flags for x in f[:-1]]
    last = [f[-1] for f in flags if f]
    return {"earlier": (sum(earlier), len(earlier)), "last": (sum(last), len(last))}


def _metric(key: str):
    return lambda r: last_value(r, key)


def arm_of(labels, method: str) -> str | None:
    """The arm label of `method` (its first word), if the task has one."""
    return next((label for label in labels if label.split()[0] == method), None)


def _by_seed(rows: list[dict], fn) -> dict[int, float]:
    return {r["seed"]: fn(r) for r in rows}


def _seed_average(per_task: list[dict[int, float]]) -> dict[int, float]:
    seeds = set.intersection(*(set(d) for d in per_task))
    return {s: float(np.mean([d[s] for d in per_task])) for s in seeds}


def _arm_key(record: dict, label: str, baseline: str | None) -> tuple:
    values = [v for k, v in record["fields"].items() if k not in ("task", "seed", "method")]
    numeric = [v for v in values if isinstance(v, int | float)]
    return (label != baseline, str(record["fields"]["method"]), numeric, label)
