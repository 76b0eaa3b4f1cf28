"""What the `isojax` sub-commands share: the usage error, the parser that raises it, and the
checkpoint choice (`--step N | --best`) with the restore of the run it names."""

from __future__ import annotations

import argparse
import logging
import sys


class UsageError(Exception):
    """A bad command line or configuration: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) raised as `UsageError`."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def add_checkpoint_choice(parser: argparse.ArgumentParser) -> None:
    """--step N | --best (default: the newest checkpoint)."""
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--step", type=int, help="a saved step of RUN_DIR/checkpoints")
    choice.add_argument("--best", action="store_true", help="the best dev epoch's checkpoint")


def restore_run(args: argparse.Namespace):
    """`runs.restore` of the command's run folder and checkpoint choice; its errors (no
    checkpoint, no such step, a checkpoint of another config) are usage errors."""
    from isojax import runs
    from isojax.training import checkpointing

    try:
        return runs.restore(args.run_dir, step=args.step, best=args.best)
    except (runs.RunNotRestorable, checkpointing.CheckpointMismatch) as err:
        raise UsageError(str(err)) from None


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
