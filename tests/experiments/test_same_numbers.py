"""experiments/checks/same_numbers.py: two run folders' numbers compared under ==, timed keys
left out."""

import json

from experiments.checks import same_numbers


def _folder(path, loss, step_time, score=0.5):
    path.mkdir()
    lines = [
        {
            "step": 1,
            "split": "train",
            "loss": loss,
            "step_time_s": step_time,
            "examples_per_s": 9.0,
        },
        {"step": 1, "split": "dev", "score": score},
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "results.json").write_text(json.dumps({"dev": {"score": score}}, indent=2))
    return path


def test_timed_keys_are_left_out_and_a_last_bit_change_is_found(tmp_path):
    before = _folder(tmp_path / "a", 0.6931471805599453, 0.12)
    assert same_numbers.compare(before, _folder(tmp_path / "b", 0.6931471805599453, 0.34)) is None
    found = same_numbers.compare(before, _folder(tmp_path / "c", 0.6931471805599454, 0.12))
    assert found == "metrics.jsonl line 1: loss 0.6931471805599453 -> 0.6931471805599454"


def test_a_changed_results_file_or_a_missing_line_is_found(tmp_path):
    before = _folder(tmp_path / "a", 0.5, 0.1)
    after = _folder(tmp_path / "b", 0.5, 0.1)
    (after / "results.json").write_text(json.dumps({"dev": {"score": 0.5}}))
    assert same_numbers.compare(before, after) == "results.json differs"
    lines = (after / "metrics.jsonl").read_text().splitlines()[:1]
    (after / "metrics.jsonl").write_text(lines[0] + "\n")
    assert same_numbers.compare(before, after) == "metrics.jsonl has 2 lines before and 1 after"
