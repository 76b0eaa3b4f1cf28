"""The eight GLUE tasks: a registry, the TSV source, and `load`, the entry point to it and to the
tensorflow-datasets source (`isojax.data.tfds_source`, also reached as `glue.load_tfds`).

Both sources return the same `Example`s in file order (`idx` = 0-based data row, as in TFDS):

    task = glue.get_task("rte")
    train = glue.load_tsv("glue_data", task, "train", labelled=True)   # glue_data/RTE/train.tsv
    dev = glue.load_tfds(task, "dev", data_dir="~/tensorflow_datasets")   # glue/rte validation
    test = glue.load_tsv("glue_data", task, "test")   # unlabelled: every label is None

The TSVs are the files of the usual `download_glue_data.py` (`glue_data/<TASK>/{train,dev,
test}.tsv`; MNLI `dev_matched.tsv`, `test_matched.tsv`, ...). They are split on tabs with no
quote handling, as the TFDS GLUE builder reads them (`csv.QUOTE_NONE`): some fields hold
unbalanced `"`. A UTF-8 BOM (MRPC) is dropped; CoLA's train and dev files have no header (its
test file has one). Label names and their order are those of TFDS (`tfds.builder("glue/<task>")`),
so a label id means the same thing from either source (RTE: entailment = 0, not_entailment = 1).
The test splits (GLUE's leaderboard sets) carry no labels: their `Example.label` is None, and
`labelled=True` (training, evaluation) refuses them.

When neither source has the data (no TSV file; tfds not installed, not prepared offline, or its
download fails) the loaders raise `GlueDataNotFound`, one line naming both ways to supply GLUE.

References:
  Wang et al., `GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language
  Understanding <https://arxiv.org/abs/1804.07461>`_, ICLR 2019. SPEC.md §7.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from collections.abc import Iterator
from typing import NamedTuple


class GlueDataNotFound(FileNotFoundError):
    """No source holds a GLUE split: no TSV file, and no usable tensorflow-datasets copy."""


class Example(NamedTuple):
    """One GLUE example.

    text_a: first (or only) sentence.
    text_b: second sentence of a pair task; None for single-sentence tasks.
    label: class id (int, into `GlueTask.label_names`), the similarity score (float, STS-B),
      or None in a test split (GLUE publishes no test labels).
    idx: 0-based data row in its file (header not counted), the TFDS `idx` feature; in the
      test files it equals the `index` column that a GLUE submission file repeats.
    """

    text_a: str
    text_b: str | None
    label: int | float | None
    idx: int


@dataclasses.dataclass(frozen=True)
class GlueTask:
    """How one GLUE task is stored, labelled and scored.

    Attributes:
      name: registry key and TFDS config, e.g. "rte" (`glue/rte`).
      folder: directory under `glue_data/`, e.g. "RTE".
      text_columns: TSV column(s) holding the sentence(s): one or two names.
      label_column: TSV column holding the label.
      label_names: class names, in TFDS order (id = position); empty for regression.
      label_values: how each class is written in the TSV (same order as `label_names`).
      metrics: names of `isojax.metrics` functions reported for this task; the GLUE score is
        their mean where there are two.
      dev_splits: the evaluation split(s) as file stems: ("dev",), or MNLI's matched and
        mismatched pair.
      tfds_text_features: TFDS feature names of the sentence(s), same order as `text_columns`.
      fieldnames: column names of the header-less train and dev files (CoLA); None when they
        have a header. Test files always have one.
      test_splits: the unlabelled test split(s) as file stems: ("test",), or MNLI's pair.
    """

    name: str
    folder: str
    text_columns: tuple[str, ...]
    label_column: str
    label_names: tuple[str, ...]
    label_values: tuple[str, ...]
    metrics: tuple[str, ...]
    dev_splits: tuple[str, ...]
    tfds_text_features: tuple[str, ...]
    fieldnames: tuple[str, ...] | None = None
    test_splits: tuple[str, ...] = ("test",)

    @property
    def is_regression(self) -> bool:
        return not self.label_names

    @property
    def num_labels(self) -> int:
        """Output width of the classifier head: the number of classes, 1 for regression."""
        return len(self.label_names) or 1

    @property
    def is_pair(self) -> bool:
        return len(self.text_columns) == 2

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits with labels (training, evaluation): "train" then the dev split(s)."""
        return ("train", *self.dev_splits)

    @property
    def all_splits(self) -> tuple[str, ...]:
        """Every split: the labelled ones, then the unlabelled test split(s)."""
        return (*self.splits, *self.test_splits)

    def tfds_split(self, split: str) -> str:
        """TFDS name of a split: "dev" -> "validation", "dev_matched" -> "validation_matched";
        "train" and the test splits keep their names."""
        self.check_split(split)
        return split.replace("dev", "validation", 1) if split.startswith("dev") else split

    def check_split(self, split: str, *, labelled: bool = False) -> None:
        """Raises ValueError for an unknown split, or for a test split when `labelled`."""
        if split not in self.all_splits:
            raise ValueError(
                f"GLUE task {self.name!r} has no split {split!r}; known: {list(self.all_splits)}"
            )
        if labelled and split in self.test_splits:
            raise ValueError(
                f"GLUE {self.name} split {split!r} has no labels (GLUE keeps the test labels): "
                f"training and evaluation need one of {list(self.splits)}"
            )


_BINARY = ("0", "1")

# Columns as in the standard GLUE TSVs; label names and order as in the TFDS GLUE builder.
TASKS: dict[str, GlueTask] = {
    task.name: task
    for task in (
        GlueTask(
            name="cola",
            folder="CoLA",
            text_columns=("sentence",),
            label_column="is_acceptable",
            label_names=("unacceptable", "acceptable"),
            label_values=_BINARY,
            metrics=("matthews_correlation",),
            dev_splits=("dev",),
            tfds_text_features=("sentence",),
            fieldnames=("source", "is_acceptable", "original_judgement", "sentence"),
        ),
        GlueTask(
            name="sst2",
            folder="SST-2",
            text_columns=("sentence",),
            label_column="label",
            label_names=("negative", "positive"),
            label_values=_BINARY,
            metrics=("accuracy",),
            dev_splits=("dev",),
            tfds_text_features=("sentence",),
        ),
        GlueTask(
            name="mrpc",
            folder="MRPC",
            text_columns=("#1 String", "#2 String"),
            label_column="Quality",
            label_names=("not_equivalent", "equivalent"),
            label_values=_BINARY,
            metrics=("f1", "accuracy"),
            dev_splits=("dev",),
            tfds_text_features=("sentence1", "sentence2"),
        ),
        GlueTask(
            name="stsb",
            folder="STS-B",
            text_columns=("sentence1", "sentence2"),
            label_column="score",
            label_names=(),
            label_values=(),
            metrics=("pearson", "spearman"),
            dev_splits=("dev",),
            tfds_text_features=("sentence1", "sentence2"),
        ),
        GlueTask(
            name="qqp",
            folder="QQP",
            text_columns=("question1", "question2"),
            label_column="is_duplicate",
            label_names=("not_duplicate", "duplicate"),
            label_values=_BINARY,
            metrics=("f1", "accuracy"),
            dev_splits=("dev",),
            tfds_text_features=("question1", "question2"),
        ),
        GlueTask(
            name="mnli",
            folder="MNLI",
            text_columns=("sentence1", "sentence2"),
            label_column="gold_label",
            label_names=("entailment", "neutral", "contradiction"),
            label_values=("entailment", "neutral", "contradiction"),
            metrics=("accuracy",),
            dev_splits=("dev_matched", "dev_mismatched"),
            tfds_text_features=("premise", "hypothesis"),
            test_splits=("test_matched", "test_mismatched"),
        ),
        GlueTask(
            name="qnli",
            folder="QNLI",
            text_columns=("question", "sentence"),
            label_column="label",
            label_names=("entailment", "not_entailment"),
            label_values=("entailment", "not_entailment"),
            metrics=("accuracy",),
            dev_splits=("dev",),
            tfds_text_features=("question", "sentence"),
        ),
        GlueTask(
            name="rte",
            folder="RTE",
            text_columns=("sentence1", "sentence2"),
            label_column="label",
            label_names=("entailment", "not_entailment"),
            label_values=("entailment", "not_entailment"),
            metrics=("accuracy",),
            dev_splits=("dev",),
            tfds_text_features=("sentence1", "sentence2"),
        ),
    )
}


def get_task(task: str | GlueTask) -> GlueTask:
    """The registry entry of a task, by name ("rte", "RTE", "sts-b" and "stsb" all work).

    Raises:
      ValueError: unknown task, naming the known ones.
    """
    if isinstance(task, GlueTask):
        return task
    key = str(task).lower().replace("-", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {task!r}; known tasks: {sorted(TASKS)}")
    return TASKS[key]


def _tsv_rows(path: pathlib.Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, fields) of each non-final-empty line; tabs only, no quoting.

    Lines end at "\\n" only (never at a lone "\\r", which a text-mode reader would split on);
    a trailing "\\r" is dropped, and so is a UTF-8 BOM at the start of the file.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 ({error.reason})") from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            line = line.removesuffix("\n").removesuffix("\r")
            yield number, line.split("\t")


def _parse_label(task: GlueTask, value: str, where: str) -> int | float:
    if task.is_regression:
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise ValueError(f"{where}: {task.label_column!r} is {value!r}, not a finite number")
        return score
    try:
        return task.label_values.index(value)
    except ValueError:
        raise ValueError(
            f"{where}: unknown label {value!r} in column {task.label_column!r}; "
            f"expected one of {list(task.label_values)}"
        ) from None


def how_to_supply(task: GlueTask, split: str, tfds_dir: str | os.PathLike | None) -> str:
    """The two ways to supply GLUE, for the one-line `GlueDataNotFound` messages."""
    where = f"in {tfds_dir}" if tfds_dir is not None else "in TFDS's data dir"
    return (
        f"supply GLUE either as a glue_data folder holding {task.folder}/{split}.tsv "
        f"(--data-dir), or as tensorflow-datasets glue/{task.name} prepared {where} "
        f"(--tfds-data-dir; needs isojax[tfds])"
    )


def tsv_path(data_dir: str | os.PathLike, task: str | GlueTask, split: str) -> pathlib.Path:
    """`data_dir/<TASK>/<split>.tsv`, e.g. `glue_data/MNLI/dev_matched.tsv`."""
    task = get_task(task)
    task.check_split(split)
    return pathlib.Path(data_dir).expanduser() / task.folder / f"{split}.tsv"


def load_tsv(
    data_dir: str | os.PathLike, task: str | GlueTask, split: str, *, labelled: bool = False
) -> list[Example]:
    """Examples of one split from the `glue_data/<TASK>/<split>.tsv` layout, in file order.

    Args:
      data_dir: the `glue_data` folder holding one folder per task (`RTE/`, `STS-B/`, ...).
      task: a task name or `GlueTask`.
      split: one of `task.all_splits`: "train", the dev split(s) ("dev"; MNLI: "dev_matched",
        "dev_mismatched") or the test split(s) ("test"; MNLI: "test_matched", ...).
      labelled: require labels (training, evaluation): a test split raises ValueError.

    Returns:
      One `Example` per data row; `idx` counts data rows from 0. Test splits have no label
      column: every `label` is None.

    Raises:
      GlueDataNotFound: the file is missing (a `FileNotFoundError`; the one-line message
        names the file and both ways to supply GLUE).
      ValueError: unknown task or split; a test split with `labelled`; a header without a
        needed column; a row with another number of fields than the header; an unknown or
        unparsable label. The message names the file and the 1-based line.
    """
    task = get_task(task)
    task.check_split(split, labelled=labelled)
    path = tsv_path(data_dir, task, split)
    if not path.is_file():
        raise GlueDataNotFound(
            f"GLUE {task.name} {split} file not found: {path}; " + how_to_supply(task, split, None)
        )
    test = split in task.test_splits
    rows = _tsv_rows(path)
    if task.fieldnames is None or test:
        _, header = next(rows, (1, [""]))
    else:
        header = list(task.fieldnames)
    columns = {name: i for i, name in enumerate(header)}
    needed = task.text_columns if test else (*task.text_columns, task.label_column)
    for name in needed:
        if name not in columns:
            raise ValueError(f"{path}:1: header lacks column {name!r}; header is {header}")
    text_cols = [columns[name] for name in task.text_columns]
    label_col = None if test else columns[task.label_column]

    examples = []
    for number, fields in rows:
        where = f"{path}:{number}"
        if len(fields) != len(header):
            raise ValueError(
                f"{where}: {len(fields)} tab-separated fields, expected {len(header)} "
                f"(columns {header})"
            )
        texts = [fields[i] for i in text_cols]
        examples.append(
            Example(
                text_a=texts[0],
                text_b=texts[1] if task.is_pair else None,
                label=None if label_col is None else _parse_label(task, fields[label_col], where),
                idx=len(examples),
            )
        )
    return examples


def load_tfds(
    task: str | GlueTask,
    split: str,
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = True,
    labelled: bool = False,
) -> list[Example]:
    """Examples of one split of tensorflow-datasets `glue/<task>`, in file order: the same
    `Example`s as `load_tsv` gives for the same files. `isojax.data.tfds_source.load_tfds`
    describes the arguments, the one-request download check and the errors."""
    from isojax.data import tfds_source  # it imports this module: imported here, not above

    return tfds_source.load_tfds(task, split, data_dir, download=download, labelled=labelled)


def load(
    task: str | GlueTask,
    split: str,
    *,
    source: str = "tsv",
    data_dir: str | os.PathLike | None = None,
    download: bool = True,
    labelled: bool = False,
) -> list[Example]:
    """One entry point for both sources: `source="tsv"` (`data_dir` = glue_data) or "tfds".

    `labelled=True` (training, evaluation) refuses a test split with a ValueError.
    """
    if source == "tsv":
        if data_dir is None:
            raise ValueError("source='tsv' needs data_dir, the glue_data folder")
        return load_tsv(data_dir, task, split, labelled=labelled)
    if source == "tfds":
        return load_tfds(task, split, data_dir, download=download, labelled=labelled)
    raise ValueError(f"unknown GLUE source {source!r}; known: ['tsv', 'tfds']")
