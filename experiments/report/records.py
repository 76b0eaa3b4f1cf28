"""Loading a study's results JSONL for the report, and reading one record.

A JSONL holds one line per cell (the study runner, `experiments/study/runner.py`, writes it
so: a failed line is replaced, never repeated). `load` refuses, each with one line naming the file:

- a line that is not JSON, or a file without records;
- a finished run without a dev evaluation, or with a score that is not a finite number (a NaN
  would count as a loss on both sides of the pooled P: AUDIT.md, turn 5, finding 10);
- a cell recorded twice (a JSONL concatenated with itself would turn n = 3 seeds into 6 and
  shrink the std);
- records of several devices (`device`: "cpu cpu x1", "gpu NVIDIA H200 x1"), unless
  `allow_mixed_devices`: run times and the rounding of the scores differ between devices, so a
  GPU replicate goes to its own JSONL;
- records of several commits, or of a dirty tree (`git_commit`, `git_dirty`), unless
  `allow_mixed_commits`: a grid runs from a worktree pinned at one commit, so the code of every
  cell is the same and known.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib

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
# Dev examples per class id of the local TSVs (../shared/data/glue; TFDS's label order): CoLA
# 0 unacceptable / 1 acceptable, MRPC 0 / 1 paraphrase, RTE 0 entailment / 1 not_entailment.
DEV_CLASS_COUNTS = {"cola": (322, 721), "mrpc": (129, 279), "rte": (146, 131)}
# Dev examples per task (STS-B: 1500 pairs), for the chance-level noise 1/√n of `beats_chance`.
DEV_SIZE = {t: sum(DEV_CLASS_COUNTS.get(t, ())) or 1500 for t in ("cola", "mrpc", "stsb", "rte")}


def constant_scores(task: str) -> tuple[float, ...]:
    """The dev score of predicting class c for every dev example, per class id c (empty for a
    task without `DEV_CLASS_COUNTS`: STS-B's correlations are undefined for a constant).

    With n_c examples of class c out of n: RTE's accuracy is n_c / n; MRPC's score is
    (accuracy + F1) / 2, F1 of class 1 being 2 n_1 / (n_1 + n) when every prediction is 1
    (precision n_1 / n, recall 1) and 0 when none is; CoLA's Matthews correlation is 0.
    """
    counts = DEV_CLASS_COUNTS.get(task)
    if counts is None:
        return ()
    n = sum(counts)
    accuracy = [c / n for c in counts]
    if task == "cola":
        return (0.0,) * len(counts)
    if task == "mrpc":
        f1 = (0.0, 2 * counts[1] / (counts[1] + n))
        return tuple((a + f) / 2 for a, f in zip(accuracy, f1, strict=True))
    return tuple(accuracy)


# The dev score of a constant prediction of the majority class (0 for a correlation):
# RTE 146/277 entailment, MRPC 279/408 paraphrases (accuracy 0.684, F1 0.812).
CHANCE = {t: max(constant_scores(t), default=0.0) for t in ("cola", "mrpc", "stsb", "rte")}


# The keys the report reads from every record (what `experiments/study/runner.py` writes), from its
# `fields` and from each of its `eval` rows.
REQUIRED = ("cell", "kind", "status", "fields", "seed", "eval")
REQUIRED_FIELDS = ("task", "method")
REQUIRED_EVAL = ("split", "epoch", "score")


class RecordsError(ValueError):
    """A results JSONL the report refuses; the message is one line naming the file."""


def _missing(row, keys: tuple[str, ...]) -> list[str]:
    return [k for k in keys if k not in row] if isinstance(row, dict) else list(keys)


def _not_a_record(record) -> str | None:
    """Why `record` is not a study record the report can read (None: it is): not an object,
    a `REQUIRED` key missing, or one of `fields` (`REQUIRED_FIELDS`) or of an `eval` row
    (`REQUIRED_EVAL`)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = _missing(record, REQUIRED)
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    missing = _missing(record["fields"], REQUIRED_FIELDS)
    if missing:
        return f"its fields have no {', '.join(map(repr, missing))}"
    if not isinstance(record["eval"], list):
        return "its eval is not a list"
    for index, row in enumerate(record["eval"]):
        missing = _missing(row, REQUIRED_EVAL)
        if missing:
            return f"its eval row {index} has no {', '.join(map(repr, missing))}"
    return _not_a_score(record)


def _not_a_score(record: dict) -> str | None:
    """Why a finished run's dev scores cannot enter the statistics (None: they can): no
    evaluation, or a score that is not a finite number. A NaN would count as a loss on both
    sides of the pooled P and sort anywhere in a `max` (AUDIT.md, turn 5, finding 10)."""
    if record["kind"] != "run" or record["status"] != "ok":
        return None
    if not record["eval"]:
        return "a finished run without a dev evaluation"
    for index, row in enumerate(record["eval"]):
        score = row["score"]
        if (
            isinstance(score, bool)
            or not isinstance(score, int | float)
            or not math.isfinite(score)
        ):
            return (
                f"cell {record['cell']!r}, eval row {index} (epoch {row['epoch']}): the score "
                f"{score!r} is not a finite number; the statistics refuse it (mark the cell failed "
                "to rerun it, or remove its line)"
            )
    return None


def read_records(path: pathlib.Path) -> list[dict]:
    """The JSONL's records, in file order. Raises RecordsError on a line that is not a JSON
    object, on an empty file, and on a cell recorded twice (naming both lines)."""
    records, seen = [], {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise RecordsError(f"{path}:{number}: not JSON ({err})") from None
        what = _not_a_record(record)
        if what:
            raise RecordsError(f"{path}:{number}: not a study record ({what})")
        key = (record.get("study"), record["cell"])
        if key in seen:
            raise RecordsError(
                f"{path}:{number}: cell {record['cell']!r} is recorded already at line "
                f"{seen[key]}: a cell has one line (was the JSONL concatenated with itself?)"
            )
        seen[key] = number
        records.append(record)
    if not records:
        raise RecordsError(f"{path}: no records")
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


def host_counts(records: list[dict]) -> collections.Counter:
    """`"<CPU model>, <n> cores"` (the records' `host`, issue 48) -> number of records; "CPU
    model and cores not recorded" for records written before the field existed."""

    def name(r: dict) -> str:
        host = r.get("host") or {}
        if not host.get("cpu"):
            return "CPU model and cores not recorded"
        return f"{host['cpu']}, {host.get('cores', '?')} cores"

    return collections.Counter(name(r) for r in records)


def commit_counts(records: list[dict]) -> collections.Counter:
    """`"<commit[:10]>"` (with " (dirty)" for a dirty tree) -> number of records."""
    return collections.Counter(
        f"{(r.get('git_commit') or 'unknown')[:10]}{' (dirty)' if r.get('git_dirty') else ''}"
        for r in records
    )


def check_one_device(records: list[dict], path: pathlib.Path, allow_mixed: bool) -> None:
    """Raises RecordsError when the records come from several devices, unless `allow_mixed`."""
    devices = collections.Counter(r.get("device") or "device not recorded" for r in records)
    if len(devices) > 1 and not allow_mixed:
        found = "; ".join(f"{d} x{n}" for d, n in devices.items())
        raise RecordsError(
            f"{path}: records from {len(devices)} devices ({found}): keep each device's runs in "
            "its own JSONL, or pass --allow-mixed-devices to pool them in one report"
        )


def check_one_commit(records: list[dict], path: pathlib.Path, allow_mixed: bool) -> None:
    """Raises RecordsError when the records come from several commits or from a dirty tree,
    unless `allow_mixed`."""
    commits = commit_counts(records)
    dirty = any(r.get("git_dirty") for r in records)
    if (len(commits) > 1 or dirty) and not allow_mixed:
        found = "; ".join(f"{c} x{n}" for c, n in commits.items())
        what = f"{len(commits)} commits" if len(commits) > 1 else "a dirty tree"
        raise RecordsError(
            f"{path}: records from {what} ({found}): a grid runs from a worktree pinned at one "
            "clean commit; pass --allow-mixed-commits to pool them in one report"
        )


def load(
    path: str | pathlib.Path,
    *,
    allow_mixed_devices: bool = False,
    allow_mixed_commits: bool = False,
) -> list[dict]:
    """`read_records`, then the device and commit checks (RecordsError on a refusal)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise RecordsError(f"{path}: no such results file")
    records = read_records(path)
    check_one_device(records, path, allow_mixed_devices)
    check_one_commit(records, path, allow_mixed_commits)
    return records


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


# The papers' symbols for the swept fields, in arm labels.
LABEL_NAMES = {"istar.weight": "lambda", "cosreg.weight": "lambda", "istar.zeta": "zeta"}


def arm_label(record: dict, varied: list[str]) -> str:
    """`method`, then `field=value` for the other varied fields, e.g. `istar lambda=-0.5`."""
    parts = [str(record["fields"]["method"])]
    for key in varied:
        if key != "method":
            value = record["fields"].get(key)
            name = LABEL_NAMES.get(key, key)
            parts.append(f"{name}={format(value, 'g') if isinstance(value, float) else value}")
    return " ".join(parts)


def is_baseline(record: dict) -> bool:
    base = record.get("baseline") or {}
    return bool(base) and all(record["fields"].get(k) == v for k, v in base.items())


def chance_margin(task: str) -> float:
    """1/√n_dev: about two standard errors of a constant-rate accuracy near 0.5 on the dev set,
    one of a correlation near 0 (0 for a task of unknown size)."""
    return 1.0 / math.sqrt(DEV_SIZE[task]) if task in DEV_SIZE else 0.0


def beats_chance(task: str, median: float) -> bool:
    """Whether a baseline's median score is above chance (`CHANCE`) by more than
    `chance_margin`: only then does a run below halfway to it say anything (`collapsed`)."""
    return math.isfinite(median) and median - CHANCE.get(task, 0.0) > chance_margin(task)


def collapsed(record: dict, baseline_median: float) -> bool:
    """A run is collapsed when its last-epoch score is below halfway between chance (`CHANCE`,
    a constant prediction) and the baseline arm's median: score - chance < (median - chance)/2.
    Never when the baseline itself does not beat chance (`beats_chance`): halfway to a score at
    chance is noise."""
    task = record["fields"]["task"]
    if not beats_chance(task, baseline_median):
        return False
    chance = CHANCE.get(task, 0.0)
    return last_value(record) - chance < 0.5 * (baseline_median - chance)


def at_constant_prediction(record: dict) -> list[bool]:
    """Per dev evaluation (by epoch): whether its score equals a constant prediction's
    (`constant_scores`, to 1e-6). A sign that the run predicts one class for every example,
    not a proof: another prediction can reach the same score."""
    scores = constant_scores(record["fields"]["task"])
    return [any(abs(float(r["score"]) - c) < 1e-6 for c in scores) for r in dev_rows(record)]


def task_key(task: str) -> tuple:
    """Sort key: the SPEC's task order, then others by name."""
    return (TASK_ORDER.index(task) if task in TASK_ORDER else len(TASK_ORDER), task)
