"""The `isojax` command's log handler (`isojax.logs.TerminalHandler`) rewrites the progress line
in place; that a run embedded in a program prints nothing until it installs a handler:
tests/e2e/test_logs.py."""

import logging

from isojax import logs


def test_the_terminal_handler_rewrites_the_progress_line_in_place(capsys):
    handler, logger = logs.TerminalHandler(), logging.getLogger("isojax.test_handler")
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


def test_library_warnings_obey_the_isojax_logger(tmp_path, capfd, caplog):
    """Issue 50, finding 9: the torn-line drop (and the four other `warnings.warn` sites) wrote
    to stderr whatever the "isojax" logger's level; `pytest -W error` made it an exception.
    Now a WARNING record of "isojax.training.reporting", dropped at ERROR."""
    import logging

    from isojax.training import reporting

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "ep')
    root = logging.getLogger("isojax")
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        assert [record["step"] for _, record in reporting.metrics_lines(path)] == [1]
    finally:
        root.setLevel(level)
    assert capfd.readouterr() == ("", "")
    with caplog.at_level(logging.WARNING, "isojax"):
        reporting.metrics_lines(path)
    (record,) = caplog.records
    assert record.name == "isojax.training.reporting" and record.levelno == logging.WARNING
    assert f"{path}:2: dropped a torn last line" in record.getMessage()
