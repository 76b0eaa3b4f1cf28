"""The library logs and prints nothing: a run embedded in a program writes no line until the
program installs a handler, `logging.getLogger("isojax").setLevel(logging.ERROR)` silences even
the warnings, and the `isojax` command shows the lines (`isojax.logs.install_log_handler`)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e

RUN = """
import logging, sys
from isojax.training import config as config_lib, distributed, loop
import jax
{setup}
config = config_lib.default_config()
config.update_from_flattened_dict({{
    "data_dir": sys.argv[1], "model": "tiny-bert", "tokenizer": sys.argv[2], "task": "rte",
    "max_train_examples": 8, "max_eval_examples": 8, "batch_size": 8, "eval_batch_size": 8,
    "max_length": 32, "buckets": (), "max_steps": 1, "tensorboard": False,
}})
loop.train_and_evaluate(config, sys.argv[3], mesh=distributed.make_mesh(jax.devices()[:1]))
"""


def _run(setup: str, tmp_path, glue_dir, minilm_dir) -> str:
    code = textwrap.dedent(RUN.format(setup=setup))
    out = subprocess.run(
        [sys.executable, "-c", code, str(glue_dir), str(minilm_dir), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return out.stderr


QUIET = 'logging.getLogger("isojax").setLevel(logging.ERROR)'
SHOWN = "from isojax.logs import install_log_handler; install_log_handler()"


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory, glue_dir, minilm_dir):
    """One run folder, three embedded programs (both tests read them): a run with the
    "isojax" logger at ERROR; after a torn line is appended to its metrics.jsonl, the same
    quiet program again (the finished run, reread); after another torn line, a program that
    installs the command's handler. Their stderr, in that order."""
    root = tmp_path_factory.mktemp("runs")
    metrics = root / "run" / "metrics.jsonl"
    said = [_run(QUIET, root, glue_dir, minilm_dir)]
    for setup in (QUIET, SHOWN):
        metrics.write_text(metrics.read_text() + '{"step": 9, "ep')
        said.append(_run(setup, root, glue_dir, minilm_dir))
    return said


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
