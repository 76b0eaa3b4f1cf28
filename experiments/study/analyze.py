"""Before/after isotropy analysis of a study: `isojax analyze` of the pre-trained encoder and
`isojax analyze --run` of one seed's fine-tuned run per task x arm (issue 14, item 3).

    python -m experiments.study.analyze experiments/results/normalizers.jsonl \
        --runs-dir runs --seed 1

For every finished run of the results file with seed `--seed` (one per task x arm), the run's
last checkpoint (the report's "last epoch") is analysed on the dev rows it evaluated
(`analysis.analyze_run`: encoder, normaliser with its running statistics, and head, in the
dev evaluation's mode); for every task, the pre-trained encoder with the run's tokenizer and
max length (`analysis.analyze_encoder`). Each goes to `experiments/results/<study>_analysis/
<cell>/` (`summary.json` and the PNG figures of `isojax analyze`), and
`experiments/results/<study>_analysis.md` gathers one table per task: EV_3, IsoScore and mean
cosine of [CLS], of the pooled vector and of the classifier's input (after the normaliser), and
the last layer's token IsoScore. A cell whose `summary.json` exists is not analysed again, so
the script can be rerun as a grid grows. Needs the run folders (`--runs-dir` as given to
`runner.py`) of the cells not analysed yet; not the results file alone, unlike `page.py`. Run
folders are not committed: without them, one line says where they were looked for.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax

from experiments.study import records as study_records
from experiments.study.records import StudyError
from isojax import analysis, linen, runs
from isojax.data import tasks
from isojax.runs import predict
from isojax.training import build, specs

COLUMNS = (
    ("[CLS] EV_3", "cls", "EV_3"),
    ("pooled EV_3", "pooled", "EV_3"),
    ("head input EV_3", analysis.HEAD_INPUT, "EV_3"),
    ("head input IsoScore", analysis.HEAD_INPUT, "isoscore"),
    ("head input mean cos", analysis.HEAD_INPUT, "mean_cosine"),
)


def analyze_cell(run_dir: pathlib.Path, out: pathlib.Path) -> dict:
    """`analyze --run` of `run_dir`'s last checkpoint into `out`; returns the summary."""
    restored = runs.restore(run_dir)
    split = restored.task.dev_splits[0]
    rep = analysis.analyze_run(restored, predict.load_split(restored, split, labelled=True))
    analysis.write_summary(rep, out)
    analysis.write_figures(rep, out)
    return rep.summary()


def analyze_pretrained(run_dir: pathlib.Path, out: pathlib.Path) -> dict:
    """`isojax analyze` of the pre-trained encoder of `run_dir`'s config on its dev rows (those
    the run evaluated: `build.load_examples` cuts them to `max_eval_examples`)."""
    config = runs.load_config(run_dir)  # the config alone: no checkpoint is read
    module, params, tokenizer = build.load_encoder(
        config.model, config.tokenizer, max_length=config.max_length
    )
    if params is None:  # tiny-bert (tests): random weights, as `isojax analyze` draws them
        params = linen.init_params(module, jax.random.key(config.seed))
    examples = build.load_examples(
        specs.DataSpec.of(config), tasks.get_task(config.task).dev_splits[0]
    )
    rep = analysis.analyze_encoder(
        module, params, tokenizer, examples, max_length=config.max_length,
        batch_size=config.eval_batch_size,
    )  # fmt: skip
    analysis.write_summary(rep, out)
    analysis.write_figures(rep, out)
    return rep.summary()


def _cached(out: pathlib.Path, fn, *args) -> dict:
    summary = out / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())
    print(f"analysing -> {out}", flush=True)
    return fn(*args, out)


def _row(name: str, summary: dict, link: str) -> str:
    cells = []
    for _, embedding, key in COLUMNS:
        value = summary.get(embedding, {}).get(key)
        cells.append("" if value is None else f"{value:.4f}")
    tokens = summary["layers"]["token_isoscore"][-1]
    return f"| {name} | " + " | ".join(cells) + f" | {tokens:.4f} | [figures]({link}) |"


def missing_runs(chosen: list[dict], study_dir: pathlib.Path, out_root: pathlib.Path) -> list:
    """The run folders (`study_dir/<cell>`, with `config.json`) that the analysis would read and
    that are absent: a cell's folder where its summary is not cached, and for each task the
    first cell's folder where the pre-trained summary is not."""
    needed, seen_tasks = [], set()
    for r in chosen:
        task = r["fields"]["task"]
        cached = (out_root / r["cell"] / "summary.json").exists()
        if task not in seen_tasks:
            seen_tasks.add(task)
            cached = cached and (out_root / f"{task}-pretrained" / "summary.json").exists()
        if not cached:
            needed.append(study_dir / r["cell"])
    return [d for d in needed if not (d / "config.json").is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m experiments.study.analyze"
    )
    parser.add_argument("results", help="experiments/results/<study>.jsonl")
    parser.add_argument("--runs-dir", default="runs", help="the RUNS_DIR given to the study runner")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    results = pathlib.Path(args.results)
    if not results.is_file():
        print(f"study.analyze: {results}: no such results file", file=sys.stderr)
        return 2
    try:  # the runner's own reading: a torn, non-JSON or non-record line is one line
        records = study_records.read_records(results, full=True)
    except StudyError as err:
        print(f"study.analyze: {err}", file=sys.stderr)
        return 2
    chosen = [
        r for r in records
        if r["kind"] == "run" and r["status"] == "ok" and r["seed"] == args.seed
    ]  # fmt: skip
    if not chosen:
        print(f"{results}: no finished run with seed {args.seed}", file=sys.stderr)
        return 2
    study = chosen[0]["study"]
    out_root = results.parent / f"{study}_analysis"
    missing = missing_runs(chosen, pathlib.Path(args.runs_dir) / study, out_root)
    if missing:
        print(
            f"study.analyze: {len(missing)} of the {len(chosen)} runs to analyse are not in "
            f"{pathlib.Path(args.runs_dir) / study} (e.g. {missing[0]}): run folders are not "
            "committed; give --runs-dir the folder the runner ran them in (its --runs-dir), or "
            "run the cells again there (python -m experiments.study <grid file> --runs-dir "
            f"{args.runs_dir})",
            file=sys.stderr,
        )
        return 2
    by_task: dict[str, list[str]] = {}
    for r in chosen:
        run_dir = pathlib.Path(args.runs_dir) / study / r["cell"]
        task = r["fields"]["task"]
        if task not in by_task:
            pre = out_root / f"{task}-pretrained"
            summary = _cached(pre, analyze_pretrained, run_dir)
            by_task[task] = [_row("pre-trained", summary, f"{out_root.name}/{pre.name}")]
        summary = _cached(out_root / r["cell"], analyze_cell, run_dir)
        arm = r["cell"].removeprefix(f"{task}-").removesuffix(f"-s{args.seed}")
        by_task[task].append(_row(arm, summary, f"{out_root.name}/{r['cell']}"))
    names = [name for name, _, _ in COLUMNS] + ["last-layer token IsoScore", ""]
    header = "| arm | " + " | ".join(names) + " |"
    lines = [
        f"# Study `{study}`: isotropy before and after fine-tuning (seed {args.seed})",
        "",
        f"Rebuilt by `python -m experiments.study.analyze {results} --seed {args.seed}` from "
        "the runs' last checkpoints (`isojax analyze --run`) and the pre-trained encoder "
        "(`isojax analyze`), on each task's dev rows. Head input: the normalised sentence "
        "vector the classifier reads (the pooled vector itself for `none`). Per-layer "
        "IsoScore / IsoScore* and the std and |ρ| figures are in each folder.",
    ]
    for task, rows in by_task.items():
        lines += ["", f"## {task}", "", header, "|---|" + "---|" * (len(COLUMNS) + 2), *rows]
    md = results.parent / f"{study}_analysis.md"
    md.write_text("\n".join(lines) + "\n")
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
