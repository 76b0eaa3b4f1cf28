"""Rebuilds a study's report (`<study>.md` and `<study>_*.png`) from its results JSONL alone.

    python experiments/report.py experiments/results/normalizers.jsonl

Reads the lines `experiments/study.py` writes (one per cell) and writes, beside the JSONL:

- per task x arm (an arm: the method and every other varied field but the seed): n, median,
  mean ± std (ddof 1) of the task's dev score at the last epoch and at the best dev epoch (the
  [IsoBN] protocol: evaluate after every epoch, keep the best; selected and reported on the same
  dev set, so optimistic);
- paired differences against the grid's baseline arm over the seeds both have: the mean
  difference, its percentile bootstrap 95 % interval (`RESAMPLES` resamples of the seeds with
  replacement, `numpy.random.default_rng(BOOTSTRAP_SEED)`), and n;
- isotropy before (the grid's step-0 "pretrained" rows) and after fine-tuning (median over seeds,
  last epoch): EV_3 of the pooled sentence vector and of the classifier's input, mean cosine,
  all-layer token IsoScore and IsoScore*;
- for a sweep (the grid's `sweep` field, e.g. I-STAR's lambda): per task, the all-layer token
  IsoScore and IsoScore* (dev, last epoch) against the task score, Pearson r and p
  (`scipy.stats.pearsonr`), with and without collapsed runs, beside SPEC.md §9's BERT / ALBERT /
  DistilBERT values;
- one verdict per SPEC.md §9 claim the records can test (rule in `verdict`).

The header names the code (commits), devices and JAX versions of the records. A JSONL holding
records of several devices (the `device` field: "cpu cpu x1", "gpu NVIDIA H200 x1") is refused
unless `--allow-mixed-devices`: each device's runs belong in their own JSONL.

Figures use matplotlib's Agg backend.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import pathlib
import sys

import numpy as np
import scipy.stats

RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
PRETRAINED = "pretrained"
TASK_ORDER = ("cola", "mrpc", "stsb", "rte")
METRIC_NAMES = {
    "cola": "Matthews corr.",
    "mrpc": "(accuracy + F1) / 2",
    "stsb": "(Pearson + Spearman) / 2",
    "rte": "accuracy",
    "sst2": "accuracy",
    "qnli": "accuracy",
}
# The dev score of a constant prediction (the majority class; 0 for a correlation), from the
# local dev TSVs: RTE 146/277 not_entailment; MRPC 279/408 paraphrases (accuracy 0.684, F1 0.812).
CHANCE = {"cola": 0.0, "mrpc": 0.7480, "stsb": 0.0, "rte": 0.5271}
# SPEC.md §9: Pearson r / p of isotropy vs the task metric over 35 runs per cell ([I-STAR]).
ISTAR_PAPER = {
    "BERT": {"rte": (-0.418, 0.012), "mrpc": (-0.115, 0.511), "cola": (-0.227, 0.190),
             "stsb": (-0.677, 0.001)},
    "ALBERT": {"rte": (-0.424, 0.011), "mrpc": (-0.184, 0.330), "cola": (0.195, 0.261),
               "stsb": (-0.624, 0.004)},
    "DistilBERT": {"rte": (-0.840, 0.003), "mrpc": (-0.532, 0.003), "cola": (-0.641, 0.003),
                   "stsb": (-0.713, 0.005)},
}  # fmt: skip
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


# ----------------------------------------------------------------------------------------------
# Reading the records.
# ----------------------------------------------------------------------------------------------


def read_records(path: pathlib.Path) -> list[dict]:
    """The JSONL's lines; a bad line raises, naming it."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def device_counts(records: list[dict]) -> collections.Counter:
    """`"<device> (jax <version>)"` -> number of records; "not recorded" where a record lacks
    the field (records written before `jax_version` existed)."""
    return collections.Counter(
        "{} (jax {})".format(
            r.get("device") or "device not recorded", r.get("jax_version") or "not recorded"
        )
        for r in records
    )


def check_one_device(records: list[dict], path: pathlib.Path, allow_mixed: bool) -> None:
    """Raises ValueError when the records come from several devices (`device` field), unless
    `allow_mixed`: run times, and the rounding of the scores, differ between devices, so one
    report must not pool them silently (a GPU replicate goes to its own JSONL)."""
    devices = collections.Counter(r.get("device") or "device not recorded" for r in records)
    if len(devices) > 1 and not allow_mixed:
        found = "; ".join(f"{d} x{n}" for d, n in devices.items())
        raise ValueError(
            f"{path}: records from {len(devices)} devices ({found}): keep each device's runs in "
            "its own JSONL, or pass --allow-mixed-devices to pool them in one report"
        )


def dev_rows(record: dict) -> list[dict]:
    """The evaluations of the record's first dev split, by epoch."""
    if not record["eval"]:
        return []
    split = record["eval"][0]["split"]
    return sorted((r for r in record["eval"] if r["split"] == split), key=lambda r: r["epoch"])


def last_value(record: dict, key: str = "score") -> float:
    rows = dev_rows(record)
    return float(rows[-1].get(key, math.nan)) if rows else math.nan


def best_score(record: dict) -> float:
    """The best dev score over the epochs (the [IsoBN] protocol's early stopping on dev)."""
    return max((float(r["score"]) for r in dev_rows(record)), default=math.nan)


def varied_fields(runs: list[dict]) -> list[str]:
    """Fields other than task and seed that take more than one value over the runs, method
    first."""
    keys = list(dict.fromkeys(k for r in runs for k in r["fields"]))
    out = [
        k
        for k in keys
        if k not in ("task", "seed") and len({json.dumps(r["fields"].get(k)) for r in runs}) > 1
    ]
    return sorted(out, key=lambda k: k != "method")


def arm_label(record: dict, varied: list[str]) -> str:
    """`method`, then `field=value` for the other varied fields, e.g. `istar lambda=-0.5`."""
    parts = [str(record["fields"]["method"])]
    for key in varied:
        if key != "method":
            value = record["fields"].get(key)
            name = {"istar.weight": "lambda", "cosreg.weight": "lambda"}.get(key, key)
            parts.append(f"{name}={format(value, 'g') if isinstance(value, float) else value}")
    return " ".join(parts)


def is_baseline(record: dict) -> bool:
    base = record.get("baseline") or {}
    return bool(base) and all(record["fields"].get(k) == v for k, v in base.items())


# ----------------------------------------------------------------------------------------------
# Statistics.
# ----------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict:
    """n, median, mean, std (ddof 1; NaN for n < 2)."""
    x = np.asarray(values, np.float64)
    return {
        "n": len(x),
        "median": float(np.median(x)) if len(x) else math.nan,
        "mean": float(np.mean(x)) if len(x) else math.nan,
        "std": float(np.std(x, ddof=1)) if len(x) > 1 else math.nan,
    }


def bootstrap_ci(
    diffs: list[float], *, resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED
) -> tuple[float, float]:
    """Percentile bootstrap 95 % interval of the mean of `diffs`: `resamples` draws of n
    indices with replacement (`default_rng(seed).integers(0, n, (resamples, n))`), the 2.5th
    and 97.5th percentiles (numpy's linear interpolation) of the resampled means. NaN for n < 2.
    """
    d = np.asarray(diffs, np.float64)
    if len(d) < 2:
        return math.nan, math.nan
    idx = np.random.default_rng(seed).integers(0, len(d), size=(resamples, len(d)))
    lo, hi = np.percentile(d[idx].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def paired(arm: dict[int, float], base: dict[int, float]) -> dict:
    """Mean of arm - base over shared seeds, its bootstrap interval, n and the seeds."""
    seeds = sorted(set(arm) & set(base))
    diffs = [arm[s] - base[s] for s in seeds]
    lo, hi = bootstrap_ci(diffs)
    mean = float(np.mean(diffs)) if diffs else math.nan
    return {"n": len(seeds), "seeds": seeds, "mean": mean, "lo": lo, "hi": hi}


def pearson(x: list[float], y: list[float]) -> dict:
    """`scipy.stats.pearsonr` (r, two-sided p) and n; NaN below 3 points or for a constant."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return {"n": len(x), "r": math.nan, "p": math.nan}
    result = scipy.stats.pearsonr(x, y)
    return {"n": len(x), "r": float(result.statistic), "p": float(result.pvalue)}


def verdict(lo: float, hi: float, direction: int) -> str:
    """The rule for a directional claim (direction +1: the claim says the difference is > 0):
    "confirmed" if the 95 % interval excludes 0 on the claimed side, "reversed" if it excludes
    0 on the other side, else "not detected at this n" (also when there is no interval)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "not detected at this n (no interval: n < 2)"
    toward, against = (lo, -hi) if direction > 0 else (-hi, lo)
    if toward > 0:
        return "confirmed"
    if against > 0:
        return "reversed"
    return "not detected at this n"


def correlation_verdict(r: float, p: float, direction: int = -1) -> str:
    """ "confirmed" if p < 0.05 with r of the claimed sign, "reversed" if p < 0.05 with the other
    sign, else "not detected at this n"."""
    if not (math.isfinite(r) and math.isfinite(p)) or p >= 0.05:
        return "not detected at this n"
    return "confirmed" if r * direction > 0 else "reversed"


# ----------------------------------------------------------------------------------------------
# Tables.
# ----------------------------------------------------------------------------------------------


def collapsed(record: dict, baseline_median: float) -> bool:
    """A run is collapsed when its last-epoch score is below halfway between chance (`CHANCE`,
    a constant prediction) and the baseline arm's median: score - chance < (median - chance)/2.
    Never when the baseline itself is at chance or below."""
    task = record["fields"]["task"]
    chance = CHANCE.get(task, 0.0)
    if not math.isfinite(baseline_median) or baseline_median <= chance:
        return False
    return last_value(record) - chance < 0.5 * (baseline_median - chance)


def build(records: list[dict]) -> dict:
    """Every number of the report, as nested dicts (also what the tests check)."""
    runs = [r for r in records if r["kind"] == "run" and r["status"] == "ok"]
    pre = {r["fields"]["task"]: r for r in records if r["kind"] == PRETRAINED and r["eval"]}
    varied = varied_fields(runs)
    tasks = sorted({r["fields"]["task"] for r in runs}, key=_task_key)
    arms: dict[str, dict[str, list[dict]]] = {t: collections.defaultdict(list) for t in tasks}
    baseline_label = None
    for r in runs:
        label = arm_label(r, varied)
        arms[r["fields"]["task"]][label].append(r)
        if is_baseline(r):
            baseline_label = label
    out = {"tasks": tasks, "varied": varied, "baseline": baseline_label, "per_task": {}}
    sweep = next((r["sweep"] for r in runs if r.get("sweep")), "")
    out["sweep"] = sweep
    for task in tasks:
        t = out["per_task"][task] = {"arms": {}, "paired": {}, "isotropy": {}}
        labels = sorted(arms[task], key=lambda a: _arm_key(arms[task][a][0], a, baseline_label))
        for label in labels:
            rows = arms[task][label]
            t["arms"][label] = {
                "last": summary([last_value(r) for r in rows]),
                "best": summary([best_score(r) for r in rows]),
                "seeds": sorted(r["seed"] for r in rows),
            }
            t["isotropy"][label] = {
                key: float(np.median([last_value(r, key) for r in rows])) for key, _ in ISOTROPY
            }
        if task in pre:
            row = dev_rows(pre[task])[0]
            t["isotropy"][PRETRAINED] = {k: float(row.get(k, math.nan)) for k, _ in ISOTROPY}
        base_rows = arms[task].get(baseline_label, []) if baseline_label else []
        for label in labels:
            if label == baseline_label or not base_rows:
                continue
            rows = arms[task][label]
            t["paired"][label] = {
                "last": paired(_by_seed(rows, last_value), _by_seed(base_rows, last_value)),
                "best": paired(_by_seed(rows, best_score), _by_seed(base_rows, best_score)),
            }
            for key in (
                "sentence_ev3",
                "pre_logits_ev3",
                "sentence_mean_cosine",
                "tokens_isoscore",
                *COSREG_KEYS,
            ):
                fn = _metric(key)
                t["paired"][label][key] = paired(_by_seed(rows, fn), _by_seed(base_rows, fn))
        # [IsoBN]'s contrast: IsoBN lowers EV3 of the classifier input more than batchnorm does.
        isobn, batchnorm = _arm_of(labels, "isobn"), _arm_of(labels, "batchnorm")
        if isobn and batchnorm:
            fn = _metric("pre_logits_ev3")
            t["ev3_isobn_vs_batchnorm"] = paired(
                _by_seed(arms[task][isobn], fn), _by_seed(arms[task][batchnorm], fn)
            )
        base_median = t["arms"][baseline_label]["last"]["median"] if base_rows else math.nan
        if sweep:
            all_runs = [r for rows in arms[task].values() for r in rows]
            flags = [collapsed(r, base_median) for r in all_runs]
            t["sweep"] = {"n_collapsed": int(sum(flags)), "points": []}
            for r, flag in zip(all_runs, flags, strict=True):
                t["sweep"]["points"].append(
                    {
                        "value": r["fields"].get(sweep),
                        "seed": r["seed"],
                        "score": last_value(r),
                        "tokens_isoscore": last_value(r, "tokens_isoscore"),
                        "tokens_isoscore_star": last_value(r, "tokens_isoscore_star"),
                        "collapsed": flag,
                    }
                )
            pts = t["sweep"]["points"]
            for key in ("tokens_isoscore", "tokens_isoscore_star"):
                kept = [p for p in pts if not p["collapsed"]]
                t["sweep"][key] = {
                    "all": pearson([p[key] for p in pts], [p["score"] for p in pts]),
                    "without_collapsed": pearson(
                        [p[key] for p in kept], [p["score"] for p in kept]
                    ),
                }
    # The average over tasks per seed (the [IsoBN] "average of GLUE tasks" claim), where every
    # task has the seed.
    out["task_average"] = {}
    if baseline_label and len(tasks) > 1:
        for label in {a for t in tasks for a in out["per_task"][t]["paired"]}:
            if not all(label in arms[t] and baseline_label in arms[t] for t in tasks):
                continue
            for kind, fn in (("last", last_value), ("best", best_score)):
                arm_avg = _seed_average([_by_seed(arms[t][label], fn) for t in tasks])
                base_avg = _seed_average([_by_seed(arms[t][baseline_label], fn) for t in tasks])
                out["task_average"].setdefault(label, {})[kind] = paired(arm_avg, base_avg)
    return out


def _metric(key: str):
    return lambda r: last_value(r, key)


def _arm_of(labels, method: str) -> str | None:
    """The arm label of `method` (its first word), if the task has one."""
    return next((label for label in labels if label.split()[0] == method), None)


def _by_seed(rows: list[dict], fn) -> dict[int, float]:
    return {r["seed"]: fn(r) for r in rows}


def _seed_average(per_task: list[dict[int, float]]) -> dict[int, float]:
    seeds = set.intersection(*(set(d) for d in per_task))
    return {s: float(np.mean([d[s] for d in per_task])) for s in seeds}


def _task_key(task: str) -> tuple:
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)


def _arm_key(record: dict, label: str, baseline: str | None) -> tuple:
    values = [v for k, v in record["fields"].items() if k not in ("task", "seed", "method")]
    numeric = [v for v in values if isinstance(v, int | float)]
    return (label != baseline, str(record["fields"]["method"]), numeric, label)


# ----------------------------------------------------------------------------------------------
# Figures.
# ----------------------------------------------------------------------------------------------


def write_figures(records: list[dict], data: dict, out: pathlib.Path, stem: str) -> dict:
    """PNG figures beside the report; returns {name: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = {}
    tasks = data["tasks"]
    if not tasks:
        return files
    runs = [r for r in records if r["kind"] == "run" and r["status"] == "ok"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{stem}_{name}.png", dpi=110)
        plt.close(fig)
        files[name] = f"{stem}_{name}.png"

    # Scores per arm: one dot per seed (last epoch), a bar at the median.
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        labels = list(data["per_task"][task]["arms"])
        for i, label in enumerate(labels):
            ys = [last_value(r) for r in runs if _label(r, data) == label and _task(r) == task]
            ax.scatter([i] * len(ys), ys, s=18, color="C0")
            ax.hlines(np.median(ys), i - 0.3, i + 0.3, color="C3")
        ax.axhline(CHANCE.get(task, 0.0), color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{task}: {METRIC_NAMES.get(task, 'score')}, dev, last epoch", fontsize=9)
    save(fig, "scores")

    # Dev score per epoch (median over seeds) per arm.
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for label in data["per_task"][task]["arms"]:
            rows = [r for r in runs if _label(r, data) == label and _task(r) == task]
            epochs = sorted({e["epoch"] for r in rows for e in dev_rows(r)})
            medians = [
                np.median([e["score"] for r in rows for e in dev_rows(r) if e["epoch"] == ep])
                for ep in epochs
            ]
            ax.plot(epochs, medians, marker="o", label=label)
        ax.set_xlabel("epoch")
        ax.set_title(f"{task}: median dev score", fontsize=9)
        ax.legend(fontsize=6)
    save(fig, "curves")

    # Paired differences with their bootstrap intervals.
    if data["baseline"]:
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
        for ax, task in zip(axes[0], tasks, strict=True):
            pairs = data["per_task"][task]["paired"]
            for i, p in enumerate(pairs.values()):
                for j, kind in enumerate(("last", "best")):
                    d = p[kind]
                    err = [[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]]
                    if not math.isfinite(d["lo"]):
                        err = None
                    ax.errorbar(
                        i + 0.15 * (2 * j - 1),
                        d["mean"],
                        yerr=err,
                        fmt="o",
                        color=f"C{j}",
                        label=kind if i == 0 else None,
                    )
            ax.axhline(0, color="grey", lw=0.8)
            ax.set_xlim(-0.6, max(len(pairs), 1) - 0.4)
            ax.set_xticks(range(len(pairs)), list(pairs), rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{task}: arm - {data['baseline']} (95 % CI)", fontsize=9)
            ax.legend(fontsize=7)
        save(fig, "paired")

    # Isotropy before / after: EV_3 of the pooled vector and of the head input.
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.8), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        iso = data["per_task"][task]["isotropy"]
        labels = [PRETRAINED] * (PRETRAINED in iso) + [k for k in iso if k != PRETRAINED]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [iso[k]["sentence_ev3"] for k in labels], 0.4, label="pooled")
        ax.bar(x + 0.2, [iso[k]["pre_logits_ev3"] for k in labels], 0.4, label="head input")
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{task}: EV3 (dev), median over seeds", fontsize=9)
        ax.legend(fontsize=7)
    save(fig, "isotropy")

    # Sweep: token isotropy against the task score.
    if data["sweep"]:
        keys = (("tokens_isoscore", "IsoScore"), ("tokens_isoscore_star", "IsoScore*"))
        fig, axes = plt.subplots(2, len(tasks), figsize=(4.2 * len(tasks), 7), squeeze=False)
        for col, task in enumerate(tasks):
            sw = data["per_task"][task]["sweep"]
            for row, (key, name) in enumerate(keys):
                ax = axes[row][col]
                pts = sw["points"]
                sc = ax.scatter(
                    [p[key] for p in pts],
                    [p["score"] for p in pts],
                    c=[p["value"] for p in pts],
                    cmap="coolwarm",
                    s=22,
                    marker="o",
                )
                col_pts = [p for p in pts if p["collapsed"]]
                ax.scatter(
                    [p[key] for p in col_pts],
                    [p["score"] for p in col_pts],
                    s=80,
                    facecolors="none",
                    edgecolors="k",
                    label="collapsed",
                )
                a, w = sw[key]["all"], sw[key]["without_collapsed"]
                ax.set_title(
                    f"{task}: r={a['r']:.2f} (p={_p(a['p'])}); w/o collapsed "
                    f"r={w['r']:.2f} (p={_p(w['p'])})",
                    fontsize=8,
                )
                ax.set_xlabel(f"all-layer token {name} (dev, last epoch)", fontsize=8)
                ax.set_ylabel(METRIC_NAMES.get(task, "score"), fontsize=8)
                fig.colorbar(sc, ax=ax, label=data["sweep"])
        save(fig, "sweep")
    return files


def _task(r: dict) -> str:
    return r["fields"]["task"]


def _label(r: dict, data: dict) -> str:
    return arm_label(r, data["varied"])


# ----------------------------------------------------------------------------------------------
# The Markdown report.
# ----------------------------------------------------------------------------------------------


def _f(x: float, digits: int = 3) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def _p(p: float) -> str:
    """A p-value: 3 decimals, or 2 significant digits below 0.001."""
    return _f(p) if not math.isfinite(p) or p >= 0.001 else f"{p:.1e}"


def _ms(s: dict) -> str:
    return f"{_f(s['mean'])} ± {_f(s['std'])}"


def _ci(p: dict) -> str:
    return f"{p['mean']:+.3f} [{_f(p['lo'])}, {_f(p['hi'])}]" if p["n"] else "—"


def verdict_lines(data: dict, files: dict) -> list[str]:
    """One line per SPEC.md §9 claim these records can test."""
    lines = []
    fig = {k: f"[{v}]({v})" for k, v in files.items()}
    base = data["baseline"]
    per_task = data["per_task"]

    def arm_paired(method: str, task: str):
        label = _arm_of(per_task[task]["paired"], method)
        return per_task[task]["paired"][label] if label else None

    methods = {label.split()[0] for t in data["tasks"] for label in per_task[t]["arms"]}
    if base == "none":
        for method, claim in (
            ("isobn", "[IsoBN] IsoBN improves fine-tuning (best dev epoch, as the protocol)"),
            ("batchnorm", "[EmbNorm] normalising the sentence vector (batchnorm) improves it"),
            ("recenter", "[EmbNorm] re-centring the sentence vector improves it"),
            ("layernorm", "[EmbNorm] layer-normalising the sentence vector improves it"),
        ):
            if method not in methods:
                continue
            for task in data["tasks"]:
                p = arm_paired(method, task)
                if p:
                    v = verdict(p["best"]["lo"], p["best"]["hi"], +1)
                    lines.append(
                        f"- {claim}, {task}: **{v}** ({method} − none "
                        f"{_ci(p['best'])}, n={p['best']['n']}; {fig.get('paired', '')})"
                    )
            avg = next((v for k, v in data["task_average"].items() if k.split()[0] == method), None)
            if avg:
                v = verdict(avg["best"]["lo"], avg["best"]["hi"], +1)
                lines.append(
                    f"- {claim}, average of the tasks: **{v}** ({_ci(avg['best'])}, "
                    f"n={avg['best']['n']})"
                )
        for method, claim in (
            (
                "batchnorm",
                "[IsoBN] batch normalisation lowers EV3 of the classifier input (the paper: "
                "only a little)",
            ),
            ("isobn", "[IsoBN] IsoBN lowers EV3 of the classifier input (the paper: a lot)"),
        ):
            if method not in methods:
                continue
            for task in data["tasks"]:
                p = arm_paired(method, task)
                if p:
                    d = p["pre_logits_ev3"]
                    v = verdict(d["lo"], d["hi"], -1)
                    lines.append(
                        f"- {claim}, {task}: **{v}** (EV3 {method} − none {_ci(d)}, "
                        f"n={d['n']}; {fig.get('isotropy', '')})"
                    )
    for task in data["tasks"]:
        d = per_task[task].get("ev3_isobn_vs_batchnorm")
        if d:
            iso = per_task[task]["isotropy"]
            medians = ", ".join(
                f"{m} {_f(iso[label]['pre_logits_ev3'])}"
                for m in ("none", "batchnorm", "isobn")
                if (label := _arm_of(iso, m))
            )
            lines.append(
                f"- [IsoBN] IsoBN lowers EV3 of the classifier input more than batch "
                f"normalisation does, {task}: **{verdict(d['lo'], d['hi'], -1)}** (EV3 isobn − "
                f"batchnorm {_ci(d)}, n={d['n']}; medians {medians}; {fig.get('isotropy', '')})"
            )
    pre = [
        (t, per_task[t]["isotropy"][PRETRAINED]["sentence_ev3"])
        for t in data["tasks"]
        if PRETRAINED in per_task[t]["isotropy"]
    ]
    if pre:
        ev = ", ".join(f"{t} {_f(e)}" for t, e in pre)
        if all(e > 0.5 for _, e in pre):
            v = "confirmed"
        elif all(e < 0.5 for _, e in pre):
            v = "reversed"
        else:
            v = "not detected (mixed)"
        lines.append(
            f"- [IsoBN] pre-trained sentence vectors are anisotropic (BERT-base EV3 "
            f"≈ 0.86; rule: EV3 > 0.5 on every task confirms, < 0.5 on every task "
            f"reverses): **{v}** (pooled EV3 {ev}; {fig.get('isotropy', '')})"
        )
    if data["sweep"] == "istar.weight":
        for task in data["tasks"]:
            sw = per_task[task]["sweep"]
            for key, name in (
                ("tokens_isoscore_star", "IsoScore*"),
                ("tokens_isoscore", "IsoScore"),
            ):
                a = sw[key]["all"]
                v = correlation_verdict(a["r"], a["p"], -1)
                w = sw[key]["without_collapsed"]
                lines.append(
                    f"- [I-STAR] isotropy ({name}) is negatively correlated with the metric, "
                    f"{task}: **{v}** (r={_f(a['r'])}, p={_p(a['p'])}, n={a['n']}; without "
                    f"collapsed runs: {correlation_verdict(w['r'], w['p'], -1)}, "
                    f"r={_f(w['r'])}, p={_p(w['p'])}, n={w['n']}; {fig.get('sweep', '')})"
                )
            for label, p in per_task[task]["paired"].items():
                weight = per_task[task]["arms"][label]
                value = _sweep_value(label)
                if value is not None and value < 0:
                    v = verdict(p["last"]["lo"], p["last"]["hi"], +1)
                    lines.append(
                        f"- [I-STAR] λ < 0 helps, {task}, {label}: **{v}** "
                        f"(vs λ = 0 {_ci(p['last'])}, n={p['last']['n']}, median "
                        f"{_f(weight['last']['median'])}; {fig.get('paired', '')})"
                    )
        lines.append("- [I-STAR] the best ζ lies in [0.2, 0.8]: **not tested** (ζ = 0.2 only)")
    if data["sweep"] == "cosreg.weight":
        for task in data["tasks"]:
            for label, p in per_task[task]["paired"].items():
                value = _sweep_value(label)
                if value is None or value == 0:
                    continue
                direction = -1 if value > 0 else +1
                for key, claim, note in (
                    ("last_tokens_mean_cosine", "the last-layer token mean cosine", ""),
                    (
                        "last_tokens_max_abs_mean",
                        "the |mean| of the outlier dimension",
                        "; the paper's ALBERT/QNLI: 11.72 base, 27.33 at λ = −1, 2.84 at λ = +1",
                    ),
                ):
                    d = p[key]
                    v = verdict(d["lo"], d["hi"], direction)
                    lines.append(
                        f"- [CosReg] λ = {value:+g} {'lowers' if value > 0 else 'raises'} "
                        f"{claim}, {task}: **{v}** (vs λ = 0 {_ci(d)}, n={d['n']}{note})"
                    )
                iso = p["tokens_isoscore"]
                if not math.isfinite(iso["lo"]):
                    v = "not tested (no interval: n < 2)"
                elif iso["lo"] > 0 or iso["hi"] < 0:
                    v = "reversed (it changed)"
                else:
                    v = "confirmed (no change detected)"
                lines.append(
                    f"- [CosReg] λ = {value:+g} leaves the token IsoScore alone, {task}: "
                    f"**{v}** ({_ci(iso)}, n={iso['n']}; a change the interval cannot "
                    "resolve at this n is not excluded)"
                )
    return lines


def _sweep_value(label: str) -> float | None:
    for part in label.split()[1:]:
        if part.startswith("lambda="):
            return float(part.split("=", 1)[1])
    return None


def render(records: list[dict], data: dict, files: dict, stem: str) -> str:
    runs = [r for r in records if r["kind"] == "run"]
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in records if r["status"] == "failed"]
    commits = collections.Counter(
        f"{r['git_commit'][:10]}{' (dirty)' if r['git_dirty'] else ''}" for r in records
    )
    devices = device_counts(records)
    hours = sum(r.get("wall_minutes") or 0.0 for r in records) / 60.0
    md = [f"# Study `{stem}`", ""]
    md.append(
        f"Rebuilt by `python experiments/report.py experiments/results/{stem}.jsonl` from "
        f"{len(records)} records: {len(ok)} finished runs, {len(failed)} failed, "
        f"{len(records) - len(runs)} pre-trained evaluations; {hours:.1f} h of runs. "
        f"Code: {', '.join(f'{c} x{n}' for c, n in commits.items())}; device: "
        f"{', '.join(f'{d} x{n}' for d, n in devices.items())}."
    )
    if len({r.get("device") for r in records}) > 1:
        md += [
            "",
            "**Mixed devices** (`--allow-mixed-devices`): the statistics below pool runs of "
            "several devices, whose wall times and rounding differ.",
        ]
    if ok:
        c = ok[0]["config"]
        opt = c.get("optimizer", {})
        layout = "packed batches" if c.get("packing") else f"buckets {tuple(c.get('buckets', ()))}"
        md += [
            "",
            f"Recipe: {c.get('model')}, batch {c.get('batch_size')}, max length "
            f"{c.get('max_length')}, {layout}, {c.get('num_epochs')} "
            f"epochs, AdamW lr {opt.get('learning_rate')} ({opt.get('schedule')} schedule, "
            f"{opt.get('warmup_fraction')} warm-up), weight decay {opt.get('weight_decay')}. "
            f"Varied: {', '.join(data['varied']) or 'nothing but the task and seed'}; seeds "
            f"{sorted({r['seed'] for r in ok})}.",
        ]
    md += [
        "",
        "Metric: the task's dev score ("
        + "; ".join(f"{t}: {METRIC_NAMES.get(t, 'score')}" for t in data["tasks"])
        + ").",
    ]
    md += [
        "",
        "## Scores",
        "",
        "Last epoch, and best dev epoch (the [IsoBN] protocol: selected and "
        "reported on the same dev set). Figures: "
        + ", ".join(f"[{n}]({f})" for n, f in files.items() if n in ("scores", "curves")),
        "",
    ]
    md += [
        "| task | arm | n | last: median | last: mean ± std | best: median | best: mean ± std |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in data["tasks"]:
        for label, a in data["per_task"][task]["arms"].items():
            md.append(
                f"| {task} | {label} | {a['last']['n']} | {_f(a['last']['median'])} | "
                f"{_ms(a['last'])} | {_f(a['best']['median'])} | {_ms(a['best'])} |"
            )
    if data["baseline"]:
        md += [
            "",
            f"## Paired differences against `{data['baseline']}`",
            "",
            f"Mean of (arm − {data['baseline']}) over the seeds both have, with a percentile "
            f"bootstrap 95 % interval ({RESAMPLES} resamples of the seeds, NumPy "
            f"`default_rng({BOOTSTRAP_SEED})`); with n = 3 seeds the resampled mean takes only 10 "
            "distinct values, so the interval is coarse. Figure: "
            f"[paired]({files.get('paired', '')})",
            "",
            "| task | arm | n | last epoch | best epoch | EV3 head input | token IsoScore |",
            "|---|---|---|---|---|---|---|",
        ]
        for task in data["tasks"]:
            for label, p in data["per_task"][task]["paired"].items():
                md.append(
                    f"| {task} | {label} | {p['last']['n']} | {_ci(p['last'])} | "
                    f"{_ci(p['best'])} | {_ci(p['pre_logits_ev3'])} | "
                    f"{_ci(p['tokens_isoscore'])} |"
                )
        for label, avg in data["task_average"].items():
            md.append(
                f"| average of {len(data['tasks'])} tasks | {label} | {avg['last']['n']} | "
                f"{_ci(avg['last'])} | {_ci(avg['best'])} | | |"
            )
    md += [
        "",
        "## Isotropy before and after fine-tuning",
        "",
        "Dev set; `pretrained`: the step-0 model (pre-trained encoder, fresh head); the arms: "
        "median over seeds at the last epoch. EV3 of the pooled vector and of the classifier's "
        "input (after the normaliser), mean pairwise cosine of the pooled vectors, all-layer "
        "token IsoScore, and IsoScore* (ζ of the run, shrunk towards the run's C0: I-STAR runs "
        f"only). Figure: [isotropy]({files.get('isotropy', '')})",
        "",
        "| task | arm | " + " | ".join(name for _, name in ISOTROPY) + " |",
        "|---|---|" + "---|" * len(ISOTROPY),
    ]
    for task in data["tasks"]:
        iso = data["per_task"][task]["isotropy"]
        for label in [PRETRAINED] * (PRETRAINED in iso) + [k for k in iso if k != PRETRAINED]:
            md.append(
                f"| {task} | {label} | " + " | ".join(_f(iso[label][k]) for k, _ in ISOTROPY) + " |"
            )
    if data["sweep"]:
        chance = ", ".join(f"{k} {v}" for k, v in CHANCE.items())
        # The I-STAR paper's correlations are over its lambda sweep: beside I-STAR's only.
        models = ("BERT", "ALBERT", "DistilBERT") if data["sweep"] == "istar.weight" else ()
        md += [
            "",
            f"## Isotropy against the task score over `{data['sweep']}`",
            "",
            "All-layer token IsoScore and IsoScore* (dev, last epoch) against the dev score, "
            "Pearson r and two-sided p (SciPy), over every (value, seed) run, then without the "
            "collapsed ones. Collapsed: last-epoch score − chance < (baseline median − chance) "
            f"/ 2, chance being a constant prediction's score ({chance})."
            + (" The papers had 7 λ × 5 seeds = 35 runs per cell." if models else "")
            + f" Figure: [sweep]({files.get('sweep', '')})",
            "",
            "| task | measure | n | r | p | collapsed | n w/o | r w/o | p w/o |"
            + "".join(f" {m} |" for m in models),
            "|---|---|---|---|---|---|---|---|---|" + "---|" * len(models),
        ]
        for task in data["tasks"]:
            sw = data["per_task"][task]["sweep"]
            paper = [ISTAR_PAPER[m].get(task) for m in models]
            cells = [
                f" {r:+.3f} / {p:.3f} |" if r is not None else " — |"
                for r, p in (x or (None, None) for x in paper)
            ]
            for key, name in (
                ("tokens_isoscore", "IsoScore"),
                ("tokens_isoscore_star", "IsoScore*"),
            ):
                a, w = sw[key]["all"], sw[key]["without_collapsed"]
                md.append(
                    f"| {task} | {name} | {a['n']} | {_f(a['r'])} | {_p(a['p'])} | "
                    f"{sw['n_collapsed']} | {w['n']} | {_f(w['r'])} | {_p(w['p'])} |"
                    + "".join(cells)
                )
    md += [
        "",
        "## Verdicts (SPEC.md §9)",
        "",
        "Rule for a difference: **confirmed** when the paired bootstrap 95 % interval excludes 0 "
        "on the claimed side, **reversed** when it excludes 0 on the other side, otherwise "
        "**not detected at this n**. For a correlation: p < 0.05 with the claimed sign "
        "confirms, p < 0.05 with the other sign reverses. No correction for the number of "
        "lines.",
        "",
    ]
    md += verdict_lines(data, files) or ["- no claim of SPEC.md §9 is testable from these records"]
    if failed:
        md += ["", "## Failed cells", "", "| cell | error |", "|---|---|"]
        for r in failed:
            first = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
            md.append(f"| {r['cell']} | {first.replace('|', '/')} |")
    return "\n".join(md) + "\n"


def write_report(results: str | pathlib.Path, allow_mixed_devices: bool = False) -> pathlib.Path:
    """Writes `<stem>.md` and `<stem>_*.png` beside `results`; returns the Markdown path.
    Records of several devices raise ValueError unless `allow_mixed_devices`."""
    results = pathlib.Path(results)
    records = read_records(results)
    check_one_device(records, results, allow_mixed_devices)
    data = build(records)
    stem = results.stem
    files = write_figures(records, data, results.parent, stem)
    path = results.with_suffix(".md")
    path.write_text(render(records, data, files, stem))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a study's JSONL, e.g. experiments/results/pilot.jsonl")
    parser.add_argument(
        "--allow-mixed-devices",
        action="store_true",
        help="pool records of several devices (refused by default; the header names them)",
    )
    args = parser.parse_args(argv)
    print(write_report(args.results, allow_mixed_devices=args.allow_mixed_devices))
    return 0


if __name__ == "__main__":
    sys.exit(main())
