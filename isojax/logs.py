"""Logging helpers the library shares: quieting another library's logger for a block.

isojax logs through `logging`, under the "isojax" logger (`logging.getLogger(__name__)` in each
module); it installs no handler. The `isojax` command installs one (`isojax.cli.common`), so
its terminal output is the lines below; a program that embeds isojax decides itself, and
``logging.getLogger("isojax").setLevel(logging.ERROR)`` silences a run.
"""

import contextlib
import logging


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
