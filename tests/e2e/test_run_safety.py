"""What isojax refuses and what it keeps (issue 25): a run folder survives `export`, a killed
run's log is not duplicated, a NaN run reports no score, an edited config.json is refused,
read-only commands touch nothing, a real full disk is one line, a submission keeps the test
file's own index (the in-process cases: tests/training/test_nonfinite.py,
tests/training/test_checkpointing.py, tests/cli/test_bad_input.py, tests/experiments/).

The end-to-end cases run `isojax` in subprocesses on a random tiny BERT over the MiniLM
vocabulary (16 RTE rows, 2 epochs of 2 steps); they share the session's JAX compilation cache.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from children import child_env
from helpers import finetune_args, logged_warning, one_line

from isojax import cli, runs
from isojax.training import checkpointing, run_folder, stops

pytestmark = pytest.mark.e2e

# The child: `isojax` itself, after an optional patch that kills it at a chosen point.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from isojax.training import checkpointing, reporting
    from isojax import cli

    mode, *argv = sys.argv[1:]
    if mode == "kill-before-first-checkpoint":
        def die(self, step, state, position):
            os.kill(os.getpid(), signal.SIGKILL)
        checkpointing.Checkpointer.save = die
    elif mode == "tear-then-kill":  # dies writing the first line after the step-2 checkpoint
        write = reporting.MetricWriter.write
        def torn(self, split, step, epoch, values):
            if step > 2:
                with open(self._path, "a") as f:
                    f.write('{"step": %d, "epoch": %d, "spl' % (step, epoch))
                os.kill(os.getpid(), signal.SIGKILL)
            write(self, split, step, epoch, values)
        reporting.MetricWriter.write = torn
    sys.exit(cli.main(argv))
    """
)


def isojax(root: pathlib.Path, *argv, mode: str | None = None) -> subprocess.CompletedProcess:
    """`python -m isojax.cli ARGV` (or the patched child in `mode`) in a subprocess."""
    if mode is None:
        command = [sys.executable, "-m", "isojax.cli"]
    else:
        (root / "child.py").write_text(_CHILD)
        command = [sys.executable, str(root / "child.py"), mode]
    return subprocess.run(
        [*command, *map(str, argv)],
        env=child_env(devices=1, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )


def tree(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory, glue_dir, minilm_dir):
    """A run killed before its first checkpoint, started again and killed while writing a log
    line after its step-2 checkpoint, then resumed to its end: `(root, run folder, {stage:
    (completed process, metrics.jsonl text after it)})`."""
    root = tmp_path_factory.mktemp("cli")
    workdir = root / "run"
    argv = finetune_args(glue_dir, minilm_dir, workdir)
    stages = {}
    for mode in ("kill-before-first-checkpoint", "tear-then-kill", None):
        done = isojax(root, *argv, mode=mode)
        stages[mode or "resume"] = (done, (workdir / "metrics.jsonl").read_text())
    return root, workdir, stages


# ---------------------------------------------------------------------------------------------
# Item 5: a killed run's metrics.jsonl.
# ---------------------------------------------------------------------------------------------


def test_a_restarted_run_begins_a_fresh_log_and_drops_a_torn_line(killed_twice):
    root, workdir, stages = killed_twice
    first, log = stages["kill-before-first-checkpoint"]
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert [(1, "train"), (2, "train"), (2, "dev")] == lines_of(log)

    second, log = stages["tear-then-kill"]
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    assert "starting afresh" in second.stderr
    kept, torn = log.rsplit("\n", 1)
    assert lines_of(kept + "\n") == [(1, "train"), (2, "train"), (2, "dev")]  # not doubled
    assert torn.startswith('{"step": 3')  # the kill mid-write left half a line

    resumed, log = stages["resume"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr and "dropped a torn last line" in resumed.stderr
    assert lines_of(log) == [
        (1, "train"), (2, "train"), (2, "dev"), (3, "train"), (4, "train"), (4, "dev")
    ]  # fmt: skip


def lines_of(text: str) -> list[tuple[int, str]]:
    return [(r["step"], r["split"]) for r in map(json.loads, text.splitlines())]


# ---------------------------------------------------------------------------------------------
# Item 1 and 12: export never replaces a run, and an overwrite leaves no stale file.
# ---------------------------------------------------------------------------------------------


def test_export_refuses_a_run_folder_and_overwrite_replaces_only_an_export(
    killed_twice, capsys, tmp_path, glue_dir
):
    root = killed_twice[0]
    workdir = root / "export-run"  # a copy: the other tests keep their run folder whatever happens
    shutil.copytree(killed_twice[1], workdir)
    before = tree(workdir)
    # In this process: the command's exit status and one line are the subprocess check's
    # (the full disk: `python -m isojax.cli`), the refusals are the export's own.
    for overwrite in ([], ["--overwrite"]):
        code = cli.main(["export", str(workdir), str(workdir), *overwrite])
        err = capsys.readouterr().err
        assert code == 2 and one_line(err) and "is a run folder" in err, err
    assert tree(workdir) == before  # config.json and every other file as they were

    out = tmp_path / "hf"
    assert cli.main(["export", str(workdir), str(out)]) == 0
    (out / "pytorch_model.bin").write_bytes(b"an earlier export's weights")
    code = cli.main(["export", str(workdir), str(out)])
    err = capsys.readouterr().err
    assert code == 2 and one_line(err) and "not empty" in err and "--overwrite" in err
    assert cli.main(["export", str(workdir), str(out), "--overwrite"]) == 0
    assert "model.safetensors" in os.listdir(out) and "pytorch_model.bin" not in os.listdir(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left

    # Audit 6, finding 2: the export used as `--model F --workdir F` lost its config.json to
    # the run's; now one line, exit 2, and the folder byte-identical.
    exported = tree(out)
    code = cli.main(
        ["finetune", "--task", "rte", "--model", str(out), "--workdir", str(out),
         "--data-dir", str(glue_dir), "--set", "max_train_examples=16", "--set", "batch_size=8",
         "--set", "max_length=32", "--set", "progress=False", "--set", "tensorboard=False"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and one_line(err) and "holds a model (config.json" in err, err
    assert tree(out) == exported

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    file = tmp_path / "file.bin"
    file.write_text("x")
    for target, message in (
        (mine, "holds no Hugging Face config.json"),
        (root, "holds the folder"),  # the run folder's parent
        (file, "is a file"),
    ):
        code = cli.main(["export", str(workdir), str(target), "--overwrite"])
        err = capsys.readouterr().err
        assert code == 2 and one_line(err) and message in err, err
    assert (mine / "notes.txt").read_text() == "not an export" and file.read_text() == "x"
    assert tree(workdir) == before


# ---------------------------------------------------------------------------------------------
# Item 4: a NaN run reports no score.
# ---------------------------------------------------------------------------------------------


def test_a_run_whose_loss_stays_nan_stops_with_status_3_and_no_score(
    tmp_path, glue_dir, minilm_dir, capfd
):
    """lr 1e30: the first update makes the parameters huge, every loss after it is NaN. In
    this process (`capfd` reads the file descriptors: a library's stray line shows as a
    child's would); a child's exit status and its one line are the full disk's check."""
    workdir = tmp_path / "nan"
    argv = finetune_args(
        glue_dir,
        minilm_dir,
        workdir,
        "optimizer.learning_rate=1e30",
        "max_train_examples=32",
        "max_nonfinite_steps=2",
    )
    capfd.readouterr()
    code = cli.main(argv)
    done = subprocess.CompletedProcess(argv, code, *capfd.readouterr())
    assert done.returncode == stops.EXIT_STATUS == 3, done.stderr[-3000:]
    assert one_line(done.stderr), done.stderr
    assert "2 consecutive step(s) from step 2" in done.stderr and "stopped at step 3" in done.stderr
    assert "dev:" not in done.stdout and "score" not in done.stdout
    results = json.loads((workdir / "results.json").read_text())
    assert results["stopped"] == "non-finite loss" and "dev" not in results
    assert stops.stopped(workdir)["step"] == 3
    assert not (workdir / "checkpoints").exists() or not any((workdir / "checkpoints").iterdir())


# ---------------------------------------------------------------------------------------------
# Item 6: an edited config.json is refused, with the field named.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"sentence": "cls"}, "sentence: 'pooled' -> 'cls'"),
        ({"max_length": 64}, "max_length: 32 -> 64"),
        ({"sentnce": "cls"}, "unknown config field(s) 'sentnce'"),
        ({"normalizer": "isobn"}, "batch_stats"),  # another method's train state: the arrays
    ],
)
def test_an_edited_config_json_is_refused_naming_the_field(
    killed_twice, tmp_path, capsys, edit, named
):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_twice[1], run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps(saved | edit))
    code = cli.main(["predict", str(run_dir), "--split", "dev", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert code == 2 and one_line(err) and named in err, err
    assert not (tmp_path / "p").exists()


def test_a_checkpoint_without_a_stamp_restores_with_a_warning(caplog, killed_twice, tmp_path):
    """A run folder of an older isojax: its checkpoint's position has no config."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed_twice[1], run_dir, ignore=shutil.ignore_patterns("best_checkpoint"))
    restored = runs.restore(run_dir)
    stamp = run_folder.config_stamp(restored.spec.fields)["config"]
    assert run_folder.check_stamp(stamp, restored.spec.fields, "here")
    position = dict(restored.position)
    with checkpointing.Checkpointer(run_dir / "checkpoints", max_to_keep=3) as ckpt:
        ckpt.save(5, restored.state, position)  # saved as before: no "config" key
    with logged_warning(caplog, "saved without its config"):
        runs.restore(run_dir)


# ---------------------------------------------------------------------------------------------
# Items 7, 12, 16: predict keeps the test file's index, refuses wrong destinations, and reads
# a damaged run without touching it.
# ---------------------------------------------------------------------------------------------


def _glue_copy(glue_dir, root, index_values) -> pathlib.Path:
    (root / "RTE").mkdir(parents=True)
    header, *rows = (glue_dir / "RTE" / "test.tsv").read_text().splitlines()[:6]
    rows = [f"{i}\t{row.split(chr(9), 1)[1]}" for i, row in zip(index_values, rows, strict=True)]
    (root / "RTE" / "test.tsv").write_text("\n".join([header, *rows]) + "\n")
    return root


def test_a_submission_keeps_the_test_files_index_and_refuses_a_bad_one(
    killed_twice, tmp_path, capsys, glue_dir
):
    run_dir = killed_twice[1]
    data = _glue_copy(glue_dir, tmp_path / "glue", [7, 3, 100, 12, 0])
    argv = ["predict", str(run_dir), "--split", "test", "--data-dir", str(data)]
    sub = tmp_path / "submission"
    code = cli.main([*argv, "--out", str(tmp_path / "p.tsv"), "--glue-submission", str(sub)])
    assert code == 0, capsys.readouterr().err
    rows = (sub / "RTE.tsv").read_text().splitlines()
    assert [r.split("\t")[0] for r in rows] == ["index", "7", "3", "100", "12", "0"]

    for values, message in (([0, 1, "1.5", 3, 4], "index '1.5' is not a non-negative integer"),
                            ([0, 1, 1, 3, 4], "index 1 repeats line 3's")):  # fmt: skip
        bad = _glue_copy(glue_dir, tmp_path / f"bad{values[2]}", values)
        code = cli.main([*argv[:-1], str(bad), "--glue-submission", str(tmp_path / "s2")])
        err = capsys.readouterr().err
        assert code == 2 and one_line(err) and message in err and "test.tsv:4" in err, err


def test_predict_and_export_refuse_a_destination_of_the_wrong_kind(killed_twice, tmp_path, capsys):
    run_dir = killed_twice[1]
    folder = tmp_path / "folder"
    folder.mkdir()
    file = tmp_path / "file"
    file.write_text("kept")
    for argv, message in (
        (["predict", run_dir, "--split", "dev", "--out", folder], "--out: "),
        (["predict", run_dir, "--split", "test", "--glue-submission", file], "is a file"),
        (["export", run_dir, file], "is a file"),
    ):
        code = cli.main([str(a) for a in argv])
        err = capsys.readouterr().err
        assert code == 2 and one_line(err) and message in err, err
    assert list(folder.iterdir()) == [] and file.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]  # no *.tmp


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_read_only_commands_fall_back_past_a_damaged_checkpoint_without_touching_the_run(
    caplog, killed_twice, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(killed_twice[1], run_dir)
    newest = run_dir / "checkpoints" / "4" / "state"
    for path in newest.rglob("*"):
        if path.is_file() and path.parent.name == "d":
            path.write_bytes(b"")  # a damaged newest checkpoint
    before = tree(run_dir)
    with logged_warning(caplog, "step 4 .* cannot be restored.*back to step 2"):
        code = cli.main(["predict", str(run_dir), "--split", "dev", "--out", str(tmp_path / "p")])
    assert code == 0, capsys.readouterr().err
    assert tree(run_dir) == before  # nothing renamed (no 4.unreadable), written or removed


_UNSHARE = shutil.which("unshare")
_TMPFS = textwrap.dedent(
    """
    set -e
    mount -t tmpfs -o size=10m tmpfs "$1/full"
    mount -t tmpfs -o size=1m,ro tmpfs "$1/ro"
    "$2" -m isojax.cli "${@:3}" --workdir "$1/full/run" && exit 9 || echo "full: $?"
    ls "$1/full/run/checkpoints"
    "$2" -m isojax.cli "${@:3}" --workdir "$1/ro/run" && exit 9 || echo "ro: $?"
    """
)


@pytest.mark.skipif(_UNSHARE is None, reason="needs unshare (util-linux) to mount a tmpfs")
def test_on_a_real_full_or_read_only_disk_finetune_says_one_line(
    killed_twice, tmp_path, glue_dir, minilm_dir
):
    """A 10 MB tmpfs holds the first checkpoints of the tiny run (about 4 MB each, the best
    and the newest), not a third: the one error line is all the run prints of it, on a line of
    its own (orbax's writer threads print a traceback per write cut short, some after the save
    has raised, which made that line share a line with one now and then); a read-only one fails
    at the first write, before anything is built."""
    probe = subprocess.run([_UNSHARE, "-rm", "true"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"cannot unshare a mount namespace: {probe.stderr.decode().strip()}")
    (tmp_path / "full").mkdir()
    (tmp_path / "ro").mkdir()
    (tmp_path / "go.sh").write_text(_TMPFS)
    argv = finetune_args(glue_dir, minilm_dir, "unused")
    argv = argv[: argv.index("--workdir")] + argv[argv.index("--workdir") + 2 :]
    done = subprocess.run(
        [_UNSHARE, "-rm", "bash", str(tmp_path / "go.sh"), str(tmp_path), sys.executable, *argv],
        env=child_env(devices=1, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "full: 1" in done.stdout and "ro: 1" in done.stdout, done.stdout + done.stderr[-3000:]
    assert done.stdout.splitlines()[1] == "2"  # the step-2 checkpoint is kept, nothing half-made
    errors = [line for line in done.stderr.splitlines() if line.startswith("isojax")]
    assert errors[0].startswith("isojax finetune: error: cannot write checkpoint step 4 in ")
    assert "No space left on device; the checkpoints of steps [2] are kept" in errors[0]
    assert errors[1].startswith("isojax finetune: error: ") and "Read-only" in errors[1]
    assert len(errors) == 2, done.stderr[-3000:]
    # Nothing but the one line of each: no traceback of orbax's cut-short writes, no asyncio log.
    assert "Traceback" not in done.stderr and "asyncio" not in done.stderr, done.stderr[:3000]
