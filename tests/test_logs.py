"""The `isojax` command's log handler (`isojax.cli.common`) rewrites the progress line in place;
that a run embedded in a program prints nothing until it installs a handler:
tests/e2e/test_logs.py."""

import logging

from isojax.cli import common


def test_the_terminal_handler_rewrites_the_progress_line_in_place(capsys):
    handler, logger = common.TerminalHandler(), logging.getLogger("isojax.test_handler")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.info("step 1", extra={"isojax_inplace": True})
        logger.info("step 2", extra={"isojax_inplace": True})
        logger.warning("a notice")
        logger.info("step 3", extra={"isojax_inplace": True})
        logger.info("", extra={"isojax_inplace_end": True})
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert err == "\rstep 1\033[K\rstep 2\033[K\na notice\n\rstep 3\033[K\n"
