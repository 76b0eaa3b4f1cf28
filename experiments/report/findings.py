"""Builds the documentation's study findings page, docs/study/findings.md, from the study
JSONLs alone, with the report's own functions (`numbers.build`,
`verdicts.verdict_lines`): one table of every SPEC.md §9 claim, each with the verdict
lines the records give (verdict, interval, p values, n), or the reason none is possible here.

    python -m experiments.report.findings          # writes docs/study/findings.md and its
                                                   # forest plot, docs/study/findings_forest.png
    python -m experiments.report.findings --check  # exit 1 if the page is stale

A study is read from `experiments/results/<study>.jsonl` and, for the GPU records,
`experiments/results/gpu/<study>.jsonl` (experiments/device/README.md), each where it exists;
a study with neither gets its claims' "no records yet" rows.

Nothing is copied by hand: run it after `experiments/report/page.py` regenerates a report (and
`bash experiments/docs.sh` runs it before every build).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys

from experiments.report import calibration, figures, numbers, rule, verdicts
from experiments.report import records as records_io

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
PAGE = ROOT / "docs" / "study" / "findings.md"
FOREST = PAGE.with_name("findings_forest.png")
STUDIES = ("normalizers", "istar_lambda", "istar_zeta", "cosreg", "whitening", "whitening_why")

# Why some of what SPEC.md §9 claims cannot be measured here.
ONLY_MINILM = (
    "BERT-base, RoBERTa, ALBERT and DistilBERT weights are not installable here: MiniLM-L6 is "
    "the only real pre-trained encoder (SPEC.md §8)"
)
ONLY_FOUR_TASKS = (
    "the SST-2, QQP, MNLI and QNLI train sets are not offline: the study has CoLA, MRPC, STS-B "
    "and RTE"
)


@dataclasses.dataclass(frozen=True)
class Claim:
    """A SPEC.md §9 claim: the prefixes of the verdict lines that test it, and what of it the
    records here cannot test."""

    text: str
    prefixes: tuple[str, ...]
    untestable: str
    study: str  # the grid that tests it


CLAIMS = (
    Claim(
        "[IsoBN] IsoBN on the pooled [CLS] improves fine-tuning (about +1.0 on the GLUE average, "
        "largest on RTE, MRPC, CoLA, STS-B)",
        ("[IsoBN] IsoBN improves fine-tuning",),
        f"on BERT-base and RoBERTa, and on the seven-task average: {ONLY_MINILM}; "
        f"{ONLY_FOUR_TASKS}",
        "normalizers",
    ),
    Claim(
        "[IsoBN] pre-trained [CLS] embeddings are anisotropic (EV3 ≈ 0.86 for BERT-base)",
        ("[IsoBN] pre-trained sentence vectors are anisotropic",),
        f"on BERT-base: {ONLY_MINILM}",
        "normalizers",
    ),
    Claim(
        "[IsoBN] batch normalisation lowers EV3 of what the classifier reads only a little",
        ("[IsoBN] batch normalisation lowers EV3",),
        f"on BERT-base: {ONLY_MINILM}",
        "normalizers",
    ),
    Claim(
        "[IsoBN] IsoBN lowers it a lot (more than batch normalisation)",
        ("[IsoBN] IsoBN lowers EV3",),
        f"on BERT-base: {ONLY_MINILM}",
        "normalizers",
    ),
    Claim(
        "[EmbNorm] normalising the [CLS] embedding before the classifier improves text "
        "classification",
        ("[EmbNorm]",),
        f"on BERT: {ONLY_MINILM}; {ONLY_FOUR_TASKS}",
        "normalizers",
    ),
    Claim(
        "[EmbNorm] the [CLS] embedding is not zero-centred and is dominated by a few dimensions",
        (),
        "a description, not a difference over seeds: the per-layer figures of "
        "`experiments/results/normalizers_analysis.md` show it for MiniLM-L6",
        "normalizers",
    ),
    Claim(
        "[I-STAR] isotropy is negatively correlated with fine-tuning performance (r over "
        "7 λ × 5 seeds per cell)",
        ("[I-STAR] isotropy",),
        f"on BERT, ALBERT and DistilBERT: {ONLY_MINILM}; on QQP: {ONLY_FOUR_TASKS}",
        "istar_lambda",
    ),
    Claim(
        "[I-STAR] λ < 0 (less isotropy) helps on most tasks and models",
        ("[I-STAR] λ < 0 helps",),
        f"on the paper's models: {ONLY_MINILM}",
        "istar_lambda",
    ),
    Claim(
        "[I-STAR] the best ζ lies in [0.2, 0.8]; ζ = 0 hurts; ζ = 1 is slightly worse",
        ("[I-STAR] the best ζ", "[I-STAR] ζ = 0", "[I-STAR] ζ = 1"),
        f"on the paper's models: {ONLY_MINILM}",
        "istar_zeta",
    ),
    Claim(
        "[CosReg] CosReg does not change isotropy",
        ("[CosReg] λ = +1 leaves", "[CosReg] λ = -1 leaves"),
        f"on ALBERT and QNLI: {ONLY_MINILM}; {ONLY_FOUR_TASKS}",
        "cosreg",
    ),
    Claim(
        "[CosReg] CosReg moves the mean of one outlier dimension (ALBERT, QNLI: 11.72 → 27.33 "
        "at λ = −1, 2.84 at λ = +1)",
        ("[CosReg] λ = +1 lowers the |mean|", "[CosReg] λ = -1 raises the |mean|"),
        f"the paper's levels on ALBERT and QNLI: {ONLY_MINILM}; {ONLY_FOUR_TASKS}",
        "cosreg",
    ),
    Claim(
        "[CosReg] … which swings the mean cosine between about 0.003 and 0.998",
        ("[CosReg] λ = +1 lowers the last-layer", "[CosReg] λ = -1 raises the last-layer"),
        f"on ALBERT and QNLI: {ONLY_MINILM}; {ONLY_FOUR_TASKS}",
        "cosreg",
    ),
    # Beyond the papers (SPEC.md §10, issue 38): the study's own hypotheses about whitening.
    Claim(
        "[Whitening] running ZCA whitening lowers the head input's EV3 more than IsoBN",
        ("[Whitening] whiten lowers EV3 of the classifier input more",),
        f"on other encoders: {ONLY_MINILM}",
        "whitening",
    ),
    Claim(
        "[Whitening] whitening lowers the head input's EV3 below none's",
        ("[Whitening] whiten lowers EV3 of the classifier input below",),
        f"on other encoders: {ONLY_MINILM}",
        "whitening",
    ),
    Claim(
        "[Whitening] whitening improves fine-tuning over none",
        ("[Whitening] whiten improves fine-tuning",),
        f"on other encoders: {ONLY_MINILM}; {ONLY_FOUR_TASKS}",
        "whitening",
    ),
    Claim(
        "[Whitening] whitening vs IsoBN (fine-tuning score)",
        ("[Whitening] whiten vs IsoBN",),
        f"on other encoders: {ONLY_MINILM}",
        "whitening",
    ),
    # The causal grid of issue 47: why running whitening breaks fine-tuning, one mechanism each.
    *(
        Claim(text, (prefix,), f"on other encoders: {ONLY_MINILM}", "whitening_why")
        for text, prefix in (
            ("[Whitening why] the gradient through the batch statistics helps (iternorm against "
             "iternorm with its statistics detached)", "[Whitening why] the gradient"),
            ("[Whitening why] whitening in groups of 16 helps (iternorm-g16 against iternorm)",
             "[Whitening why] groups"),
            ("[Whitening why] the head's dropout noise hurts whiten (whiten without dropout "
             "against whiten)", "[Whitening why] the head's dropout"),
            ("[Whitening why] shrinkage helps whiten (α = 0.5 against the default 0.1)",
             "[Whitening why] shrinkage"),
            ("[Whitening why] iternorm trains as well as none (equivalent within ±0.010)",
             "[Whitening why] iternorm trains as well"),
        )
    ),
)  # fmt: skip

LINE = re.compile(r"^- (?P<head>.*?): \*\*(?P<verdict>[^*]+)\*\*(?: \((?P<details>.*)\))?$")


def study_verdicts(jsonl: str | pathlib.Path) -> list[str]:
    """The verdict lines ("- claim, where: **verdict** (...)") of the report of `jsonl`, as
    `experiments/report/page.py` writes them into its "Verdicts" section, figure links included."""
    return study(jsonl)[0]


def study(jsonl: str | pathlib.Path) -> tuple[list[str], list[dict]]:
    """(the verdict lines of `jsonl`'s report, its forest plot's rows)."""
    lines, rows, _ = study_data(jsonl)
    return lines, rows


def study_data(jsonl: str | pathlib.Path) -> tuple[list[str], list[dict], dict]:
    """(the verdict lines of `jsonl`'s report, its forest plot's rows, `numbers.build`'s
    data)."""
    records = records_io.load(pathlib.Path(jsonl))
    data = numbers.build(records)
    stem = pathlib.Path(jsonl).stem
    files = {name: f"{stem}_{name}.png" for name in figures.figure_names(data)}
    lines = [line for line in verdicts.verdict_lines(data, files) if line.startswith("- ")]
    return lines, verdicts.forest_rows(data), data


def _cell(text: str, study: str = "") -> str:
    """A table cell: the report's links (figure names beside the JSONL) made relative to the
    page, and no `|` left to split the row."""
    where = "../../experiments/results/" + (study.rsplit("/", 1)[0] + "/" if "/" in study else "")
    text = re.sub(r"\]\((?P<file>[^)/]+\.(?:png|md))\)", rf"]({where}\g<file>)", text)
    return text.replace("|", "\\|")


def rows(lines_by_study: dict[str, list[str]], claim: Claim) -> list[str]:
    """The table rows of one claim: one per verdict line that tests it, then what it cannot."""
    out = []
    for study, lines in lines_by_study.items():
        for line in lines:
            m = LINE.match(line)
            if not m or not any(m["head"].startswith(p) for p in claim.prefixes):
                continue
            report = f"[{study}](../../experiments/results/{study}.md)"
            out.append(
                f"| {_cell(claim.text, study)} | {report}: {_cell(m['head'], study)} | "
                f"**{m['verdict']}** | {_cell(m['details'] or '', study)} |"
            )
    if not out:
        studies = {name.rsplit("/", 1)[-1] for name in lines_by_study}
        reason = (
            f"no verdict line: the `{claim.study}` grid has no records yet "
            f"(`experiments/configs/study_{claim.study}.py`)"
            if claim.study not in studies
            else "no verdict line in these records"
        )
        if not claim.prefixes:
            reason = "no verdict line"
        out.append(f"| {claim.text} | — | {reason} | |")
    out.append(f"| {claim.text} | — | **not possible here** | {claim.untestable} |")
    return out


def calibration_section(results: dict[tuple[str, int], dict]) -> list[str]:
    """The page's section of the rules calibrated on the studies' null runs (issue 62)."""
    intro = [
        "",
        "## The rules calibrated on the study's own null runs",
        "",
        "How often each rule says confirmed, reversed or smaller when the truth is no "
        "difference, and its power, on real runs (`experiments/report/calibration.py`): the "
        "baseline's (`none`) runs at the seeds every task shares are split into two pseudo-arms "
        "of n (every ordered pair of disjoint n-sets), paired by rank, and judged as arm − "
        "none by the per-task rule (the tasks and their average, Holm over them, IsoBN's size "
        f"+{calibration.sizes.ISOBN.bound:.3f}, and the equivalence margin "
        f"±{calibration.MARGIN:.3f}) and by the pooled rule (its paired p values exact over "
        "every sign pattern), then again with +0.010 and +0.020 added to the arm's scores. At "
        "no difference a 'smaller than claimed' is true; at +0.010, where the truth is the "
        "size, it is false; at +0.020 an 'equivalent within ±0.010' is false. Rates are "
        "fractions of the splits (for the per-task row, of the split's task lines); the "
        "splits share seeds, so they are not independent draws.",
        "",
    ]
    if not results:
        return intro + [
            "No study has twice the seeds of the smallest family's n (3) on its baseline "
            "at every task yet."
        ]
    return intro + calibration.table(results)


def render(
    lines_by_study: dict[str, list[str]],
    refused: dict[str, str],
    forest: str = "",
    calibrated: dict[tuple[str, int], dict] | None = None,
) -> str:
    studies = ", ".join(
        f"[{s}](../../experiments/results/{s}.md) ({len(v)} verdict lines)"
        for s, v in lines_by_study.items()
    )
    md = [
        "# Study findings",
        "",
        "<!-- Generated by `python -m experiments.report.findings` from "
        "experiments/results/*.jsonl; do not edit. -->",
        "",
        "What the reproduction study finds for each claim of SPEC.md §9, on MiniLM-L6 "
        "(all-MiniLM-L6-v2) fine-tuned on CoLA, MRPC, STS-B and RTE over seeds. Every row is a "
        "verdict line of a study report, rebuilt from its JSONL by the report's own functions "
        "(`experiments/report/numbers.py`, `experiments/report/verdicts.py`); the full reports, "
        "with their tables and figures, are linked in each row. Reports: "
        + (studies or "none yet")
        + ".",
        "",
        *(
            [
                "Every fine-tuning verdict line and pooled line at a glance: the difference, its "
                "95 % interval and the paper's size (a black tick), coloured by verdict; an open "
                "marker is an epoch-sensitive verdict.",
                "",
                f"![forest plot of the fine-tuning verdict lines]({forest})",
                "",
            ]
            if forest
            else []
        ),
        rule.RULE,
        "",
        rule.POOLED_RULE,
        "",
        "| claim (SPEC.md §9) | report: line | verdict | difference, t 95 % interval, p, n |",
        "|---|---|---|---|",
    ]
    for claim in CLAIMS:
        group = rows(lines_by_study, claim)
        # The claim is named on its first row only.
        md += group[:1] + [row.replace(f"| {claim.text} |", "| |", 1) for row in group[1:]]
    if calibrated is not None:
        md += calibration_section(calibrated)
    for study, why in refused.items():
        md += ["", f"`{study}.jsonl` was not read: {why}"]
    return "\n".join(md) + "\n"


def jsonls(results: pathlib.Path = RESULTS) -> dict[str, pathlib.Path]:
    """Report name ("whitening", "gpu/whitening_why") -> its JSONL, for every study of
    `STUDIES` whose CPU or GPU JSONL exists."""
    out = {}
    for name in STUDIES:
        for key, path in ((name, results / f"{name}.jsonl"),
                          (f"gpu/{name}", results / "gpu" / f"{name}.jsonl")):  # fmt: skip
            if path.exists():
                out[key] = path
    return out


def build_page(results: pathlib.Path = RESULTS, forest: pathlib.Path | None = None) -> str:
    """The page's Markdown; with `forest`, its forest plot is drawn there (and linked)."""
    lines_by_study, refused, rows, calibrated = {}, {}, [], {}
    for name, path in jsonls(results).items():
        try:
            lines_by_study[name], study_rows, data = study_data(path)
        except records_io.RecordsError as err:
            refused[name] = str(err)
            continue
        rows += [r | {"label": f"{name}: {r['label']}"} for r in study_rows]
        for n, result in calibration.study_calibration(data).items():
            calibrated[name, n] = result
    if forest is not None and rows:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = figures.draw_forest(plt, rows, "every study")
        fig.tight_layout()
        fig.savefig(forest, dpi=110, bbox_inches="tight")
        plt.close(fig)
    return render(lines_by_study, refused, FOREST.name if rows else "", calibrated)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m experiments.report.findings"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    if args.check:
        page = build_page()
        stale = not PAGE.exists() or PAGE.read_text() != page
        stale = stale or (FOREST.name in page and not FOREST.exists())
        print(f"{PAGE}: {'stale' if stale else 'up to date'}")
        return int(stale)
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    page = build_page(forest=FOREST)
    PAGE.write_text(page)
    print(PAGE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
