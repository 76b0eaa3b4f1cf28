"""GLUE's TSV source, and `load`, the entry point to it and to the tensorflow-datasets source
(`isojax.data.tfds_source`, also reached as `glue.load_tfds`). The task registry, `Example` and
the errors live in `isojax.data.tasks` (`tasks.get_task`, `tasks.TASKS`, `tasks.GlueTask`,
`tasks.Example`, `tasks.GlueDataNotFound`, `tasks.GlueDataInvalid`), and only there.

Both sources return the same `Example`s in file order (`idx` = 0-based data row, as in TFDS):

    task = tasks.get_task("rte")
    train = glue.load_tsv("glue_data", task, "train", labelled=True)   # glue_data/RTE/train.tsv
    dev = glue.load_tfds(task, "dev", data_dir="~/tensorflow_datasets")   # glue/rte validation
    test = glue.load_tsv("glue_data", task, "test")   # unlabelled: every label is None

The TSVs are the files of the usual `download_glue_data.py` (`glue_data/<TASK>/{train,dev,
test}.tsv`; MNLI `dev_matched.tsv`, `test_matched.tsv`, ...). They are split on tabs with no
quote handling, as the TFDS GLUE builder reads them (`csv.QUOTE_NONE`): some fields hold
unbalanced `"`. A UTF-8 BOM (MRPC) is dropped, and so are CRLF line ends; blank lines at the
end of a file are skipped (a last newline too many is common and harmless), a blank line
before a data row is an error naming its line (a cut or merged file). CoLA's train and dev
files have no header (its test file has one). The test splits (GLUE's leaderboard sets) carry
no labels: their `Example.label` is None, and `labelled=True` (training, evaluation) refuses
them.

When neither source has the data (no TSV file; tfds not installed, not prepared offline, or its
download fails) the loaders raise `GlueDataNotFound`, one line naming both ways to supply GLUE;
a malformed file raises `GlueDataInvalid` (a `ValueError`), one line naming the file and line.

References:
  Wang et al., `GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language
  Understanding <https://arxiv.org/abs/1804.07461>`_, ICLR 2019. SPEC.md §7.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Iterator

from isojax.data import tasks
from isojax.data.tfds_source import load_tfds

__all__ = [
    "load",
    "load_tfds",
    "load_tsv",
    "tsv_path",
]


def tsv_rows(path: pathlib.Path) -> Iterator[tuple[int, list[str]]]:
    """(1-based line number, fields) of each line; tabs only, no quoting.

    Lines end at "\\n" only (never at a lone "\\r", which a text-mode reader would split on);
    a trailing "\\r" (CRLF files) is dropped, and so is a UTF-8 BOM at the start of the file.
    Blank lines at the end of the file are skipped; a blank line with a line after it raises
    `GlueDataInvalid` naming the blank line (no GLUE row is empty: every file has 2+ columns).
    """
    blank = None  # line number of the first blank line not yet followed by a non-blank one
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise tasks.GlueDataInvalid(
                    f"{path}:{number}: not UTF-8 ({error.reason})"
                ) from None
            if number == 1:
                line = line.removeprefix("\ufeff")
            line = line.removesuffix("\n").removesuffix("\r")
            if not line:
                blank = number if blank is None else blank
                continue
            if blank is not None:
                raise tasks.GlueDataInvalid(
                    f"{path}:{blank}: blank line before line {number} (only the end of a file "
                    "may have blank lines)"
                )
            yield number, line.split("\t")


def _parse_label(task: tasks.GlueTask, value: str, where: str) -> int | float:
    if task.is_regression:
        try:
            score = float(value)
        except ValueError:
            score = math.nan
        if not math.isfinite(score):
            raise tasks.GlueDataInvalid(
                f"{where}: {task.label_column!r} is {value!r}, not a finite number"
            )
        return score
    try:
        return task.label_values.index(value)
    except ValueError:
        raise tasks.GlueDataInvalid(
            f"{where}: unknown label {value!r} in column {task.label_column!r}; "
            f"expected one of {list(task.label_values)}"
        ) from None


def tsv_path(data_dir: str | os.PathLike, task: str | tasks.GlueTask, split: str) -> pathlib.Path:
    """`data_dir/<TASK>/<split>.tsv`, e.g. `glue_data/MNLI/dev_matched.tsv`."""
    task = tasks.get_task(task)
    task.check_split(split)
    return pathlib.Path(data_dir).expanduser() / task.folder / f"{split}.tsv"


def load_tsv(
    data_dir: str | os.PathLike, task: str | tasks.GlueTask, split: str, *, labelled: bool = False
) -> list[tasks.Example]:
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
      GlueDataInvalid: a header without a needed column; a row with another number of fields
        than the header; an unknown or unparsable label; a blank line before a data row; bytes
        that are not UTF-8 (a `ValueError`; the message names the file and the 1-based line).
      ValueError: unknown task or split; a test split with `labelled`.
    """
    task = tasks.get_task(task)
    task.check_split(split, labelled=labelled)
    path = tsv_path(data_dir, task, split)
    if not path.is_file():
        raise tasks.GlueDataNotFound(
            f"GLUE {task.name} {split} file not found: {path}; "
            + tasks.how_to_supply(task, split, None)
        )
    test = split in task.test_splits
    rows = tsv_rows(path)
    if task.fieldnames is None or test:
        _, header = next(rows, (1, [""]))
    else:
        header = list(task.fieldnames)
    columns = {name: i for i, name in enumerate(header)}
    needed = task.text_columns if test else (*task.text_columns, task.label_column)
    for name in needed:
        if name not in columns:
            raise tasks.GlueDataInvalid(
                f"{path}:1: header lacks column {name!r}; header is {header}"
            )
    text_cols = [columns[name] for name in task.text_columns]
    label_col = None if test else columns[task.label_column]

    examples = []
    for number, fields in rows:
        where = f"{path}:{number}"
        if len(fields) != len(header):
            raise tasks.GlueDataInvalid(
                f"{where}: {len(fields)} tab-separated fields, expected {len(header)} "
                f"(columns {header})"
            )
        texts = [fields[i] for i in text_cols]
        examples.append(
            tasks.Example(
                text_a=texts[0],
                text_b=texts[1] if task.is_pair else None,
                label=None if label_col is None else _parse_label(task, fields[label_col], where),
                idx=len(examples),
            )
        )
    return examples


def load(
    task: str | tasks.GlueTask,
    split: str,
    *,
    source: str = "tsv",
    data_dir: str | os.PathLike | None = None,
    download: bool = True,
    labelled: bool = False,
) -> list[tasks.Example]:
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
