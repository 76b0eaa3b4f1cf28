"""The eight GLUE tasks: the registry (`TASKS`, `get_task`), the `Example` both sources return,
and the errors both raise. The TSV source (`isojax.data.glue`) and the tensorflow-datasets
source (`isojax.data.tfds_source`) import this module and not each other; every name here is
also importable from `isojax.data.glue`, as before.

    task = tasks.get_task("rte")     # "RTE", "sts-b" and "stsb" work too
    task.label_names                 # ('entailment', 'not_entailment'): TFDS order

Label names and their order are those of TFDS (`tfds.builder("glue/<task>")`), so a label id
means the same thing from either source (RTE: entailment = 0, not_entailment = 1).

References:
  Wang et al., `GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language
  Understanding <https://arxiv.org/abs/1804.07461>`_, ICLR 2019. SPEC.md §7.
"""

from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from isojax import errors


class GlueDataNotFound(FileNotFoundError):
    """No source holds a GLUE split: no TSV file, and no usable tensorflow-datasets copy."""


class GlueDataInvalid(errors.InputError):
    """A GLUE file that cannot be read as its task's split: a missing column, a row with another
    number of fields, an unknown or unparsable label, a blank line before the last data row,
    bytes that are not UTF-8. The one-line message names the file and its 1-based line."""


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
      metrics: names of `isojax.data.metrics` functions reported for this task; the GLUE score is
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


def how_to_supply(task: GlueTask, split: str, tfds_dir: str | os.PathLike | None) -> str:
    """The two ways to supply GLUE, for the one-line `GlueDataNotFound` messages."""
    where = f"in {tfds_dir}" if tfds_dir is not None else "in TFDS's data dir"
    return (
        f"supply GLUE either as a glue_data folder holding {task.folder}/{split}.tsv "
        f"(--data-dir), or as tensorflow-datasets glue/{task.name} prepared {where} "
        f"(--tfds-data-dir; needs isojax[tfds])"
    )
