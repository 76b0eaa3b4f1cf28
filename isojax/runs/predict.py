"""A restored run's predictions on a GLUE split, and the GLUE benchmark's submission files.

    restored = runs.restore("runs/rte-isobn", best=True)
    dev = predict.predict(restored, "dev")          # logits in file order; metrics: dev.metrics
    predict.write_predictions(dev, "rte-dev.tsv")   # index, prediction, probability_<label>...
    test = predict.predict(restored, "test")
    predict.write_submission(test, "submission")    # submission/RTE.tsv

The forward pass is the run's own eval step over the same eval batches (`evaluation.eval_outputs`:
file order, the last batch filled with masked rows so each example counts once), so the dev
metrics equal the run's evaluation of that checkpoint. A dev split is cut to the run's
`max_eval_examples`, as the run evaluated it; a test split is always whole.

A submission file (`CoLA.tsv`, `MNLI-m.tsv`, ...; `SUBMISSION_FILES`) has the header
`index\tprediction`, one row per test example in file order, `index` the test file's own
`index` column (read and checked: non-negative integers, no repeats; TFDS's `idx` from
tensorflow-datasets), and
GLUE's label vocabulary: the task's TSV label values (`entailment`/`not_entailment` for RTE and
QNLI, MNLI's three strings, 0/1 for CoLA, SST-2, MRPC and QQP), STS-B's score clipped to
[0, 5]. Files of several runs (one per task) fill one folder, which zips into a submission.

Outputs are written atomically (a temporary file renamed into place, removed if the write
fails); `check_file` and `check_folder` refuse a destination of the wrong kind (a predictions
file that is a folder, a submission folder that is a file) or one of a run folder's own files
(its `config.json`, `metrics.jsonl`, `results.json`, checkpoints) before anything is computed.

References:
  Wang et al., `GLUE <https://arxiv.org/abs/1804.07461>`_, ICLR 2019; the submission format of
  gluebenchmark.com (see ../shared/data/glue/SOURCE.md).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

import numpy as np

from isojax import runs
from isojax.data import batching, glue, metrics, tasks
from isojax.training import evaluation, run_folder

# (task, test split) -> the benchmark's file name.
SUBMISSION_FILES = {
    ("cola", "test"): "CoLA.tsv",
    ("sst2", "test"): "SST-2.tsv",
    ("mrpc", "test"): "MRPC.tsv",
    ("stsb", "test"): "STS-B.tsv",
    ("qqp", "test"): "QQP.tsv",
    ("mnli", "test_matched"): "MNLI-m.tsv",
    ("mnli", "test_mismatched"): "MNLI-mm.tsv",
    ("qnli", "test"): "QNLI.tsv",
    ("rte", "test"): "RTE.tsv",
}
STSB_RANGE = (0.0, 5.0)
INDEX_COLUMN = "index"  # the test files' own example ids, repeated by a submission


class OutputRefused(ValueError):
    """An output path of the wrong kind (one-line message)."""


def check_file(path: str | pathlib.Path) -> None:
    """Refuses (`OutputRefused`) a file destination that is a folder, lies under a file, is
    one of a run folder's own files (`runs.run_owning`: its config, log, results, checkpoints),
    or lies in a model folder (`run_folder.model_files`: a foreign `config.json` or weights)."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise OutputRefused(f"{path} is a folder: name the file to write")
    run = runs.run_owning(path)
    if run is not None:
        raise OutputRefused(
            f"{path} is one of the run folder {run}'s own files: write the predictions elsewhere"
        )
    if run_folder.model_files(path.parent):
        raise OutputRefused(
            f"{path.parent} holds a model ({', '.join(run_folder.model_files(path.parent)[:3])}), "
            "not an isojax run: write the predictions elsewhere"
        )
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise OutputRefused(f"{path}: {parent} is a file, not a folder")
            break


def check_folder(path: str | pathlib.Path) -> None:
    """Refuses (`OutputRefused`) a folder destination that is a file or lies under one."""
    path = pathlib.Path(path)
    if path.exists() and not path.is_dir():
        raise OutputRefused(f"{path} is a file: name a folder")
    check_file(path / "_")


def file_index(path: pathlib.Path, count: int) -> list[int]:
    """The `index` column of a GLUE test TSV (`count` data rows, as `glue.load_tsv` read
    them): ValueError naming the file and line for a value that is not a non-negative
    integer, a repeated value, or a row count that differs; row numbers 0.. when the file has
    no `index` column."""
    rows = glue.tsv_rows(path)  # the loader's own line splitting
    _, header = next(rows, (1, [""]))
    if INDEX_COLUMN not in header:
        return list(range(count))
    column = header.index(INDEX_COLUMN)
    out, seen = [], {}
    for number, fields in rows:
        if fields == [""]:  # a blank line, as the loader reads it
            continue
        value = fields[column] if column < len(fields) else ""
        if not re.fullmatch(r"[0-9]{1,18}", value):
            raise ValueError(f"{path}:{number}: index {value!r} is not a non-negative integer")
        if int(value) in seen:
            raise ValueError(f"{path}:{number}: index {value} repeats line {seen[int(value)]}'s")
        seen[int(value)] = number
        out.append(int(value))
    if len(out) != count:
        raise ValueError(f"{path}: {len(out)} index values for {count} examples")
    return out


@dataclasses.dataclass(frozen=True)
class Predictions:
    """One split's outputs, in file order.

    Attributes:
      task, split: what was predicted.
      idx: `[n]` int64 row index in the split's file (`tasks.Example.idx`, GLUE's `index`).
      logits: `[n, num_labels]` float32 (STS-B: `[n, 1]`, the score).
      metrics: for a labelled split, the task metrics (`metrics.compute_metrics`) and the
        isotropy of the split's embeddings (`evaluation.isotropy_metrics`); None for a test split.
    """

    task: tasks.GlueTask
    split: str
    idx: np.ndarray
    logits: np.ndarray
    metrics: dict[str, float] | None

    @property
    def probabilities(self) -> np.ndarray:
        """`[n, num_labels]` float64 softmax of the logits (classification tasks)."""
        z = self.logits.astype(np.float64)
        z = np.exp(z - z.max(axis=1, keepdims=True))
        return z / z.sum(axis=1, keepdims=True)

    @property
    def label_ids(self) -> np.ndarray:
        """`[n]` predicted class ids (argmax of the logits)."""
        return self.logits.argmax(axis=1)

    @property
    def scores(self) -> np.ndarray:
        """`[n]` predicted STS-B scores (unclipped)."""
        return self.logits[:, 0]


def splits_of(task: tasks.GlueTask, name: str) -> tuple[str, ...]:
    """ "dev" -> the task's dev split(s), "test" -> its test split(s) (MNLI: matched and
    mismatched); an exact split name -> itself. ValueError names the choices."""
    chosen = {"dev": task.dev_splits, "test": task.test_splits}.get(name)
    if chosen is None and name in task.all_splits:
        chosen = (name,)
    if chosen is None:
        raise ValueError(
            f"task {task.name} has no split {name!r}; choose dev, test or one of "
            f"{list(task.all_splits)}"
        )
    return chosen


def load_split(
    restored: runs.Restored, split: str, *, data_dir: str | None = None, labelled: bool
) -> list[tasks.Example]:
    """The split's examples from `data_dir` (default the run's `data_dir`; none: the run's
    tensorflow-datasets folder); a dev split cut to the run's `max_eval_examples`, as the run
    evaluated it. Raises `tasks.GlueDataNotFound` for a missing file, ValueError for a test
    split with `labelled`."""
    data, task = restored.spec.data, restored.task
    data_dir = data_dir or data.data_dir
    if data_dir:
        examples = glue.load_tsv(data_dir, task, split, labelled=labelled)
        if split in task.test_splits:  # the file's own example ids, for the submission
            index = file_index(glue.tsv_path(data_dir, task, split), len(examples))
            examples = [e._replace(idx=i) for e, i in zip(examples, index, strict=True)]
    else:
        examples = glue.load_tfds(task, split, data.tfds_data_dir, labelled=labelled)
    limit = data.max_eval_examples
    return examples[:limit] if split in task.dev_splits and limit is not None else examples


def predict(
    restored: runs.Restored,
    split: str,
    *,
    data_dir: str | None = None,
    labelled: bool | None = None,
) -> Predictions:
    """The run's outputs on one split, and its metrics where the split has labels.

    Args:
      restored: from `runs.restore`.
      split: a split name of the task ("dev", "test", MNLI's "dev_matched", ...).
      data_dir: a glue_data folder; default the run's own source.
      labelled: score the predictions (needs labels; default: unless a test split).

    Raises:
      tasks.GlueDataNotFound: the split's file (or tfds copy) is absent.
      ValueError: unknown split; a test split with `labelled=True` (GLUE keeps its labels).
    """
    task, spec = restored.task, restored.spec
    labelled = split not in task.test_splits if labelled is None else labelled
    examples = load_split(restored, split, data_dir=data_dir, labelled=labelled)
    if not labelled:  # batching wants a label per row; these are never read
        filler = 0.0 if task.is_regression else 0
        examples = [example._replace(label=filler) for example in examples]
    encoded = batching.encode(examples, restored.tokenizer, spec.data.max_length)
    logits, acc = evaluation.eval_outputs(
        restored.eval_fn, restored.state, encoded, spec.feed, restored.mesh, restored.hidden_size
    )
    scores = None
    if labelled:
        scores = metrics.compute_metrics(task, logits, encoded.labels)
        scores |= evaluation.isotropy_of(acc, restored.state, spec.state.objective.istar.zeta)
    return Predictions(task=task, split=split, idx=encoded.idx, logits=logits, metrics=scores)


def _write_tsv(path: pathlib.Path, header: list[str], rows) -> pathlib.Path:
    """Writes a TSV atomically (a temporary file renamed into place; removed if the write
    fails). `OutputRefused` for a path that is a folder or under a file."""
    check_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write("\t".join(header) + "\n")
            for row in rows:
                f.write("\t".join(row) + "\n")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_predictions(pred: Predictions, path: str | pathlib.Path) -> pathlib.Path:
    """A TSV, one row per example in file order: `index`, `prediction` (the label name, or
    the STS-B score), then `probability_<label>` per class (classification)."""
    task = pred.task
    if task.is_regression:
        header = ["index", "prediction"]
        rows = ([str(i), f"{s:.6f}"] for i, s in zip(pred.idx, pred.scores, strict=True))
    else:
        header = ["index", "prediction", *(f"probability_{name}" for name in task.label_names)]
        rows = (
            [str(i), task.label_names[k], *(f"{p:.6f}" for p in probs)]
            for i, k, probs in zip(pred.idx, pred.label_ids, pred.probabilities, strict=True)
        )
    return _write_tsv(pathlib.Path(path), header, rows)


def submission_values(pred: Predictions) -> list[str]:
    """The `prediction` column GLUE expects: the task's TSV label value of each predicted
    class, or the STS-B score clipped to [0, 5]."""
    if pred.task.is_regression:
        return [f"{s:.3f}" for s in np.clip(pred.scores, *STSB_RANGE)]
    return [pred.task.label_values[k] for k in pred.label_ids]


def write_submission(pred: Predictions, folder: str | pathlib.Path) -> pathlib.Path:
    """`folder/<TASK>.tsv` of GLUE's submission (`SUBMISSION_FILES`): header
    `index\\tprediction`, one row per test example in file order. Other tasks' files in
    `folder` are left as they are. ValueError for a split that is not a test split."""
    name = SUBMISSION_FILES.get((pred.task.name, pred.split))
    if name is None:
        raise ValueError(
            f"a GLUE submission holds test-set predictions; {pred.task.name} {pred.split!r} "
            f"is not one of its test splits {list(pred.task.test_splits)}"
        )
    check_folder(folder)
    rows = ([str(i), v] for i, v in zip(pred.idx, submission_values(pred), strict=True))
    return _write_tsv(pathlib.Path(folder) / name, ["index", "prediction"], rows)
