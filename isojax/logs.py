"""Logging helpers: the terminal handler of the `isojax` command, and quieting another
library's logger for a block.

isojax logs through `logging`, under the "isojax" logger (`logging.getLogger(__name__)` in each
module); importing it installs no handler. The `isojax` command calls `install_log_handler`
(so do the study runner, the examples and the tests), so its terminal output is the records'
lines, the progress line rewritten in place; a program that embeds isojax decides itself, and
``logging.getLogger("isojax").setLevel(logging.ERROR)`` silences a run.
"""

import contextlib
import logging
import sys


class TerminalHandler(logging.Handler):
    """What the `isojax` command shows of the library's log: each record's message on the
    current `sys.stderr`, the progress line (`reporting.INPLACE`) rewritten in place on a
    terminal."""

    def __init__(self):
        super().__init__(logging.INFO)
        self._open = False  # an in-place line is on the terminal

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr
        if getattr(record, "isojax_inplace_end", False):
            text = "\n" if self._open else ""
            self._open = False
        elif getattr(record, "isojax_inplace", False):
            text, self._open = f"\r{self.format(record)}\033[K", True
        else:
            text = ("\n" if self._open else "") + self.format(record) + "\n"
            self._open = False
        stream.write(text)
        stream.flush()


def install_log_handler() -> None:
    """Shows the "isojax" loggers' INFO and above on stderr, once: the command owns the
    terminal, so their records stop here instead of also reaching a root handler (orbax's
    import logs through absl, which calls `logging.basicConfig()`, and each line showed twice,
    the second as `INFO:isojax...:`). Installed once per process."""
    logger = logging.getLogger("isojax")
    if not any(isinstance(h, TerminalHandler) for h in logger.handlers):
        logger.addHandler(TerminalHandler())
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


class Below(logging.Filter):
    """Drops the records below `level` (`logging.CRITICAL + 1`: every record)."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def quieted(name: str, level: int):
    """For the block, logger `name` drops its records below `level` (a `logging.Filter`; the
    logger's level and handlers are left as they are)."""
    logger, below = logging.getLogger(name), Below(level)
    logger.addFilter(below)
    try:
        yield
    finally:
        logger.removeFilter(below)
