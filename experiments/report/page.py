"""Rebuilds a study's report (`<study>.md` and `<study>_*.png`) from its results JSONL alone.

    python -m experiments.report experiments/results/normalizers.jsonl

Reads the lines the study runner (`python -m experiments.study`) writes (one per cell) and
writes, beside the JSONL, the report of these modules of `experiments/report/`, each one idea:

- `records.py`: loading the JSONL (a duplicated cell, several devices, several commits
  or a dirty tree are refused with one line; the last two unless allowed by a flag) and reading
  one record;
- `stats.py`: small-n statistics (paired t interval and p, exact sign-flip p, Holm,
  Pearson / Spearman / leave-one-value-out), each tested against SciPy;
- `numbers.py`: every number of the report (`build`), as nested dicts;
- `tables.py`: its Markdown tables and the formatting of its numbers;
- `pooled.py`: statistics pooled over the tasks (probability of improvement,
  task-averaged difference, IQM of normalised scores, stratified bootstrap intervals; issue 39),
  each tested against rliable;
- `rule.py`: the rule of issue 22 (Holm-adjusted paired t-test, read against the
  paper's effect size) and the family of lines it judges together, and the pooled line of a
  claim about fine-tuning in general;
- `verdicts.py`: one verdict line per SPEC.md §9 claim and task (the sweeps' claims in
  `sweeps.py`);
- `figures.py`: the PNG figures (matplotlib's Agg backend).

The header names the code (commits), devices and JAX versions of the records. A refused JSONL
gives one line on stderr and exit status 2, and writes nothing.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys

from experiments.report import numbers, rule, stats, tables, verdicts
from experiments.report import pooled as pool
from experiments.report import records as records_io
from experiments.report.figures import write_figures

build = numbers.build
RecordsError = records_io.RecordsError


def render(records: list[dict], data: dict, files: dict, stem: str) -> str:
    """The Markdown report: header, scores, evaluations at a constant prediction's score
    (classification tasks), paired differences (with a baseline), isotropy,
    the sweep (with one), verdicts, failed cells."""
    md = _header(records, data, stem) + _scores(data, files) + _constant(data)
    md += _train_loss(data, files, records)
    if data["baseline"]:
        md += _paired(data, files)
    md += _isotropy(data, files)
    if data["sweep"]:
        md += _sweep(data, files)
    if data.get("pooled", {}).get("arms"):
        md += _pooled(data, files)
    md += ["", "## Verdicts (SPEC.md §9)", "", rule.RULE]
    if data.get("pooled", {}).get("arms"):
        md += ["", rule.POOLED_RULE]
    md += verdicts.verdict_lines(data, files) or [
        "",
        "- no claim of SPEC.md §9 is testable from these records",
    ]
    return "\n".join(md + _failed(records)) + "\n"


def _header(records: list[dict], data: dict, stem: str) -> list[str]:
    """Title; what the records are (runs, code, devices); mixed-record warnings; the recipe
    and the metric."""
    runs = [r for r in records if r["kind"] == "run"]
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in records if r["status"] == "failed"]
    commits = records_io.commit_counts(records)
    devices = records_io.device_counts(records)
    hours = sum(r.get("wall_minutes") or 0.0 for r in records) / 60.0
    md = [f"# Study `{stem}`", ""]
    md.append(
        f"Rebuilt by `python -m experiments.report experiments/results/{stem}.jsonl` from "
        f"{len(records)} records: {len(ok)} finished runs, {len(failed)} failed, "
        f"{len(records) - len(runs)} pre-trained evaluations; {hours:.1f} h of runs. "
        f"Code: {', '.join(f'{c} x{n}' for c, n in commits.items())}; device: "
        f"{', '.join(f'{d} x{n}' for d, n in devices.items())}; host: "
        f"{', '.join(f'{h} x{n}' for h, n in records_io.host_counts(records).items())}."
    )
    if len({r.get("device") for r in records}) > 1:
        md += [
            "",
            "**Mixed devices** (`--allow-mixed-devices`): the statistics below pool runs of "
            "several devices, whose wall times and rounding differ.",
        ]
    if len(commits) > 1 or any(r.get("git_dirty") for r in records):
        md += [
            "",
            "**Mixed commits** (`--allow-mixed-commits`): the statistics below pool runs of "
            "several commits or of a dirty tree, whose code may differ.",
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
    return md + [
        "",
        "Metric: the task's dev score ("
        + "; ".join(f"{t}: {records_io.METRIC_NAMES.get(t, 'score')}" for t in data["tasks"])
        + ").",
    ]


def _scores(data: dict, files: dict) -> list[str]:
    return [
        "",
        "## Scores",
        "",
        "Last epoch, and best dev epoch (the [IsoBN] protocol: selected and "
        "reported on the same dev set)." + _figure(files, "scores", "curves"),
        "",
        *tables.scores_table(data),
    ]


def _train_loss(data: dict, files: dict, records: list[dict] = ()) -> list[str]:
    table = tables.train_loss_table(data)
    if not table:
        return []
    return [
        "",
        "## Training loss",
        "",
        "Each run's mean training loss per epoch (the loss the optimiser minimised: "
        "cross-entropy, or squared error for STS-B, plus any penalty); the median over the runs "
        "and their range. Without a penalty, a loss that stays near its first epoch's, or "
        "rises, is a task not learnt."
        + _figure(files, "curves")
        + " (bottom row: the median over the runs every "
        "10 steps).",
        "",
        *table,
        *_centred_caveat(data, records),
    ]


# Heads that centre their input on the batch (`whiten`: on its running mean), by method.
CENTRED = ("recenter", "batchnorm", "whiten", "iternorm")


def _centred_caveat(data: dict, records: list[dict]) -> list[str]:
    """Issue 62: a head that centres its input leaves a regression target's mean (STS-B's
    labels, 2.70) to the classifier's bias, which AdamW moves by about the sum of the learning
    rates (0.027 over the recipe): its STS-B training loss stays near 8 and its predictions
    sit about 2.7 low, while the dev correlation does not see the offset. Where the records
    have such an arm on STS-B whose runs started the bias at 0 (no `label_mean_bias` in
    their config: before 0.5.0): the caveat, with their last epoch's median losses."""
    arms = data["per_task"].get("stsb", {}).get("arms", {})
    zero_start = {
        r["fields"]["method"]
        for r in records
        if r["kind"] == "run"
        and r["fields"]["task"] == "stsb"
        and not (r.get("config") or {}).get("label_mean_bias")
    }
    centred = [
        a for a in arms if a.split()[0].split("-")[0] in CENTRED and a.split()[0] in zero_start
    ]
    if not centred:
        return []

    def loss(label: str) -> str:
        losses = arms[label]["train_loss"]
        return f"{label} {losses[max(losses)]['median']:.2f}" if losses else f"{label} n/a"

    others = [a for a in arms if a not in centred]
    return [
        "",
        "**Caveat: a head that centres its input cannot learn STS-B's label mean** (issue 62). "
        f"{', '.join(f'`{a}`' for a in centred)} centre{'s' * (len(centred) == 1)} the head "
        "input on the batch (`whiten` on its running mean), so the batch mean of the "
        "predictions is the classifier's bias alone. The bias must carry the training labels' "
        "mean (2.70 on STS-B), but AdamW moves a parameter by about the learning rate per "
        "update, about 0.027 over the recipe: the "
        "squared error keeps most of the offset, so their STS-B training loss stays near 8 "
        "while an uncentred head's falls, and `isojax predict` writes their similarity scores "
        "about 2.7 below the labels' scale. The dev score (Pearson and Spearman) ignores the "
        "offset, so it does not see it. These runs start the bias at 0; from 0.5.0 a "
        "regression head's starts at the training labels' mean (`config.label_mean_bias`). "
        "Here, the median training loss of the last epoch on "
        f"STS-B: {', '.join(loss(a) for a in others + centred)} "
        "(`tests/experiments/test_centred_head_offset.py` reproduces the mechanism on "
        "synthetic data).",
    ]


def _constant(data: dict) -> list[str]:
    table = tables.constant_table(data)
    if not table:
        return []
    return [
        "",
        "## Evaluations at a constant prediction's score",
        "",
        "Dev evaluations whose score equals, to 1e-6, that of predicting one class for every "
        f"dev example ({tables.constant_note(data)}): a sign that the run predicts one "
        "class, not a proof (another prediction can score the same). Counted over the "
        "epochs before each run's last, and over the runs' last epochs.",
        "",
        *table,
    ]


def _paired(data: dict, files: dict) -> list[str]:
    return [
        "",
        f"## Paired differences against `{data['baseline']}`",
        "",
        f"Mean of (arm − {data['baseline']}) over the seeds both have, its paired t 95 % "
        "interval and two-sided t-test p (the verdicts' statistics), and for the best epoch "
        f"the percentile bootstrap 95 % interval ({stats.RESAMPLES} resamples of the seeds, "
        f"NumPy `default_rng({stats.BOOTSTRAP_SEED})`), a figure only: {_bootstrap_note(data)}"
        + _figure(files, "paired"),
        "",
        *tables.paired_table(data),
    ]


def _bootstrap_note(data: dict) -> str:
    """Why the bootstrap interval is a figure, at the table's numbers of seeds: with n seeds the
    resampled mean takes at most C(2n − 1, n) values, and the interval excludes 0 whenever the
    n differences share a sign."""
    ns = sorted(
        {p["best"]["n"] for t in data["tasks"] for p in data["per_task"][t]["paired"].values()}
        | {a["best"]["n"] for a in data["task_average"].values()}
    )
    ns = [n for n in ns if n >= 2]
    if not ns:
        return "no arm shares two seeds with the baseline yet."
    values = ", ".join(f"{math.comb(2 * n - 1, n)} at n = {n}" for n in ns)
    return (
        f"with n = {' to '.join(map(str, dict.fromkeys((ns[0], ns[-1]))))} seeds the resampled "
        f"mean takes at most C(2n − 1, n) values ({values}) and the interval excludes 0 "
        "whenever the n differences share a sign."
    )


def _figure(files: dict, *names: str) -> str:
    """` Figure: [name](file)` (` Figures: ...` for several), leaving out a figure that was not
    drawn (no rows for it yet); nothing where none was."""
    links = [f"[{name}]({files[name]})" for name in names if files.get(name)]
    return f" Figure{'s' if len(links) > 1 else ''}: {', '.join(links)}" if links else ""


def _isotropy(data: dict, files: dict) -> list[str]:
    return [
        "",
        "## Isotropy before and after fine-tuning",
        "",
        "Dev set; `pretrained`: the step-0 model (pre-trained encoder, fresh head); the arms: "
        "median over seeds at the last epoch. EV3 of the pooled vector and of the classifier's "
        "input (after the normaliser), mean pairwise cosine of the pooled vectors, all-layer "
        "token IsoScore, and IsoScore* (ζ of the run, shrunk towards the run's C0: I-STAR runs "
        "only)." + _figure(files, "isotropy"),
        "",
        *tables.isotropy_table(data),
    ]


def _sweep(data: dict, files: dict) -> list[str]:
    istar = data["sweep"] == "istar.weight"
    return [
        "",
        f"## Isotropy against the task score over `{data['sweep']}`",
        "",
        "All-layer token IsoScore and IsoScore* (dev, last epoch) against the dev score over "
        "every (value, seed) run: Pearson r and two-sided p (SciPy), Spearman ρ and p, the "
        "range of Pearson r when the runs of each swept value are left out in turn (and "
        "which value), then Pearson without the collapsed runs. Collapsed: last-epoch score "
        "− chance < (baseline median − chance) / 2, chance being a constant prediction's "
        f"score ({tables.chance_note()}); the rule is not applied (n/a) where the baseline's "
        "median is within 1/√n_dev of chance, where halfway to it is noise (n_dev: "
        f"{tables.dev_size_note()})."
        + (" The papers had 7 λ × 5 seeds = 35 runs per cell." if istar else "")
        + _figure(files, "sweep"),
        "",
        *tables.sweep_table(data),
    ]


def _pooled(data: dict, files: dict) -> list[str]:
    pooled = data["pooled"]
    excluded = ", ".join(
        f"{t} (median {tables.f(m)}, chance {records_io.CHANCE.get(t, 0.0):.3f}, "
        f"1/√{records_io.DEV_SIZE.get(t, '?')} = {records_io.chance_margin(t):.3f})"
        for t, m in pooled["excluded"].items()
    )
    figure = _figure(files, "profile")
    return [
        "",
        "## Pooled over tasks",
        "",
        f"Each arm against `{data['baseline']}` over the tasks where both have runs, treated as "
        f"a sample of the benchmark ({pooled['kind']} epoch; `pooled.py`, after rliable): "
        "P(arm > baseline), per task the Mann–Whitney U over n_arm · n_base (ties ½), averaged "
        "over the tasks; the task-averaged difference of means on the raw score; the IQM (25 % "
        "trimmed mean over every run of every task) of the normalised score (score − chance) / "
        f"({data['baseline']} median − chance), chance being a constant prediction's score. "
        f"Intervals: stratified bootstrap 95 % (percentile), {pool.DRAWS} draws, NumPy "
        f"`RandomState({pool.SEED})`, each arm's runs resampled within each task. Normalised "
        f"tasks: {', '.join(pooled['normalised_tasks']) or 'none'}; left out of the IQM and the "
        f"profile, where the {data['baseline']} median is within 1/√n_dev of chance: "
        f"{excluded or 'none'}.{figure}",
        "",
        *tables.pooled_table(data),
    ]


def _failed(records: list[dict]) -> list[str]:
    failed = [r for r in records if r["status"] == "failed"]
    if not failed:
        return []
    md = ["", "## Failed cells", "", "| cell | error |", "|---|---|"]
    for r in failed:
        first = (r.get("error") or "").splitlines()[0] if r.get("error") else ""
        md.append(f"| {r['cell']} | {first.replace('|', '/')} |")
    return md


def write_report(
    results: str | pathlib.Path,
    allow_mixed_devices: bool = False,
    allow_mixed_commits: bool = False,
) -> pathlib.Path:
    """Writes `<stem>.md` and `<stem>_*.png` beside `results`; returns the Markdown path.
    A refused JSONL (`records.load`) raises RecordsError before anything is written."""
    results = pathlib.Path(results)
    records = records_io.load(
        results, allow_mixed_devices=allow_mixed_devices, allow_mixed_commits=allow_mixed_commits
    )
    data = build(records)
    stem = results.stem
    files = write_figures(records, data, results.parent, stem)
    path = results.with_suffix(".md")
    path.write_text(render(records, data, files, stem))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m experiments.report"
    )
    parser.add_argument(
        "results", help="a study's JSONL, e.g. experiments/results/normalizers.jsonl"
    )
    parser.add_argument(
        "--allow-mixed-devices",
        action="store_true",
        help="pool records of several devices (refused by default; the header names them)",
    )
    parser.add_argument(
        "--allow-mixed-commits",
        action="store_true",
        help="pool records of several commits or of a dirty tree (refused by default; the "
        "header names them)",
    )
    args = parser.parse_args(argv)
    try:
        path = write_report(
            args.results,
            allow_mixed_devices=args.allow_mixed_devices,
            allow_mixed_commits=args.allow_mixed_commits,
        )
    except RecordsError as err:
        print(f"report.py: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
