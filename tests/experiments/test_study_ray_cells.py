"""The Ray executor's commit check (issue 62, item 7), without Ray: a task whose worker runs
another commit, or hashes its cell's config differently, refuses before it claims or runs the
cell, and the driver then hands out no more cells and refuses in one line, writing nothing.
`tests/e2e/test_study_ray.py` runs the grid on a real local cluster."""

import types

import pytest
from helpers import one_line, study_grid

from experiments.study import command, ray_cells, runner
from experiments.study.cell import git_state
from experiments.study.records import StudyError


class Ref:
    """A task's result to come (hashable, as Ray's object refs)."""

    def __init__(self, fn, job):
        self.fn, self.job = fn, job


class FakeRay:
    """What `ray_cells.run_on_ray` calls of Ray, run in this process: a task runs when its
    result is asked for; `submitted` lists the cells handed out."""

    exceptions = types.SimpleNamespace(RayError=RuntimeError)

    def __init__(self, cpus: float):
        self.cpus, self.submitted = cpus, []

    def is_initialized(self):
        return True

    def cluster_resources(self):
        return {"CPU": self.cpus}

    def remote(self, **options):
        def wrap(fn):
            def submit(job):
                self.submitted.append(job["cell"])
                return Ref(fn, job)

            return types.SimpleNamespace(remote=submit)

        return wrap

    def wait(self, refs, num_returns):
        return refs[:num_returns], refs[num_returns:]

    def get(self, ref):
        return ref.fn(ref.job)


def _job(p, name: str, **changes) -> dict:
    commit, dirty = git_state()
    return {"grid": p.grid_spec, "tier": 1, "runs_dir": str(p.study_dir.parent),
            "results": str(p.results), "retry": False, "cell": name, "commit": commit,
            "dirty": dirty, "config_hash": p.hashes[name], "compile_cache": None,
            "where": name} | changes  # fmt: skip


def test_a_worker_at_another_commit_or_hash_refuses_its_cell(tmp_path, glue_dir, minilm_dir):
    grid = study_grid(tmp_path, glue_dir, minilm_dir, tier_2=False, pretrained=False)
    p = runner.Plan(grid, 1, tmp_path / "runs", tmp_path / "r.jsonl", False)
    with pytest.raises(StudyError, match=r"runs commit \w{10} .* the driver 0000000000"):
        ray_cells.cell_job(_job(p, "rte-none-s1", commit="0" * 40))
    with pytest.raises(StudyError, match=r"config hash 0123\): every node"):
        ray_cells.cell_job(_job(p, "rte-none-s1", config_hash="0123"))
    assert not (tmp_path / "runs" / "tiny").exists()  # nothing claimed, nothing run


def test_the_driver_stops_handing_out_cells_after_a_refusal(
    tmp_path, glue_dir, minilm_dir, monkeypatch, capsys
):
    """Four cells, one slot: the first task refuses (its worker at another commit), so no
    other cell is handed out; the command refuses in one line and writes no line."""
    grid = study_grid(tmp_path, glue_dir, minilm_dir, seeds=(1, 2), tier_2=False, pretrained=False)
    fake = FakeRay(cpus=1.0)
    monkeypatch.setattr(ray_cells, "_ray", lambda: fake)
    monkeypatch.setattr(ray_cells, "git_state", lambda: ("f" * 40, False))
    results = tmp_path / "r.jsonl"
    argv = [grid, "--executor", "ray", "--runs-dir", str(tmp_path / "runs"), "--results",
            str(results), "--compile-cache", ""]  # fmt: skip
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "runs commit ffffffffff" in err and "rte-none-s1" in err, err
    assert fake.submitted == ["rte-none-s1"]
    assert not results.exists() or results.read_text() == ""
