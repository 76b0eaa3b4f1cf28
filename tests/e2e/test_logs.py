"""The library logs and prints nothing: a run embedded in a program writes no line until the
program installs a handler, `logging.getLogger("isojax").setLevel(logging.ERROR)` silences even
the warnings, and the `isojax` command shows the lines (`isojax.logs.install_log_handler`)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

# Three embedded programs in turn in one interpreter (one start-up and import, not three),
# each on the same run folder: a program whose "isojax" logger is at ERROR runs the run; after
# a torn line is appended to its metrics.jsonl, the same quiet program again (the finished run,
# reread); after another torn line, a program that installs the command's handler (the logger
# put back to a fresh interpreter's NOTSET first). A line on stderr ends each program's part.
RUN = """
import logging, pathlib, sys
from isojax.training import config as config_lib, distributed, loop
import jax

def run():
    config = config_lib.default_config()
    config.update_from_flattened_dict({
        "data_dir": sys.argv[1], "model": "tiny-bert", "tokenizer": sys.argv[2], "task": "rte",
        "max_train_examples": 8, "max_eval_examples": 8, "batch_size": 8, "eval_batch_size": 8,
        "max_length": 32, "buckets": (), "max_steps": 1, "tensorboard": False,
    })
    loop.train_and_evaluate(config, sys.argv[3], mesh=distributed.make_mesh(jax.devices()[:1]))
    sys.stderr.flush()
    print(END, file=sys.stderr, flush=True)

def tear():
    metrics = pathlib.Path(sys.argv[3]) / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 9, "ep')

logging.getLogger("isojax").setLevel(logging.ERROR)
run()
tear()
run()
tear()
logging.getLogger("isojax").setLevel(logging.NOTSET)
from isojax.logs import install_log_handler; install_log_handler()
run()
"""
END = "-- end of this program's part --"


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory, glue_dir, minilm_dir):
    """The stderr of each of the three programs of `RUN` (both tests read them), in order."""
    run = tmp_path_factory.mktemp("runs") / "run"
    out = subprocess.run(
        [sys.executable, "-c", f"END = {END!r}\n" + RUN, str(glue_dir), str(minilm_dir), str(run)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    said = out.stderr.split(END + "\n")
    assert len(said) == 4 and said[3] == "", out.stderr
    return said[:3]


def test_an_embedded_run_is_silent_and_a_handler_shows_its_lines(three_runs):
    quiet, _, shown = three_runs
    assert quiet == ""
    assert "isojax: " in shown and "rte from the TSVs in" in shown  # the run's first line


def test_a_torn_metrics_line_is_logged_and_silenced_with_the_logger(three_runs):
    """Issue 50, finding 9: the torn-line drop of `resume.py` was a `warnings.warn`, written to
    stderr by a rerun whose "isojax" logger was at ERROR. Now a logged warning: nothing at
    ERROR, the line with the command's handler."""
    first, quiet, shown = three_runs
    assert first == quiet == ""  # the finished run, reread past a torn line
    assert "metrics.jsonl" in shown and "dropped a torn last line" in shown, shown
    assert "Warning" not in shown, shown
