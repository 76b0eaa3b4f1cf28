"""GLUE from tensorflow-datasets (`glue/<task>`): the same `Example`s as the TSVs, in file order.

    dev = tfds_source.load_tfds("rte", "dev", data_dir="~/tensorflow_datasets")  # validation

`glue.load(..., source="tfds")` and `glue.load_tfds` read through `load_tfds`; tensorflow and
tensorflow-datasets (the optional `tfds` extra) are imported only when a split is loaded. The
task registry and `Example` come from `isojax.data.tasks` (this module never imports `glue`).
"""

from __future__ import annotations

import logging
import os
import pathlib
import urllib.request

from isojax.data import tasks
from isojax.logs import quieted


def _probe_download(url: str, timeout: float = 20.0) -> None:
    """One request for the first byte of `url`; raises OSError at once if it cannot be fetched.

    TFDS retries a failed download for minutes (ten attempts with back-off, after its own
    GCS look-ups); this single attempt tells an offline machine apart in seconds.
    """
    request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
    with urllib.request.urlopen(request, timeout=timeout):
        pass


def _tfds_download_url(builder) -> str:
    """A URL the GLUE builder downloads from: the task's zip, or (MRPC) its SentEval file."""
    url = builder.builder_config.data_url
    return url or min(u for u in builder.url_infos if "msr_paraphrase" in u)


def load_tfds(
    task: str | tasks.GlueTask,
    split: str,
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool = True,
    labelled: bool = False,
) -> list[tasks.Example]:
    """Examples of one split of tensorflow-datasets `glue/<task>`, sorted by `idx` (file order).

    Calls `tfds.load(f"glue/{task}", split=..., data_dir=data_dir, download=download)`: with a
    network it downloads and prepares the dataset as usual; offline, `download=False` reads a
    copy already prepared under `data_dir`. Before TFDS downloads, one request checks that the
    source can be reached, so that a machine without network fails in seconds, not after TFDS's
    minutes of retries. tensorflow and tensorflow-datasets are imported here only (the optional
    `tfds` extra).

    Args:
      task: a task name or `tasks.GlueTask`.
      split: one of `task.all_splits` (dev splits map to TFDS "validation", "validation_matched",
        "validation_mismatched"; "train" and the test splits keep their names).
      data_dir: TFDS data folder; None for TFDS's default (`~/tensorflow_datasets`).
      download: let TFDS download and prepare a missing dataset.
      labelled: require labels (training, evaluation): a test split raises ValueError.

    Returns:
      The same `Example`s as `glue.load_tsv` gives for the same files, in file order, `idx`
      counting the split's rows from 0 (TFDS's own MRPC `idx` counts rows of the SentEval
      file, which interleaves train and dev). Test splits (TFDS label -1) have label None.

    Raises:
      GlueDataNotFound: tensorflow-datasets is not installed; the dataset is not prepared in
        `data_dir` and `download` is False; or the download fails. One line, naming the
        folder TFDS looked in and both ways to supply GLUE.
      ValueError: unknown task or split, or a test split with `labelled`.
    """
    task = tasks.get_task(task)
    task.check_split(split, labelled=labelled)
    tfds_split = task.tfds_split(split)
    data_dir = None if data_dir is None else os.fspath(pathlib.Path(data_dir).expanduser())
    try:
        import tensorflow_datasets as tfds  # Slow (imports TensorFlow): only for this source.
    except ImportError as error:
        raise tasks.GlueDataNotFound(
            f"GLUE {task.name} {split}: tensorflow-datasets cannot be imported ({error}); "
            + tasks.how_to_supply(task, split, data_dir)
        ) from None

    _check_tfds_source(tfds, task, split, data_dir, download)
    dataset = tfds.load(
        f"glue/{task.name}",
        split=tfds_split,
        data_dir=data_dir,
        download=download,
        shuffle_files=False,
    )
    return _examples_from_tfds(tfds, task, split, dataset)


def _check_tfds_source(
    tfds, task: tasks.GlueTask, split: str, data_dir: str | None, download: bool
):
    """Raises `GlueDataNotFound` unless `glue/<task>` is prepared in `data_dir` or (with
    `download`) its source answers one request."""
    # TFDS logs (absl WARNING) about a half-written dataset folder while it looks; the one-line
    # error below names that folder instead.
    with quieted("absl", logging.ERROR):
        builder = tfds.builder(f"glue/{task.name}", data_dir=data_dir)
        prepared = builder.is_prepared()
    if not prepared:
        looked = f"{builder.data_dir_root} (looked for {builder.data_dir})"
        if not download:
            raise tasks.GlueDataNotFound(
                f"GLUE {task.name} {split}: tensorflow-datasets glue/{task.name} is not "
                f"prepared in {looked}; " + tasks.how_to_supply(task, split, builder.data_dir_root)
            )
        url = _tfds_download_url(builder)
        try:
            _probe_download(url)
        except OSError as error:
            raise tasks.GlueDataNotFound(
                f"GLUE {task.name} {split}: download of {url} failed ({error}), and "
                f"glue/{task.name} is not prepared in {looked}; "
                + tasks.how_to_supply(task, split, builder.data_dir_root)
            ) from None


def _examples_from_tfds(tfds, task: tasks.GlueTask, split: str, dataset) -> list[tasks.Example]:
    """The `Example`s of a loaded TFDS split, in file order (`idx` renumbered from 0)."""
    unlabelled = split in task.test_splits
    first, *second = task.tfds_text_features
    examples = []
    for batch in tfds.as_numpy(dataset.batch(4096)):
        texts_b = batch[second[0]] if second else [None] * len(batch["idx"])
        for a, b, label, idx in zip(
            batch[first], texts_b, batch["label"], batch["idx"], strict=True
        ):
            if unlabelled:
                label = None
            else:
                label = float(label) if task.is_regression else int(label)
            examples.append(
                tasks.Example(
                    text_a=a.decode("utf-8"),
                    text_b=None if b is None else b.decode("utf-8"),
                    label=label,
                    idx=int(idx),
                )
            )
    # TFDS writes examples in a hashed order; its idx sorts them back into file order. Its MRPC
    # idx counts rows of the SentEval source file (train and dev interleaved), so number the
    # rows of the split afresh, as the split's own TSV does.
    examples.sort(key=lambda example: example.idx)
    return [example._replace(idx=i) for i, example in enumerate(examples)]
