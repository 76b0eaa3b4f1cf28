"""Tests for the record loading of experiments/report/ (records): duplicated cells,
bad lines, mixed commits and mixed devices refused with one line; the constant-prediction scores
against scikit-learn on the real dev labels."""

import json

import numpy as np
import pytest
from helpers import REPO
from report_data import (
    _normalizers_records,
    _record,
    _write,
)

from experiments.report import page as report
from experiments.report import records as report_records


def test_a_duplicated_cell_is_refused_naming_both_lines(tmp_path, capsys):
    records = _normalizers_records()
    path = _write(tmp_path, "twice", records + records)  # a JSONL concatenated with itself
    n = len(records)
    with pytest.raises(report_records.RecordsError, match=rf"twice.jsonl:{n + 1}: cell "):
        report_records.load(path)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is recorded already at line 1" in err
    assert not (tmp_path / "twice.md").exists()


def test_a_missing_file_a_bad_line_or_a_record_without_its_keys_is_one_line(tmp_path, capsys):
    good = json.dumps(_normalizers_records()[0])
    for name, text, expected in (
        ("bad", good + "\n{oops\n", "bad.jsonl:2: not JSON"),
        ("keys", good + '\n{"cell": "x", "kind": "run"}\n', "keys.jsonl:2: not a study record "
         "(no 'status', 'fields', 'seed', 'eval')"),
        ("empty", "\n", "empty.jsonl: no records"),
    ):  # fmt: skip
        (tmp_path / f"{name}.jsonl").write_text(text)
        assert report.main([str(tmp_path / f"{name}.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, err
    assert report.main([str(tmp_path / "absent.jsonl")]) == 2
    assert "absent.jsonl: no such results file" in capsys.readouterr().err


@pytest.mark.parametrize("change", ["commit", "dirty"])
def test_mixed_commits_or_a_dirty_tree_are_refused_unless_allowed(tmp_path, capsys, change):
    records = _normalizers_records()
    if change == "commit":
        records[3]["git_commit"] = "b" * 40
        expected = r"records from 2 commits \(aaaaaaaaaa x\d+; bbbbbbbbbb x1\)"
    else:
        records[3]["git_dirty"] = True
        expected = r"records from 2 commits \(aaaaaaaaaa x\d+; aaaaaaaaaa \(dirty\) x1\)"
    path = _write(tmp_path, "mixed", records)
    with pytest.raises(report_records.RecordsError, match=expected):
        report_records.load(path)
    assert report.main([str(path)]) == 2
    assert "--allow-mixed-commits" in capsys.readouterr().err
    assert not (tmp_path / "mixed.md").exists()
    records = report_records.load(path, allow_mixed_commits=True)
    md = report.render(records, report.build(records), {}, "mixed")
    assert "**Mixed commits** (`--allow-mixed-commits`)" in md
    # Every record dirty (one commit): refused too.
    for r in records:
        r |= {"git_commit": "a" * 40, "git_dirty": True}
    with pytest.raises(report_records.RecordsError, match=r"a dirty tree"):
        report_records.load(_write(tmp_path, "dirty", records))


def test_header_names_devices_and_a_mixed_jsonl_is_refused_unless_allowed(tmp_path, capsys):
    records = _normalizers_records()
    for r in records:
        r |= {"device": "cpu cpu x1", "jax_version": "0.10.2"}
    md = report.render(records, report.build(records), {}, "one")
    n = len(records)
    unknown = "CPU model and cores not recorded"
    assert f"device: cpu cpu x1 (jax 0.10.2) x{n}; host: {unknown} x{n}." in md
    records[0]["host"] = {"cpu": "AMD EPYC", "cores": 2}
    md = report.render(records, report.build(records), {}, "one")
    assert f"host: AMD EPYC, 2 cores x1, CPU model and cores not recorded x{n - 1}." in md
    assert "Mixed devices" not in md and "Mixed commits" not in md

    # One GPU line among CPU lines: refused with one line, naming the file and both devices.
    records[1] |= {"device": "gpu NVIDIA H200 x1", "jax_version": "0.11.2"}
    records[2].pop("jax_version")
    path = _write(tmp_path, "mixed", records)
    assert report.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "mixed.jsonl: records from 2 devices (cpu cpu x1 x" in err
    assert not (tmp_path / "mixed.md").exists()
    assert report.main([str(path), "--allow-mixed-devices"]) == 0
    md = (tmp_path / "mixed.md").read_text()
    assert "gpu NVIDIA H200 x1 (jax 0.11.2) x1" in md
    assert "cpu cpu x1 (jax not recorded) x1" in md
    assert "**Mixed devices**" in md


def test_help_names_a_results_file_that_exists(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    out = capsys.readouterr().out
    named = [w.rstrip(".,)") for w in out.split() if ".jsonl" in w]
    assert named and all((REPO / w).is_file() for w in named), named


@pytest.mark.parametrize("task", ["cola", "mrpc", "rte"])
def test_constant_scores_are_sklearns_scores_of_one_class_on_the_real_dev_labels(task, glue_dir):
    """`constant_scores(task)[c]` is the task's dev score (scikit-learn) of predicting class c
    for every dev example of the local TSV, and `CHANCE` is the best of them."""
    import sklearn.metrics

    from isojax.data import glue

    labels = np.array([e.label for e in glue.load_tsv(glue_dir, task, "dev")])
    assert tuple(np.bincount(labels)) == report_records.DEV_CLASS_COUNTS[task]
    assert len(labels) == report_records.DEV_SIZE[task]
    expected = []
    for c in range(2):
        pred = np.full_like(labels, c)
        if task == "cola":
            expected.append(sklearn.metrics.matthews_corrcoef(labels, pred))
        elif task == "mrpc":
            f1 = sklearn.metrics.f1_score(labels, pred, zero_division=0.0)
            expected.append((sklearn.metrics.accuracy_score(labels, pred) + f1) / 2)
        else:
            expected.append(sklearn.metrics.accuracy_score(labels, pred))
    np.testing.assert_allclose(report_records.constant_scores(task), expected, rtol=0, atol=1e-12)
    assert report_records.CHANCE[task] == max(expected)
    assert report_records.constant_scores("stsb") == () and report_records.CHANCE["stsb"] == 0.0


def test_evaluations_at_a_constant_prediction_are_counted_per_arm(tmp_path):
    """RTE: an evaluation at 146/277 or 131/277 (to 1e-6) counts, 0.53 does not; the epochs
    before the last and the last epochs are counted apart, per arm, and STS-B has no row."""
    major, minor = 146 / 277, 131 / 277
    records = [
        _record("rte-none-s1", "rte", "none", 1, [major, 0.58]),
        _record("rte-none-s2", "rte", "none", 2, [0.53, minor + 5e-7]),
        _record("rte-isobn-s1", "rte", "isobn", 1, [minor, major]),
        _record("rte-isobn-s2", "rte", "isobn", 2, [major + 1e-5, 0.60]),
        _record("stsb-none-s1", "stsb", "none", 1, [0.0, 0.80]),
    ]
    assert report_records.at_constant_prediction(records[1]) == [False, True]
    data = report.build(records)
    arms = data["per_task"]["rte"]["arms"]
    assert arms["none"]["constant"] == {"earlier": (1, 2), "last": (1, 2)}
    assert arms["isobn"]["constant"] == {"earlier": (1, 2), "last": (1, 2)}
    assert "constant" not in data["per_task"]["stsb"]["arms"]["none"]
    md = report.write_report(_write(tmp_path, "constant", records)).read_text()
    assert "(rte 0.527 / 0.473)" in md
    section = md.split("## Evaluations at a constant prediction's score")[1].split("\n## ")[0]
    assert "| rte | none | 1 of 2 | 1 of 2 |" in section
    assert "| rte | isobn | 1 of 2 | 1 of 2 |" in section and "| stsb |" not in section
