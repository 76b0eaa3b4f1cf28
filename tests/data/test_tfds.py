"""The tensorflow-datasets source of GLUE (`isojax.data.tfds_source`): the registry against
TFDS's GLUE builder, a real round trip against the TSVs, and the messages when it is missing or
offline."""

import os
import sys
import urllib.error

import numpy as np
import pytest

from isojax.data import glue, tasks, tfds_source


def _tfds():
    """tensorflow_datasets; a skip where it is not installed, but a failure under CI=true, where
    the `tfds` extra is installed and a broken TensorFlow must not turn these tests into skips."""
    if os.environ.get("CI", "").lower() == "true":
        import tensorflow_datasets

        return tensorflow_datasets
    return pytest.importorskip("tensorflow_datasets")


def test_missing_tfds_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import raises ImportError
    monkeypatch.setenv("CI", "true")
    try:
        _tfds()
    except pytest.skip.Exception:
        pytest.fail("under CI=true a missing tensorflow_datasets skipped instead of failing")
    except ImportError:
        pass
    else:
        pytest.fail("tensorflow_datasets imported although it is blocked")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        _tfds()


@pytest.mark.parametrize("name", sorted(tasks.TASKS))
def test_registry_matches_tfds_features(name):
    tfds = _tfds()
    task = tasks.get_task(name)
    builder = tfds.builder(f"glue/{name}")
    features = builder.info.features
    assert set(features) == {*task.tfds_text_features, "label", "idx"}
    if task.is_regression:
        assert features["label"].dtype.name == "float32"
    else:
        assert tuple(features["label"].names) == task.label_names
    config = builder.builder_config
    assert config.data_dir in (None, task.folder)
    if name not in ("mrpc",):  # TFDS builds MRPC from the SentEval files instead of a TSV.
        assert tuple(config.text_features.values()) == task.text_columns
        assert config.label_column == task.label_column


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory, glue_dir):
    """A TFDS data_dir with glue/{rte,mrpc,cola,stsb} prepared by TFDS's own builder
    (`download_and_prepare`, the public API), its downloads served from the local files:
    the task folders of glue_data as the extracted GLUE zips, and for MRPC the SentEval files
    TFDS builds train and dev from (`_source/`) and the test TSV."""
    tfds = _tfds()
    data_dir = tmp_path_factory.mktemp("tfds")
    mrpc = glue_dir / "MRPC"
    local = {
        "train": mrpc / "_source" / "msr_paraphrase_train.txt",
        "dev_ids": mrpc / "_source" / "dev_ids.tsv",
        "test": mrpc / "test.tsv",  # TFDS reads its "#1 String" and "#2 String" columns only
    }

    def download(self, urls):  # MRPC: {"dev_ids": url, "train": url, "test": url}
        return {key: os.fspath(local[key]) for key in urls}

    def download_and_extract(self, url):  # the GLUE zip of a task, extracted: <TASK>/*.tsv
        assert url.startswith("https://dl.fbaipublicfiles.com/glue/data/"), url
        return os.fspath(glue_dir)

    config = tfds.download.DownloadConfig(
        try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tfds.download.DownloadManager, "download", download)
        patch.setattr(tfds.download.DownloadManager, "download_and_extract", download_and_extract)
        for name in ("rte", "mrpc", "cola", "stsb"):
            tfds.builder(f"glue/{name}", data_dir=data_dir).download_and_prepare(
                download_config=config
            )
    return data_dir


@pytest.mark.parametrize(
    "name, split",
    [("rte", "train"), ("rte", "dev"), ("rte", "test"), ("mrpc", "train"), ("mrpc", "dev"),
     ("mrpc", "test"), ("cola", "dev"), ("cola", "test"), ("stsb", "dev"), ("stsb", "test")],
)  # fmt: skip
def test_tfds_source_equals_tsv_source(tfds_dir, glue_dir, name, split):
    from_tfds = glue.load_tfds(name, split, data_dir=tfds_dir, download=False)
    from_tsv = glue.load_tsv(glue_dir, name, split)
    assert len(from_tfds) == len(from_tsv)
    if name == "stsb" and split != "test":  # TFDS stores the score as float32.
        from_tsv = [e._replace(label=float(np.float32(e.label))) for e in from_tsv]
    assert from_tfds == from_tsv


def test_load_dispatches_to_tfds(tfds_dir, glue_dir):
    loaded = glue.load("rte", "dev", source="tfds", data_dir=tfds_dir, download=False)
    assert loaded == glue.load("rte", "dev", source="tsv", data_dir=glue_dir)


# --- GLUE nowhere: one line naming both ways to supply it, and no minutes of retries. ----------


def test_unprepared_tfds_offline_names_the_folder_and_both_ways(tmp_path):
    _tfds()
    with pytest.raises(tasks.GlueDataNotFound) as caught:
        glue.load_tfds("rte", "dev", data_dir=tmp_path, download=False)
    message = str(caught.value)
    assert "\n" not in message
    assert f"not prepared in {tmp_path}" in message
    assert "glue_data folder holding RTE/dev.tsv" in message and "--tfds-data-dir" in message


def test_failed_download_says_so_after_one_attempt(tmp_path, monkeypatch):
    tfds = _tfds()
    attempts = []

    def offline(request, timeout=None):
        attempts.append(request.full_url)
        raise urllib.error.URLError("Temporary failure in name resolution")

    def no_tfds_download(*args, **kwargs):
        pytest.fail("tfds.load was called: it would retry the download for minutes")

    monkeypatch.setattr(tfds_source.urllib.request, "urlopen", offline)
    monkeypatch.setattr(tfds, "load", no_tfds_download)
    for task, url in [("rte", "glue/data/RTE.zip"), ("mrpc", "msr_paraphrase_")]:
        attempts.clear()
        with pytest.raises(
            tasks.GlueDataNotFound, match=rf"download of \S*{url}\S* failed"
        ) as caught:
            glue.load_tfds(task, "train", data_dir=tmp_path)
        assert len(attempts) == 1
        assert "name resolution" in str(caught.value) and "glue_data folder" in str(caught.value)
        assert str(tmp_path) in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("command", ["analyze", "finetune"])
def test_cli_without_glue_prints_one_line_and_exits_2(
    tmp_path, monkeypatch, capsys, minilm_dir, command
):
    from isojax import cli

    tfds = _tfds()
    monkeypatch.setattr(
        tfds_source.urllib.request,
        "urlopen",
        lambda *a, **k: (_ for _ in ()).throw(urllib.error.URLError("no network")),
    )
    monkeypatch.setattr(tfds, "load", lambda *a, **k: pytest.fail("tfds.load was called"))
    common = ["--task", "rte", "--model", "tiny-bert"]
    if command == "analyze":
        argv = ["analyze", *common, "--tokenizer", str(minilm_dir),
                "--tfds-data-dir", str(tmp_path), "--out", str(tmp_path / "out")]  # fmt: skip
    else:
        sets = ["--set", f"tokenizer={minilm_dir}", "--set", f"tfds_data_dir={tmp_path}"]
        argv = ["finetune", *common, *sets, "--workdir", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "glue_data folder" in err and str(tmp_path) in err, err
