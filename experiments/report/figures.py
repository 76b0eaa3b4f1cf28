"""The PNG figures of a study report (matplotlib, Agg backend), written beside the JSONL.

- `<stem>_scores.png`: per task, one dot per seed (last epoch) and the median per arm;
- `<stem>_curves.png`: the median dev score per epoch per arm, and below it the median
  training loss per arm over the steps (the records' points every 10 steps; log scale unless a
  penalty takes it to 0 or below);
- `<stem>_paired.png`: arm − baseline per task, last and best epoch, with the paired t 95 %
  interval (the one the verdicts print);
- `<stem>_isotropy.png`: EV3 of the pooled vector and of the head input, before and after;
- `<stem>_sweep.png` (a sweep): token IsoScore / IsoScore* against the score, collapsed runs
  circled, Pearson r in the titles;
- `<stem>_profile.png` (pooled over tasks): the performance profile of each arm, the fraction
  of runs of the normalised tasks whose normalised score exceeds τ (1 at the baseline's median,
  0 at a constant prediction's score);
- `<stem>_forest.png` (issue 48): one row per fine-tuning verdict line and pooled line
  (`verdicts.forest_rows`): the difference in the claim's frame, its 95 % interval (t,
  or the pooled line's stratified bootstrap), the paper's size as a vertical mark, coloured by
  verdict, an open marker where the verdict is epoch-sensitive (`draw_forest`, which the
  findings page's figure shares).
"""

from __future__ import annotations

import math
import pathlib

import numpy as np

from experiments.report import pooled as pool
from experiments.report import verdicts
from experiments.report.records import (
    CHANCE,
    METRIC_NAMES,
    PRETRAINED,
    arm_label,
    dev_rows,
    last_value,
)
from experiments.report.tables import fp


def figure_names(data: dict) -> list[str]:
    """The figures `write_figures` draws for `data` (`<stem>_<name>.png`), in order."""
    if not data["tasks"]:
        return []
    names = ["scores", "curves"] + ["paired"] * bool(data["baseline"]) + ["isotropy"]
    names += ["sweep"] * bool(data["sweep"])
    arms = data.get("pooled", {}).get("arms", {})
    names += ["profile"] * any(c["normalised"] for c in arms.values())
    return names + ["forest"] * bool(verdicts.forest_rows(data))


def write_figures(records: list[dict], data: dict, out: pathlib.Path, stem: str) -> dict:
    """PNG figures beside the report; returns {name: file name}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["kind"] == "run" and r["status"] == "ok"]
    draws = {"scores": _scores, "curves": _curves, "paired": _paired, "isotropy": _isotropy}
    draws |= {"sweep": _sweep, "profile": _profile, "forest": _forest}
    files = {}
    for name in figure_names(data):
        draw = draws[name]
        fig = draw(plt, runs, data)
        fig.tight_layout()
        tight = "tight" if name == "forest" else None  # its long labels and outer legend
        fig.savefig(out / f"{stem}_{name}.png", dpi=110, bbox_inches=tight)
        plt.close(fig)
        files[name] = f"{stem}_{name}.png"
    return files


def _row_of_axes(plt, data: dict, height: float, rows: int = 1):
    """(figure, `[rows, tasks]` axes), 4.2 inches wide per task."""
    n = len(data["tasks"])
    return plt.subplots(rows, n, figsize=(4.2 * n, height), squeeze=False)


def _scores(plt, runs: list[dict], data: dict):
    """Scores per arm: one dot per seed (last epoch), a bar at the median."""
    fig, axes = _row_of_axes(plt, data, 3.8)
    for ax, task in zip(axes[0], data["tasks"], strict=True):
        labels = list(data["per_task"][task]["arms"])
        for i, label in enumerate(labels):
            ys = [last_value(r) for r in runs if _label(r, data) == label and _task(r) == task]
            ax.scatter([i] * len(ys), ys, s=18, color="C0")
            ax.hlines(np.median(ys), i - 0.3, i + 0.3, color="C3")
        ax.axhline(CHANCE.get(task, 0.0), color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{task}: {METRIC_NAMES.get(task, 'score')}, dev, last epoch", fontsize=9)
    return fig


def _curves(plt, runs: list[dict], data: dict):
    """Dev score per epoch (median over seeds) per arm; below, the training loss over the
    steps (median over the seeds at each recorded step), log scale where it stays positive."""
    fig, axes = _row_of_axes(plt, data, 6.4, rows=2)
    for top, bottom, task in zip(axes[0], axes[1], data["tasks"], strict=True):
        positive = True  # a penalty can take the loss below 0: then a linear scale
        for label in data["per_task"][task]["arms"]:
            rows = [r for r in runs if _label(r, data) == label and _task(r) == task]
            epochs = sorted({e["epoch"] for r in rows for e in dev_rows(r)})
            medians = [
                np.median([e["score"] for r in rows for e in dev_rows(r) if e["epoch"] == ep])
                for ep in epochs
            ]
            top.plot(epochs, medians, marker="o", label=label)
            by_step: dict[int, list[float]] = {}
            for r in rows:
                for step, _, loss in r.get("train_loss") or []:
                    by_step.setdefault(step, []).append(loss)
            steps = sorted(by_step)
            medians = [np.median(by_step[k]) for k in steps]
            bottom.plot(steps, medians, lw=1, label=label)
            positive = positive and all(m > 0 for m in medians)
        top.set_xlabel("epoch")
        top.set_title(f"{task}: median dev score", fontsize=9)
        top.legend(fontsize=6)
        bottom.set_yscale("log" if positive else "linear")
        bottom.set_xlabel("step")
        bottom.set_title(f"{task}: median training loss", fontsize=9)
    return fig


def _paired(plt, runs: list[dict], data: dict):
    """Paired differences with their t 95 % intervals (the verdicts' interval)."""
    fig, axes = _row_of_axes(plt, data, 3.8)
    for ax, task in zip(axes[0], data["tasks"], strict=True):
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
        if pairs:
            ax.legend(fontsize=7)
        else:  # a grid in progress: the task's baseline arm, or every other, has no run yet
            ax.text(0.5, 0.5, "no arm paired with the baseline yet", ha="center",
                    va="center", transform=ax.transAxes, fontsize=8)  # fmt: skip
    return fig


def _isotropy(plt, runs: list[dict], data: dict):
    """Isotropy before / after: EV_3 of the pooled vector and of the head input."""
    fig, axes = _row_of_axes(plt, data, 3.8)
    for ax, task in zip(axes[0], data["tasks"], strict=True):
        iso = data["per_task"][task]["isotropy"]
        labels = [PRETRAINED] * (PRETRAINED in iso) + [k for k in iso if k != PRETRAINED]
        x = np.arange(len(labels))
        ax.bar(x - 0.2, [iso[k]["sentence_ev3"] for k in labels], 0.4, label="pooled")
        ax.bar(x + 0.2, [iso[k]["pre_logits_ev3"] for k in labels], 0.4, label="head input")
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{task}: EV3 (dev), median over seeds", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def _sweep(plt, runs: list[dict], data: dict):
    """Sweep: token isotropy (IsoScore, IsoScore*) against the task score, collapsed runs
    circled, Pearson r with and without them in the titles."""
    keys = (("tokens_isoscore", "IsoScore"), ("tokens_isoscore_star", "IsoScore*"))
    fig, axes = _row_of_axes(plt, data, 7, rows=2)
    for col, task in enumerate(data["tasks"]):
        sw = data["per_task"][task]["sweep"]
        pts = sw["points"]
        collapsed = [p for p in pts if p["collapsed"]]
        for row, (key, name) in enumerate(keys):
            ax = axes[row][col]
            sc = ax.scatter(
                [p[key] for p in pts],
                [p["score"] for p in pts],
                c=[p["value"] for p in pts],
                cmap="coolwarm",
                s=22,
                marker="o",
            )
            ax.scatter(
                [p[key] for p in collapsed],
                [p["score"] for p in collapsed],
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
    return fig


def _profile(plt, runs: list[dict], data: dict):
    """Performance profiles (`pooled.profile`) of the normalised scores, one per arm."""
    pooled = data["pooled"]
    arms = {label: c for label, c in pooled["arms"].items() if c["normalised"]}
    values = np.concatenate([np.concatenate(c["normalised"]) for c in arms.values()])
    taus = np.linspace(min(values.min(), 0.0), max(values.max(), 1.0) + 0.05, 201)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, c in arms.items():
        ax.step(taus, pool.profile(c["normalised"], taus), where="post", label=label)
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(f"normalised score τ ({pooled['kind']} epoch; 0 chance, 1 the baseline median)")
    ax.set_ylabel("fraction of runs with score > τ")
    excluded = f"; left out: {', '.join(pooled['excluded'])}" if pooled["excluded"] else ""
    ax.set_title(f"tasks {', '.join(pooled['normalised_tasks'])}{excluded}", fontsize=8)
    ax.legend(fontsize=7)
    return fig


def _forest(plt, runs: list[dict], data: dict):
    return draw_forest(plt, verdicts.forest_rows(data), f"{data['baseline']} as the baseline")


# Verdict (its first words) -> colour of the forest plot.
VERDICT_COLOURS = (
    ("confirmed", "tab:green"),
    ("better", "tab:green"),
    ("reversed", "tab:red"),
    ("worse", "tab:red"),
    ("smaller than claimed", "tab:orange"),
    ("equivalent", "tab:blue"),
    ("not detected", "tab:grey"),
    ("not tested", "lightgrey"),
)


def verdict_colour(verdict: str) -> str:
    return next((c for word, c in VERDICT_COLOURS if verdict.startswith(word)), "black")


def draw_forest(plt, rows: list[dict], title: str):
    """The forest plot of `rows` (`rule.Family.forest`), top to bottom in order: the
    difference and its 95 % interval, a vertical tick at the paper's size, 0 as a grey line."""
    height = 1.2 + 0.19 * len(rows)
    fig, ax = plt.subplots(figsize=(13, height))
    y = np.arange(len(rows))[::-1]
    for yi, r in zip(y, rows, strict=True):
        colour = verdict_colour(r["verdict"])
        if math.isfinite(r["lo"]):
            ax.hlines(yi, r["lo"], r["hi"], color=colour, lw=1.6)
        face = "white" if r["epoch_sensitive"] else colour
        ax.plot(r["mean"], yi, "o", ms=4.5, mfc=face, mec=colour)
        if r["size"] is not None:
            ax.plot(r["size"], yi, "|", ms=10, mew=1.6, color="black")
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(y, [_short(r["label"]) for r in rows], fontsize=6)
    ax.set_ylim(-0.8, len(rows) - 0.2)
    ax.set_xlabel("difference on the 0–1 score, in the claim's frame (95 % interval)", fontsize=8)
    handles = [ax.plot([], [], "o", color=c, label=w)[0] for w, c in VERDICT_COLOURS]
    handles.append(ax.plot([], [], "o", mfc="white", mec="black", label="epoch-sensitive")[0])
    handles.append(ax.plot([], [], "|", ms=10, mew=1.6, color="black", label="paper's size")[0])
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"fine-tuning verdict lines ({title})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    return fig


def _short(label: str, width: int = 80) -> str:
    """A row label cut to `width` characters."""
    return label if len(label) <= width else label[: width - 1] + "…"


def _task(r: dict) -> str:
    return r["fields"]["task"]


def _label(r: dict, data: dict) -> str:
    return arm_label(r, data["varied"])
