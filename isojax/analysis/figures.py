"""The isotropy report's table, ``summary.json`` and figures (``isojax analyze``): what is
written of a `isojax.analysis.encoder.Report`, whose numbers `isojax.analysis.encoder` computes.
Plotting uses matplotlib's Agg backend, imported only when figures are written.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from isojax.analysis.encoder import DROPOUT, GEOMETRY, HEAD_INPUT, OUTLIER_SCORE, Report

__all__ = ["format_table", "write_figures", "write_summary"]


def format_table(summary: dict[str, Any]) -> str:
    """Plain-text tables of a `Report.summary()`: one row per embedding, one per layer."""
    cols = ("count", "EV_1", "EV_3", "isoscore", "participation_ratio", "mean_cosine")
    heads = ("n", "EV_1", "EV_3", "IsoScore", "PR", "mean cos")
    lines = ["embedding " + "".join(f"{h:>10}" for h in heads)]
    for name, values in summary.items():
        if name in ("layers", DROPOUT, OUTLIER_SCORE) or not isinstance(values, dict):
            continue
        cells = [f"{values['count']:>10d}"] + [f"{values[c]:>10.4f}" for c in cols[1:]]
        lines.append(f"{name:<10}" + "".join(cells))
    lines += _geometry_lines(summary)
    if noise := summary.get(DROPOUT):
        lines += [
            "",
            f"head input, {noise['examples']} rows: spread between sentences "
            f"{noise['between_sentences']:.4f}; one draw of dropout moves a row by "
            f"{noise['dropout']:.4f} (dropout / spread "
            + ("—" if noise["dropout_to_spread"] is None else f"{noise['dropout_to_spread']:.3f}")
            + ")",
        ]
    layers = summary["layers"]
    zeta = layers["zeta"]
    heads = ("CLS iso", f"CLS iso*{zeta:g}", "tok iso", f"tok iso*{zeta:g}")
    keys = ("cls_isoscore", "cls_isoscore_star", "token_isoscore", "token_isoscore_star")
    lines += ["", "layer " + "".join(f"{h:>14}" for h in heads)]
    for i in range(len(layers[keys[0]])):
        lines.append(f"{i + 1:<6}" + "".join(f"{layers[k][i]:>14.4f}" for k in keys))
    return "\n".join(lines)


def _geometry_lines(summary: dict[str, Any]) -> list[str]:
    """The table of the `GEOMETRY` keys, and the principal outlier's 1-D scores if any."""
    lines = []
    heads = ("erank", "RankMe", "outliers", "principal", "share")
    lines += ["", "embedding " + "".join(f"{h:>10}" for h in heads)]
    for name, values in summary.items():
        if name in ("layers", DROPOUT, OUTLIER_SCORE) or not isinstance(values, dict):
            continue
        cells = [f"{values[k]:>10.2f}" for k in GEOMETRY[:2]]
        cells += [f"{values[k]:>10d}" for k in GEOMETRY[2:4]] + [f"{values[GEOMETRY[4]]:>10.4f}"]
        lines.append(f"{name:<10}" + "".join(cells))
    if scores := summary.get(OUTLIER_SCORE):
        lines += ["", "principal outlier (of train) alone, its 1-D rule fitted on train:"]
        for name, result in scores.items():
            metric = ", ".join(f"{k} {v:.4f}" for k, v in result["dev"].items() if k != "score")
            lines.append(
                f"{name:<10} dimension {result['dimension']:>4} (train share "
                f"{result['train_share']:.3f}): score {result['score']:.4f} ({metric})"
            )
    return lines


def write_summary(rep: Report, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write ``summary.json`` (the scalars of `Report.summary`) into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps(rep.summary(), indent=2) + "\n")
    return path


def write_figures(rep: Report, out_dir: str | os.PathLike) -> list[pathlib.Path]:
    """PNG figures of a report: EV_k curve, std histogram, ``|ρ|`` heat map, per-layer scores.

    The std histogram and the ``|ρ|`` map are of the [CLS] vectors and, for a fine-tuned run,
    of the head's input too.

    Returns:
      The paths written: ``ev_curve.png``, ``std_histogram.png``, ``abs_correlation.png``,
      (a fine-tuned run: ``pre_logits_std_histogram.png``, ``pre_logits_abs_correlation.png``),
      ``layer_isoscore.png``.
    """
    import matplotlib

    matplotlib.use("Agg")  # Files only, no display; safe before pyplot is imported.
    from matplotlib import pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name):
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, values in rep.embeddings.items():
        curve = np.cumsum(values["ev_ratio"])
        ax.plot(np.arange(1, len(curve) + 1), curve, label=f"{name} (EV_3 {values['EV_3']:.2f})")
    ax.set(xscale="log", xlabel="k principal axes", ylabel="EV_k", ylim=(0, 1.01))
    ax.set_title("Explained variance")
    ax.legend()
    save(fig, "ev_curve.png")

    per_dimension = {"cls": ("", "[CLS]"), HEAD_INPUT: (f"{HEAD_INPUT}_", "head input")}
    for name, (prefix, title) in per_dimension.items():
        if name not in rep.embeddings:
            continue
        values = rep.embeddings[name]
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.hist(values["std"], bins=50)
        ax.set(xlabel="standard deviation", ylabel="dimensions", title=f"{title} per-dimension std")
        save(fig, f"{prefix}std_histogram.png")

        fig, ax = plt.subplots(figsize=(5, 4.5))
        image = ax.imshow(
            values["abs_corr"], vmin=0, vmax=1, cmap="viridis", interpolation="nearest"
        )
        fig.colorbar(image, ax=ax, label="|ρ|")
        ax.set(xlabel="dimension", ylabel="dimension", title=f"{title} |correlation|")
        save(fig, f"{prefix}abs_correlation.png")

    fig, ax = plt.subplots(figsize=(5, 3.5))
    layers = np.arange(1, len(rep.layers["cls_isoscore"]) + 1)
    labels = {
        "cls_isoscore": "[CLS] IsoScore",
        "cls_isoscore_star": f"[CLS] IsoScore* (ζ={rep.zeta:g})",
        "token_isoscore": "tokens IsoScore",
        "token_isoscore_star": f"tokens IsoScore* (ζ={rep.zeta:g})",
    }
    for key, label in labels.items():
        ax.plot(layers, rep.layers[key], marker="o", label=label)
    ax.set(xlabel="layer", ylabel="score", ylim=(0, 1), xticks=layers, title="Isotropy per layer")
    ax.legend(fontsize="small")
    save(fig, "layer_isoscore.png")
    return paths
