"""One point per run: what the head reads against the dev score (issue 47).

    python -m experiments.report.why RUNS_DIR [--results RESULTS.jsonl] [--out OUT.jsonl] \
        [--max-train-examples 2048] [--figure PNG] [--study whitening_why]

For every finished run folder `RUNS_DIR/<study>/<cell>/` (a study cell's `isojax finetune`
folder: `results.json` written and not a stop record), its best dev checkpoint
(`isojax.runs.restore(best=True)`) is analysed on the dev split the run evaluated and the first
`--max-train-examples` train rows (`isojax.analysis.run.analyze_run`), and one JSON line goes to
`--out` (default `experiments/results/whitening_why_runs.jsonl`):

- ``cell``, ``study``, ``task``, ``arm`` (the record's ``method``, else the cell name's),
  ``seed``, ``checkpoint`` (step and epoch), ``dev_rows``, ``train_rows``;
- ``dev_score``: the best dev score, the `--results` record's (its epochs' maximum) where it
  has the cell, else the run's own (the best checkpoint's saved evaluation); ``dev_score_from``
  says which;
- ``head_input_dropout`` (`run.dropout_noise`: spread between sentences, how far one draw of
  dropout moves a row) and ``noise_to_spread``, their ratio;
- ``sentence`` ("pooled" or "cls") and, for the head input ``pre_logits`` and that sentence
  vector, on dev: the geometry of SPEC.md §10.4 (``erank``, ``rankme``, ``outliers``,
  ``principal_outlier``, ``principal_outlier_share``), ``EV_1``, ``mean_cosine``, and
  ``outlier_score``, the 1-D rule of train's principal outlier scored on dev
  (`isojax.analysis.outliers`: ``dimension``, ``train_share``, ``rule``, ``dev``, ``score``).

Lines are appended one `write` each (``O_APPEND``); a cell already in `--out` is not analysed
again, so a rerun resumes as the grid grows. An unfinished folder is skipped with one logged
line; a bad one (no checkpoint, a config that does not restore, missing data) is logged with
its folder and the others go on; the exit status is then 1. `--figure` (default
`experiments/results/whitening_why_mechanism.png`) draws every line of `--out`: one row per
task, the dev score against the noise-to-spread (log scale), the head input's EV_1 and its
principal outlier's 1-D score, one point per run, coloured by arm; a dashed line at the
best constant prediction's score (`experiments.report.records.CHANCE`), a dotted one where the
1-D score equals the dev score.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "experiments" / "results"
DEFAULT_OUT = RESULTS_DIR / "whitening_why_runs.jsonl"
DEFAULT_FIGURE = RESULTS_DIR / "whitening_why_mechanism.png"
STUDY = "whitening_why"
HEAD_INPUT = "pre_logits"  # isojax.analysis.HEAD_INPUT, without importing jax to parse flags
# Per vector: the geometry of SPEC.md §10.4 (isojax.analysis.GEOMETRY), EV_1, the mean cosine.
GEOMETRY = ("erank", "rankme", "outliers", "principal_outlier", "principal_outlier_share")
VECTOR_KEYS = (*GEOMETRY, "EV_1", "mean_cosine")
# The figure's colour order (the whitening_why arms); any other arm follows, sorted.
ARMS = ("none", "whiten", "iternorm", "iternorm-sg", "iternorm-g16", "whiten-nodrop", "whiten-a05")

logger = logging.getLogger("experiments.report.why")


class BadRun(ValueError):
    """A run folder that cannot be analysed (one-line message naming it)."""


def not_finished(folder: pathlib.Path) -> str | None:
    """Why `folder` holds no finished run (None: it does): no run at all (a pre-trained cell's
    folder), no `results.json` yet, or a stop record. A `results.json` that is not a JSON
    object raises `BadRun`."""
    from isojax import runs

    if not runs.is_run_folder(folder):
        return "no run in it"
    path = folder / "results.json"
    if not path.is_file():
        return "not finished (no results.json yet)"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise BadRun(f"{path}: unreadable ({str(err).splitlines()[0]})") from None
    if not isinstance(results, dict):
        raise BadRun(f"{path}: not a JSON object")
    if "stopped" in results:
        return f"stopped ({results['stopped']}): no dev score"
    return None


def record_scores(path: pathlib.Path | None) -> dict[str, dict]:
    """``{cell: {"method", "seed", "dev_score"}}`` of the finished runs of a study's results
    JSONL (`experiments.report.records`; the best epoch's score); empty without a file."""
    if path is None:
        return {}
    from experiments.report import records

    out = {}
    for r in records.read_records(pathlib.Path(path)):
        if r["kind"] == "run" and r["status"] == "ok":
            out[r["cell"]] = {
                "method": r["fields"]["method"],
                "seed": r["seed"],
                "dev_score": records.best_score(r),
            }
    return out


def done_cells(out: pathlib.Path) -> set[str]:
    """The cells `out` holds a line of (none if it does not exist); a line that is not a JSON
    object raises ValueError naming it."""
    if not out.exists():
        return set()
    cells = set()
    for number, line in enumerate(out.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            cells.add(json.loads(line)["cell"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"{out}:{number}: not a line of this script") from None
    return cells


def append_line(out: pathlib.Path, line: dict) -> None:
    """Appends `line` as one JSON line, in one `write` (``O_APPEND``): a reader or a second
        writer never sees half of it. Non-finite numbers are written as null (a 1-D rule's threshold
    of ±inf: it predicts one class for every row)."""
    text = json.dumps(_finite(line), sort_keys=True, allow_nan=False) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = text.encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"{out}: short write")
    finally:
        os.close(fd)


def _finite(value):
    """`value` with every non-finite float (NaN, ±inf) replaced by None, NumPy scalars made
    Python numbers."""
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, bool | int | float | str):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def measure(folder: pathlib.Path, max_train: int, record: dict | None = None) -> dict:
    """The line of one finished run folder: its best checkpoint analysed on dev, with the first
    `max_train` train rows for the 1-D scores. `record`: the cell's entry of `record_scores`.
    Raises `BadRun` (one line) for a folder that does not restore or whose data is missing."""
    from isojax import runs
    from isojax.analysis import run as run_analysis
    from isojax.runs import predict
    from isojax.training import checkpointing

    try:
        restored = runs.restore(folder, best=True)
        split = restored.task.dev_splits[0]
        dev = predict.load_split(restored, split, labelled=True)
        train = predict.load_split(restored, "train", labelled=True)[:max_train]
    except (ValueError, OSError, checkpointing.CheckpointMismatch) as err:
        message = str(err).splitlines()[0]  # most name the folder or one of its files
        raise BadRun(message if str(folder) in message else f"{folder}: {message}") from None
    rep = run_analysis.analyze_run(restored, dev, train_examples=train)
    return line_of(folder.name, restored, rep, len(train), record)


def line_of(cell: str, restored, rep, train_rows: int, record: dict | None) -> dict:
    """The JSON line of `measure` from the restored run and its `encoder.Report`."""
    split = restored.task.dev_splits[0]
    best = restored.position.get("best") or {}
    own = (best.get(split) or {}).get("score")
    config = restored.config
    method = record["method"] if record else _arm_of(cell, config.task, config.seed)
    score = record["dev_score"] if record else own
    if record and own is not None and abs(record["dev_score"] - own) > 1e-6:
        logger.warning(
            "%s: the results record's best dev score %.6f differs from the run "
            "folder's %.6f (rerun since?); the record's is kept",
            cell,
            record["dev_score"],
            own,
        )
    vectors = {}
    for name in (HEAD_INPUT, rep.sentence):
        values = rep.embeddings[name]
        vectors[name] = {key: float(values[key]) for key in VECTOR_KEYS}
        vectors[name] |= {key: int(values[key]) for key in ("outliers", "principal_outlier")}
        vectors[name]["outlier_score"] = (rep.outlier_score or {}).get(name)
    noise = dict(rep.dropout) if rep.dropout else None
    return {
        "cell": cell,
        "study": restored.run_dir.parent.name,
        "task": restored.task.name,
        "arm": method,
        "seed": int(config.seed),
        "checkpoint": {"step": restored.step, "epoch": best.get("epoch")},
        "dev_score": score,
        "dev_score_from": "results" if record else "run folder",
        "dev_rows": int(rep.embeddings[HEAD_INPUT]["count"]),
        "train_rows": train_rows,
        "head_input_dropout": noise,
        "noise_to_spread": noise["dropout_to_spread"] if noise else None,
        "sentence": rep.sentence,
        **vectors,
    }


def _arm_of(cell: str, task: str, seed: int) -> str:
    """The arm label of a study cell name `<task>-<arm>-s<seed>` (`experiments/study/grid.py`)."""
    return cell.removeprefix(f"{task}-").removesuffix(f"-s{seed}")


def run_all(
    study_dir: pathlib.Path, out: pathlib.Path, max_train: int, records: dict[str, dict]
) -> tuple[list[str], list[str]]:
    """Measures every finished, not yet written cell folder of `study_dir` into `out`, in name
    order; returns (cells written, folders that failed)."""
    done = done_cells(out)
    written, failed = [], []
    for folder in sorted(p for p in study_dir.iterdir() if p.is_dir() and p.name[0] != "."):
        if folder.name in done:
            logger.info("%s: in %s already: skipped", folder, out)
            continue
        try:
            reason = not_finished(folder)
            if reason:
                logger.info("%s: %s: skipped", folder, reason)
                continue
            logger.info("%s: analysing its best checkpoint", folder)
            line = measure(folder, max_train, records.get(folder.name))
        except BadRun as err:
            logger.error("bad run folder %s", err)
            failed.append(str(folder))
            continue
        append_line(out, line)
        written.append(folder.name)
    return written, failed


def read_lines(out: pathlib.Path) -> list[dict]:
    """The lines of `out` (none if it does not exist)."""
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


# EV_1, not the effective rank: the lines of `whitening_why_runs.jsonl` were measured before
# audit 6 (finding 1), whose effective rank and RankMe drop the float32 tail of a collapsed
# spectrum, and their run folders are gone; EV_1 never went through that cut.
PANELS = (
    ("noise_to_spread", "head input: dropout / spread (log)"),
    ("EV_1", "head input: EV_1 (first direction's share)"),
    ("outlier_score", "head input: principal outlier's 1-D score"),
)


def panel_x(line: dict, key: str) -> float | None:
    """A line's x value of the figure's panel `key` (None: not drawable)."""
    if key == "noise_to_spread":
        value = line.get(key)
        return value if value is not None and value > 0 else None
    values = line.get(HEAD_INPUT) or {}
    if key == "outlier_score":
        return (values.get("outlier_score") or {}).get("score")
    return values.get(key)


def arm_colours(lines: list[dict]) -> dict[str, str]:
    """Arm -> matplotlib colour, `ARMS` first, then any other arm sorted."""
    arms = {line["arm"] for line in lines}
    order = [a for a in ARMS if a in arms] + sorted(arms - set(ARMS))
    return {arm: f"C{i % 10}" for i, arm in enumerate(order)}


def draw(lines: list[dict], png: pathlib.Path) -> pathlib.Path:
    """The figure of `lines`: a row per task, `PANELS` across, the best dev score up; dashed,
    the task's best constant prediction; dotted, the 1-D rule scoring as the whole head."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.report.records import CHANCE, METRIC_NAMES

    tasks = sorted({line["task"] for line in lines})
    colours = arm_colours(lines)
    fig, axes = plt.subplots(
        len(tasks), len(PANELS), figsize=(12, 3.3 * len(tasks) + 0.6), squeeze=False
    )
    for row, task in zip(axes, tasks, strict=True):
        mine = [line for line in lines if line["task"] == task and line["dev_score"] is not None]
        for ax, (key, label) in zip(row, PANELS, strict=True):
            for arm, colour in colours.items():
                points = [(panel_x(p, key), p["dev_score"]) for p in mine if p["arm"] == arm]
                points = [(x, y) for x, y in points if x is not None]
                if points:
                    ax.scatter(*zip(*points, strict=True), s=22, color=colour, label=arm)
            if key == "noise_to_spread":
                ax.set_xscale("log")
            if key == "outlier_score":  # the 1-D rule doing as well as the whole head
                ax.axline((0, 0), slope=1, color="grey", lw=0.8, ls=":")
            if task in CHANCE:  # the best constant prediction's score
                ax.axhline(CHANCE[task], color="grey", lw=0.8, ls="--")
            ax.set_xlabel(label, fontsize=8)
        row[0].set_ylabel(
            f"{task} ({len(mine)} runs): best dev\n{METRIC_NAMES.get(task, 'score')}", fontsize=8
        )
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=a) for a, c in colours.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], prog="python -m experiments.report.why"
    )
    parser.add_argument("runs_dir", type=pathlib.Path, help="the study runner's --runs-dir")
    parser.add_argument("--study", default=STUDY, help=f"its study folder (default {STUDY})")
    parser.add_argument(
        "--results",
        type=pathlib.Path,
        help="the study's results JSONL: the dev scores and arms of its records",
    )
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--max-train-examples",
        type=int,
        default=2048,
        help="train rows the 1-D rules are fitted on (the first ones)",
    )
    parser.add_argument("--figure", type=pathlib.Path, default=DEFAULT_FIGURE)
    return parser


def main(argv: list[str] | None = None) -> int:
    from isojax.logs import TerminalHandler, install_log_handler

    args = _parser().parse_args(argv)
    install_log_handler()  # the library's notices (restores), as `isojax` shows them
    if not any(isinstance(h, TerminalHandler) for h in logger.handlers):
        logger.addHandler(TerminalHandler())
    logger.setLevel(logging.INFO)
    logger.propagate = False
    study_dir = args.runs_dir / args.study
    if args.max_train_examples < 2:
        print("why: --max-train-examples must be at least 2", file=sys.stderr)
        return 2
    if not study_dir.is_dir():
        print(f"why: {study_dir}: no such folder (RUNS_DIR/--study)", file=sys.stderr)
        return 2
    try:
        records = record_scores(args.results)
        written, failed = run_all(study_dir, args.out, args.max_train_examples, records)
    except ValueError as err:  # a results JSONL or --out that is not what it should be
        print(f"why: {err}", file=sys.stderr)
        return 2
    lines = read_lines(args.out)
    if lines:
        draw(lines, args.figure)
    print(
        f"{len(written)} runs analysed into {args.out} ({len(lines)} lines)"
        + (f"; figure {args.figure}" if lines else "")
        + (f"; {len(failed)} bad run folders: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
