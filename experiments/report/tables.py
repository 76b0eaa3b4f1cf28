"""The Markdown tables of a study report, from `numbers.build`'s dicts, and the
formatting of its numbers (`f`, `fp`, `signed`, `interval`, `value`) that the verdict lines share.
"""

from __future__ import annotations

import math

from experiments.report.numbers import ISOTROPY, SWEEP_KEYS
from experiments.report.records import CHANCE, DEV_SIZE, PRETRAINED, constant_scores

# SPEC.md §9: Pearson r / p of isotropy vs the task metric over 35 runs per cell ([I-STAR]).
ISTAR_PAPER = {
    "BERT": {"rte": (-0.418, 0.012), "mrpc": (-0.115, 0.511), "cola": (-0.227, 0.190),
             "stsb": (-0.677, 0.001)},
    "ALBERT": {"rte": (-0.424, 0.011), "mrpc": (-0.184, 0.330), "cola": (0.195, 0.261),
               "stsb": (-0.624, 0.004)},
    "DistilBERT": {"rte": (-0.840, 0.003), "mrpc": (-0.532, 0.003), "cola": (-0.641, 0.003),
                   "stsb": (-0.713, 0.005)},
}  # fmt: skip


def f(x: float | None, digits: int = 3) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def fp(p: float) -> str:
    """A p-value: 3 decimals, or 2 significant digits below 0.001."""
    return f(p) if not math.isfinite(p) or p >= 0.001 else f"{p:.1e}"


def signed(x: float, digits: int = 4) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:+.{digits}f}"


def interval(p: dict, lo: str = "lo", hi: str = "hi") -> str:
    """`+0.0029 [-0.0018, +0.0077]`: the mean and an interval of a `paired` dict."""
    if not p["n"]:
        return "—"
    return f"{signed(p['mean'])} [{signed(p[lo])}, {signed(p[hi])}]"


def _ms(s: dict) -> str:
    return f"{f(s['mean'])} ± {f(s['std'])}"


def scores_table(data: dict) -> list[str]:
    md = [
        "| task | arm | n | last: median | last: mean ± std | best: median | best: mean ± std |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in data["tasks"]:
        for label, a in data["per_task"][task]["arms"].items():
            md.append(
                f"| {task} | {label} | {a['last']['n']} | {f(a['last']['median'])} | "
                f"{_ms(a['last'])} | {f(a['best']['median'])} | {_ms(a['best'])} |"
            )
    return md


def train_loss_table(data: dict) -> list[str]:
    """Per task x arm: the median over the runs of each epoch's mean training loss, with the
    runs' range (empty where no run recorded one)."""
    arms = [
        (task, label, a)
        for task in data["tasks"]
        for label, a in data["per_task"][task]["arms"].items()
    ]
    epochs = sorted({e for _, _, a in arms for e in a["train_loss"]})
    if not epochs:
        return []
    md = [
        "| task | arm | n | " + " | ".join(f"epoch {e}: median [min, max]" for e in epochs) + " |",
        "|---|---|---|" + "---|" * len(epochs),
    ]
    for task, label, a in arms:
        cells = [
            f"{f(s['median'])} [{f(s['min'])}, {f(s['max'])}]"
            if (s := a["train_loss"].get(e))
            else "—"
            for e in epochs
        ]
        md.append(f"| {task} | {label} | {a['last']['n']} | " + " | ".join(cells) + " |")
    return md


def constant_table(data: dict) -> list[str]:
    """Per classification task x arm: the dev evaluations at a constant prediction's score,
    before the last epoch and at it (empty where no task has `constant_scores`)."""
    rows = [
        (task, label, a["constant"])
        for task in data["tasks"]
        for label, a in data["per_task"][task]["arms"].items()
        if "constant" in a
    ]
    if not rows:
        return []
    md = [
        "| task | arm | epochs before the last: at a constant's score | last epoch: runs at it |",
        "|---|---|---|---|",
    ]
    for task, label, c in rows:
        (k, m), (j, n) = c["earlier"], c["last"]
        md.append(f"| {task} | {label} | {k} of {m} | {j} of {n} |")
    return md


def paired_table(data: dict) -> list[str]:
    """Per task x arm: mean difference, t 95 % interval and two-sided t p (last and best epoch),
    the bootstrap interval of the best epoch, and the EV3 / IsoScore differences."""
    md = [
        "| task | arm | n | last epoch: mean [t 95 %] | p | best epoch: mean [t 95 %] | p | "
        "best: bootstrap 95 % | EV3 head input [t 95 %] | token IsoScore [t 95 %] |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def row(task, label, p, ev3="", iso=""):
        boot = f"[{signed(p['best']['boot_lo'])}, {signed(p['best']['boot_hi'])}]"
        return (
            f"| {task} | {label} | {p['last']['n']} | {interval(p['last'])} | "
            f"{fp(p['last']['p'])} | {interval(p['best'])} | {fp(p['best']['p'])} | {boot} | "
            f"{ev3} | {iso} |"
        )

    for task in data["tasks"]:
        for label, p in data["per_task"][task]["paired"].items():
            md.append(
                row(task, label, p, interval(p["pre_logits_ev3"]), interval(p["tokens_isoscore"]))
            )
    for label, avg in data["task_average"].items():
        md.append(row(f"average of {len(avg['tasks'])} tasks", label, avg))
    return md


def pooled_table(data: dict) -> list[str]:
    """Per arm: the tasks pooled, runs per task, P(arm > baseline) and the task-averaged
    difference with their intervals, and the IQM of the normalised score with its interval."""
    base = data["baseline"]
    md = [
        f"| arm | tasks | runs per task | P(arm > {base}) [95 %] | task-averaged difference "
        "[95 %] | IQM normalised [95 %] (tasks) |",
        "|---|---|---|---|---|---|",
    ]
    for label, c in data["pooled"]["arms"].items():
        runs = ", ".join(str(len(data["per_task"][t]["arms"][label]["seeds"])) for t in c["tasks"])
        if "p" in c:
            p = f"{f(c['p'])} [{f(c['p_lo'])}, {f(c['p_hi'])}]"
            d = f"{signed(c['diff'])} [{signed(c['diff_lo'])}, {signed(c['diff_hi'])}]"
        else:
            p = d = "(the baseline)"
        q = c.get("iqm")
        iqm = (
            f"{f(q['iqm'])} [{f(q['lo'])}, {f(q['hi'])}] ({', '.join(c['normalised_tasks'])})"
            if q
            else "—"
        )
        md.append(f"| {label} | {', '.join(c['tasks'])} | {runs} | {p} | {d} | {iqm} |")
    return md


def isotropy_table(data: dict) -> list[str]:
    md = [
        "| task | arm | " + " | ".join(name for _, name in ISOTROPY) + " |",
        "|---|---|" + "---|" * len(ISOTROPY),
    ]
    for task in data["tasks"]:
        iso = data["per_task"][task]["isotropy"]
        for label in [PRETRAINED] * (PRETRAINED in iso) + [k for k in iso if k != PRETRAINED]:
            md.append(
                f"| {task} | {label} | " + " | ".join(f(iso[label][k]) for k, _ in ISOTROPY) + " |"
            )
    return md


def sweep_table(data: dict) -> list[str]:
    """Per task x measure: Pearson r / p (all runs), Spearman ρ / p, the leave-one-value-out
    range of Pearson r, Pearson without the collapsed runs, and the I-STAR paper's values (I-STAR
    sweeps only: the paper's correlations are over its λ sweep)."""
    models = ("BERT", "ALBERT", "DistilBERT") if data["sweep"] == "istar.weight" else ()
    md = [
        "| task | measure | n | Pearson r | p | Spearman ρ | p | r, one value left out | "
        "collapsed | n w/o | r w/o | p w/o |" + "".join(f" {m} |" for m in models),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(models),
    ]
    for task in data["tasks"]:
        sw = data["per_task"][task]["sweep"]
        paper = [ISTAR_PAPER[m].get(task) for m in models]
        cells = [
            f" {r:+.3f} / {p:.3f} |" if r is not None else " — |"
            for r, p in (x or (None, None) for x in paper)
        ]
        for key, name in SWEEP_KEYS:
            a, s, w = sw[key]["all"], sw[key]["spearman"], sw[key]["without_collapsed"]
            md.append(
                f"| {task} | {name} | {a['n']} | {signed(a['r'], 3)} | {fp(a['p'])} | "
                f"{signed(s['r'], 3)} | {fp(s['p'])} | {loo_range(sw[key]['leave_one_out'])} | "
                f"{'n/a' if sw['collapse_note'] else sw['n_collapsed']} | {w['n']} | "
                f"{signed(w['r'], 3)} | {fp(w['p'])} |" + "".join(cells)
            )
    return md


def loo_range(loo: dict) -> str:
    """`[-0.42 (5 out), +0.27 (-1 out)]`: the leave-one-value-out range of Pearson r."""
    if not math.isfinite(loo["min"]):
        return "—"
    return (
        f"[{signed(loo['min'], 3)} ({value(loo['argmin'])} out), "
        f"{signed(loo['max'], 3)} ({value(loo['argmax'])} out)]"
    )


def value(v) -> str:
    """A swept value as the report writes it: `-5`, `0.1`."""
    return format(v, "g") if isinstance(v, int | float) else str(v)


def chance_note() -> str:
    return ", ".join(f"{k} {format(v, '.4g')}" for k, v in CHANCE.items())


def constant_note(data: dict) -> str:
    """`rte 0.527 / 0.473` per task of `data` with `constant_scores`, by class id."""
    return "; ".join(
        f"{task} " + " / ".join(dict.fromkeys(f"{c:.3f}" for c in constant_scores(task)))
        for task in data["tasks"]
        if constant_scores(task)
    )


def dev_size_note() -> str:
    return ", ".join(f"{k} {n}" for k, n in DEV_SIZE.items())
