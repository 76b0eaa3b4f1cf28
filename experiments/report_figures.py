"""The PNG figures of a study report (matplotlib, Agg backend), written beside the JSONL.

- `<stem>_scores.png`: per task, one dot per seed (last epoch) and the median per arm;
- `<stem>_curves.png`: the median dev score per epoch per arm;
- `<stem>_paired.png`: arm − baseline per task, last and best epoch, with the paired t 95 %
  interval (the one the verdicts print);
- `<stem>_isotropy.png`: EV3 of the pooled vector and of the head input, before and after;
- `<stem>_sweep.png` (a sweep): token IsoScore / IsoScore* against the score, collapsed runs
  circled, Pearson r in the titles.
"""

from __future__ import annotations

import math
import pathlib

import numpy as np
from report_records import CHANCE, METRIC_NAMES, PRETRAINED, arm_label, dev_rows, last_value
from report_tables import fp


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

    # Paired differences with their t 95 % intervals (the verdicts' interval).
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
            ax.set_title(f"{task}: arm - {data['baseline']} (paired t 95 %)", fontsize=9)
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
                    f"{task}: r={a['r']:.2f} (p={fp(a['p'])}); w/o collapsed "
                    f"r={w['r']:.2f} (p={fp(w['p'])})",
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
