"""What the `isojax` sub-commands share: the program's name, the usage error, the parser that
raises it, and the checkpoint choice (`--step N | --best`) with the restore of the run it names."""

from __future__ import annotations

import argparse

PROG = "isojax"


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
