"""The `isojax` command: fine-tune, analyse isotropy, export and predict.

    isojax finetune --task rte --normalizer isobn --data-dir glue_data --workdir runs/rte-isobn
    isojax analyze --run runs/rte-isobn --best --out runs/rte-isobn/analysis
    isojax export runs/rte-isobn runs/hf/rte-isobn --best    # transformers folder + card
    isojax predict runs/rte-isobn --split test --glue-submission runs/submission/   # RTE.tsv

`main` parses the command line, checks the optional modules the command needs, runs it, and
turns its refusals into one line on stderr. One module per command (`COMMANDS`): `finetune`
(the configuration from `--config`, the flags and `--set`, then the run), `analyze`, and
`runs` (`export`, `predict`); what they share (the usage error, the parser that raises it,
`--step | --best` and the restore of the run) is `common`.

Exit statuses: 0 done; 1 a full or read-only disk (one line naming the path); 2 a usage
error (one line); 3 a run stopped because its training loss stayed non-finite
(`isojax.training.stops`: no score is reported).
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Sequence

from isojax.cli import analyze, common, finetune, runs

# Each command: the function that adds its sub-parser (which sets `run`), and the optional
# modules (`isojax.errors.EXTRAS`) it needs, checked before it runs.
COMMANDS = {
    "finetune": (
        finetune.add_parser,
        ("ml_collections", "orbax.checkpoint", "tensorboardX", "tokenizers"),
    ),
    "analyze": (analyze.add_parser, ("ml_collections", "tokenizers", "transformers", "matplotlib")),
    "export": (
        runs.add_export_parser,
        ("ml_collections", "orbax.checkpoint", "transformers", "safetensors"),
    ),
    "predict": (
        runs.add_predict_parser,
        ("ml_collections", "orbax.checkpoint", "tokenizers", "transformers"),
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `isojax` console script; returns the exit status."""
    from isojax import errors, logs
    from isojax.data.tasks import GlueDataNotFound

    logs.install_log_handler()
    prog, args = common.PROG, None
    try:
        args = build_parser().parse_args(argv)
        errors.require(*COMMANDS[args.command][1])  # a missing extra: one line, status 2
        return args.run(args)
    except ImportError as err:  # an optional module imported deeper down: the same line
        if (missing := errors.extra_missing(err)) is None:
            raise
        print(f"{prog} {args.command}: error: {missing}", file=sys.stderr)
        return 2
    except common.UsageError as err:
        command = getattr(args, "command", None)
        print(f"{prog}{' ' + command if command else ''}: error: {err}", file=sys.stderr)
        return 2
    except (GlueDataNotFound, errors.InputError) as err:  # no data; a bad TSV, model, config
        print(f"{prog} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except OSError as err:  # a full or read-only disk: one line naming the path, status 1
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(f"{prog} {args.command}: error: {where}{err.strerror}", file=sys.stderr)
        return 1


def build_parser() -> common.Parser:
    """The `isojax` parser: one sub-parser per command of `COMMANDS`, each with its `run`."""
    parser = common.Parser(
        prog=common.PROG,
        description="Isotropy-aware fine-tuning of BERT encoders.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=common.Parser)
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
