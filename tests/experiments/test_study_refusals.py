"""AUDIT.md finding 9 on the study runner and `study.analyze`: a results path that is a folder,
a file that is not UTF-8, a line that is a JSON array or holds a string seed, a grid file with
a syntax error, torn or non-object lines for `study.analyze`, and `--tier 0` are each one line
with exit status 2; a dry run writes no `<results>.lock`. Also the job-array flags of issue 62,
item 7: `--list-cells` lists the cells in order, `--cell ID` plans that cell alone."""

import json

import pytest
from helpers import REPO, one_line

from experiments.study import analyze as study_analyze
from experiments.study import command
from experiments.study.grid import load_grid, plan
from experiments.study.records import lock_path_of

GRID = str(REPO / "experiments" / "configs" / "study_pilot.py")
# A record the runner reads, but for the field `damage` changes.
RECORD = {
    "study": "pilot", "cell": "rte-none-s1", "kind": "run", "status": "ok", "config_hash": "0",
    "fields": {"task": "rte", "method": "none", "seed": 1}, "seed": 1, "wall_minutes": 1.0,
    "eval": [{"epoch": 1, "split": "dev", "score": 0.5}],
}  # fmt: skip
DAMAGE = {
    "folder": (None, "is a folder, not a results file"),
    "binary": (b"\xff\xfe\x00", ":1: not UTF-8 text (byte 0xff)"),
    "array": (b"[1, 2, 3]\n", ":1: not a study record (a JSON list, not an object)"),
    "string_seed": (
        (json.dumps(RECORD) + "\n" + json.dumps(RECORD | {"seed": "1"}) + "\n").encode(),
        ":2: not a study record (seed is '1', a str)",
    ),
    "torn_last": (json.dumps(RECORD).encode()[:-5], ": the last line is unfinished (a torn write)"),
    "torn_middle": (b'{"cell": "a", "sta\n' + json.dumps(RECORD).encode() + b"\n", ":1: not JSON"),
    "number_line": (b"7\n", ":1: not a study record (a JSON int, not an object)"),
}


def _damaged(tmp_path, damage: str):
    path = tmp_path / f"{damage}.jsonl"
    data, _ = DAMAGE[damage]
    path.mkdir() if data is None else path.write_bytes(data)
    return path


def _refused(capsys, code: int, *parts: str) -> str:
    err = capsys.readouterr().err
    assert code == 2 and one_line(err), err
    for part in parts:
        assert part in err, err
    return err


@pytest.mark.parametrize("damage", ["folder", "binary", "array", "string_seed", "number_line"])
def test_the_runner_refuses_a_bad_results_file_in_one_line(tmp_path, capsys, damage):
    path = _damaged(tmp_path, damage)
    code = command.main([GRID, "--dry-run", "--results", str(path)])
    _refused(capsys, code, f"study: {path}", DAMAGE[damage][1])


@pytest.mark.parametrize(
    "damage", ["torn_last", "torn_middle", "array", "string_seed", "binary", "number_line"]
)
def test_analyze_refuses_a_bad_results_file_in_one_line(tmp_path, capsys, damage):
    path = _damaged(tmp_path, damage)
    code = study_analyze.main([str(path), "--runs-dir", str(tmp_path)])
    _refused(capsys, code, f"study.analyze: {path}", DAMAGE[damage][1])


def test_a_grid_file_python_cannot_read_is_one_line(tmp_path, capsys):
    grid = tmp_path / "study_bad.py"
    grid.write_text("def get_config(arg=None):\n    return (\n")
    _refused(capsys, command.main([str(grid), "--dry-run"]), f"grid file {grid}:2: ")
    grid.write_text("import not_a_module_anywhere\n")
    _refused(capsys, command.main([str(grid)]), "ModuleNotFoundError", str(grid))
    grid.write_text("def get_config(arg=None):\n    return 1 / 0\n")
    _refused(capsys, command.main([str(grid)]), "get_config raised ZeroDivisionError")


def test_an_argument_the_grid_file_does_not_read_is_refused(tmp_path, capsys):
    """`GRID:zzz` on a grid file that reads no argument (all of experiments/configs/ today)
    is refused in one line, not ignored; a file's declared `ARGS` are accepted."""
    _refused(capsys, command.main([GRID + ":zzz", "--dry-run"]), "takes no argument, got ':zzz'")
    grid = tmp_path / "study_args.py"
    grid.write_text(
        "from experiments.configs import study_pilot\n"
        "ARGS = ('small',)\n"
        "def get_config(arg=None):\n    return study_pilot.get_config()\n"
    )
    load_grid(f"{grid}:small")
    _refused(capsys, command.main([f"{grid}:big", "--dry-run"]), "takes one of ['small']")


@pytest.mark.parametrize("tier", ["0", "-1"])
def test_tier_below_one_is_refused(tmp_path, capsys, tier):
    code = command.main([GRID, "--dry-run", "--tier", tier, "--results", str(tmp_path / "r")])
    _refused(capsys, code, "--tier must be >= 1", f"got {tier}")


def test_a_dry_run_writes_nothing(tmp_path, capsys):
    """No lock file, no results folder, with or without a results file."""
    missing = tmp_path / "new" / "pilot.jsonl"
    assert command.main([GRID, "--dry-run", "--results", str(missing), "--runs-dir",
                         str(tmp_path / "runs")]) == 0  # fmt: skip
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()
    empty = tmp_path / "pilot.jsonl"
    empty.write_text("")
    assert command.main([GRID, "--dry-run", "--results", str(empty)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pilot.jsonl"]
    assert "12 cells, 0 recorded (0 failed), 12 to run" in capsys.readouterr().out
    assert not lock_path_of(empty).exists()


def test_list_cells_and_cell(tmp_path, capsys):
    """`--list-cells`: the plan's cells, one a line, in order, for the tiers asked; `--cell`:
    that cell alone (here its dry run); an unknown cell or a Ray flag without Ray: one line."""
    grid, recipe = load_grid(GRID)
    assert command.main([GRID, "--list-cells"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == [c.name for c in plan(grid, recipe, 1)] and len(listed) == 12
    assert listed[:4] == ["cola-pretrained", "mrpc-pretrained", "stsb-pretrained", "rte-pretrained"]
    results = str(tmp_path / "pilot.jsonl")
    assert command.main([GRID, "--dry-run", "--results", results, "--cell", listed[5]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "12 cells, 0 recorded (0 failed), 1 to run" in out[0]
    assert len(out) == 2 and f" {listed[5]}: " in out[1]
    code = command.main([GRID, "--dry-run", "--results", results, "--cell", "rte-none-s99"])
    _refused(capsys, code, "no cell 'rte-none-s99' in tiers 1-1", "--list-cells")
    _refused(capsys, command.main([GRID, "--address", "auto"]), "--address needs --executor ray")
    code = command.main([GRID, "--executor", "ray", "--cell-cpus", "0", "--dry-run"])
    _refused(capsys, code, "--cell-cpus must be > 0")
