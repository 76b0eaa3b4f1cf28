"""The `isojax` command: fine-tune, analyse isotropy, export and predict, run the benchmarks.

    isojax finetune --task rte --normalizer isobn --data-dir glue_data --workdir runs/rte-isobn
    isojax finetune --config istar --task rte --workdir runs/x --set istar.weight=-2
    isojax finetune --config experiments/configs/finetune.py:rte,istar --workdir runs/x \\
        --set optimizer.learning_rate=1e-5 --set istar.stabilizer.kind=ema
    isojax analyze --task rte --data-dir glue_data --out runs/analysis
    isojax analyze --run runs/rte-isobn --best --out runs/rte-isobn/analysis   # + head input
    isojax export runs/rte-isobn runs/hf/rte-isobn --best    # transformers folder + card
    isojax predict runs/rte-isobn --split dev         # predictions TSV, dev metrics
    isojax predict runs/rte-isobn --split test --glue-submission runs/submission/   # RTE.tsv
    isojax bench                      # lists experiments/bench/*.py (a source checkout)
    isojax bench data_speed [ARGS]    # runs one, printing its output

`finetune` builds its configuration in this order, each step overriding the previous ones:
`isojax.training.config.default_config()`; `--config NAME[:ARG]`, a preset of
`isojax.training.configs` (`isobn`, `istar`: the papers' reference recipes) or a Python file's
`get_config(ARG)` (STYLE.md §21; fields it leaves out keep their defaults); the flags typed
every time (`--task --normalizer --penalty --model --front-end --data-dir --seed`); `--set
key.path=value`, for every other field. The result is checked by
`isojax.training.config.validate_config` before anything is loaded: an unknown task, normaliser
or penalty, or a hyperparameter out of range (zeta outside [0, 1], momentum outside (0, 1)), is
one line on stderr and exit status 2. So is a flag of the older command line (`--method`,
`--istar-zeta`, `--preset`, ...): the message names its replacement. Bad input found while the
run is built, before any training step, is one line too (`isojax.errors.InputError`): a
malformed TSV (file:line), a model folder without weights or with sizes out of bounds, a
`max_length` beyond the model's positions, a `batch_size` larger than the training data.

Exit statuses: 0 done; 1 a full or read-only disk (one line naming the path); 2 a usage
error (one line); 3 a run stopped because its training loss stayed non-finite
(`isojax.training.stops`: no score is reported).

`analyze` is its own module, `isojax.cli.analyze`; what the commands share (the usage error,
the parser that raises it, `--step | --best` and the restore of the run) is `isojax.cli.common`.
"""

from __future__ import annotations

import argparse
import ast
import errno
import importlib.util
import pathlib
import subprocess
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from isojax.cli import analyze, common
from isojax.core.normalizers import NORMALIZERS
from isojax.core.penalties import PENALTIES

if TYPE_CHECKING:
    import ml_collections

PROG = "isojax"
BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "bench"

# The flags of `finetune` besides --config/--set: (flag, config key, type, help).
FINETUNE_FLAGS = (
    ("--task", "task", str, "GLUE task: cola sst2 mrpc stsb qqp mnli qnli rte"),
    ("--normalizer", "normalizer", str, "the head's normaliser: " + " ".join(NORMALIZERS)),
    ("--penalty", "penalty", str, "a token loss term: " + " ".join(PENALTIES)),
    ("--model", "model", str, "model folder, weights package, or tiny-bert (tests)"),
    ("--front-end", "front_end", str, "the classifier's modules: linen (default) or nnx"),
    ("--data-dir", "data_dir", str, "glue_data folder (<TASK>/{train,dev}.tsv); unset: tfds"),
    ("--seed", "seed", int, "random seed"),
)
# Flags of the older command line -> what to type instead.
REMOVED_FLAGS = {
    "--method": "--normalizer NAME (the head's) and --penalty NAME (istar, cosreg): two fields now",
    "--preset": "--config isobn or --config istar",
    "--tokenizer": "--set tokenizer=PATH",
    "--sentence": "--set sentence=pooled|cls",
    "--tfds-data-dir": "--set tfds_data_dir=PATH",
    "--isobn-momentum": "--set isobn.momentum=VALUE",
    "--isobn-beta": "--set isobn.beta=VALUE",
    "--isobn-epsilon": "--set isobn.epsilon=VALUE",
    "--istar-weight": "--set istar.weight=VALUE",
    "--istar-zeta": "--set istar.zeta=VALUE",
    "--cosreg-weight": "--set cosreg.weight=VALUE",
    "--learning-rate": "--set optimizer.learning_rate=VALUE",
    "--batch-size": "--set batch_size=N",
    "--eval-batch-size": "--set eval_batch_size=N",
    "--max-length": "--set max_length=N",
    "--epochs": "--set num_epochs=N",
    "--max-steps": "--set max_steps=N",
    "--max-train-examples": "--set max_train_examples=N",
    "--max-eval-examples": "--set max_eval_examples=N",
    "--policy": "--set policy=p=f32,c=bf16,o=f32",
}


class _Removed(argparse.Action):
    """A flag of the older command line: refused with the spelling that replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise common.UsageError(f"{option_string} was removed: use {REMOVED_FLAGS[option_string]}")


# ----------------------------------------------------------------------------------------------
# Configuration: --config, flags, --set.
# ----------------------------------------------------------------------------------------------


def load_config(spec: str) -> ml_collections.ConfigDict:
    """`NAME[:ARG]` -> `get_config(ARG)` of the preset NAME of `isojax.training.configs`, or of the
    Python
    file NAME (ARG None when absent)."""
    import ml_collections

    from isojax.training import configs

    path, _, arg = spec.partition(":")
    if path in configs.PRESETS:
        return configs.load(path, arg or None)
    file = pathlib.Path(path)
    if not file.is_file():
        raise common.UsageError(
            f"--config: {path!r} is neither a preset ({', '.join(configs.PRESETS)}) nor a file"
        )
    module_spec = importlib.util.spec_from_file_location(f"_isojax_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise common.UsageError(f"--config: {path} defines no get_config(arg)")
    config = module.get_config(arg or None)
    if not isinstance(config, ml_collections.ConfigDict):
        raise common.UsageError(f"--config: {path}: get_config returned {type(config).__name__}")
    return config


def set_value(config: ml_collections.ConfigDict, key: str, value, source: str) -> None:
    """`config[key.path] = value`, type-checked by ConfigDict; errors name the key (and the
    new spelling of a renamed one). A key under an open field (`config.OPEN_FIELDS`:
    `normalizer_kwargs.epsilon`) may be new: `validate_config` checks it with its owner."""
    import ml_collections

    from isojax.training.config import OPEN_FIELDS, RENAMED

    if key in RENAMED:
        raise common.UsageError(f"{source}: config field {key!r} was renamed: use {RENAMED[key]}")
    *parents, leaf = key.split(".")
    node = config
    for i, part in enumerate(parents):
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise common.UsageError(
                f"{source}: unknown config field {'.'.join(parents[: i + 1])!r}"
            )
        node = node[part]
    if leaf not in node and ".".join(parents) not in OPEN_FIELDS:  # open: keys are free
        raise common.UsageError(f"{source}: unknown config field {key!r}")
    try:
        node[leaf] = value
    except (TypeError, ValueError) as err:
        raise common.UsageError(f"{source}: {key}={value!r}: {err}") from None


def parse_value(text: str):
    """A `--set` value: a Python literal (1e-5, 8, (32, 64), None), true/false, else a string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def finetune_config(args: argparse.Namespace) -> ml_collections.ConfigDict:
    """The run's configuration from the parsed `finetune` arguments (not validated here:
    `train_and_evaluate` validates it once, as every run's; `--print-config` too)."""
    from isojax.training import config as config_lib

    config = config_lib.default_config()
    if args.config:
        for key, value in config_lib.flatten(load_config(args.config).to_dict()).items():
            set_value(config, key, value, f"--config {args.config}")
    for flag, key, _, _ in FINETUNE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            set_value(config, key, value, flag)
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep:
            raise common.UsageError(f"--set {item!r}: expected key.path=value")
        set_value(config, key.strip(), parse_value(text), "--set")
    return config


# ----------------------------------------------------------------------------------------------
# Subcommands.
# ----------------------------------------------------------------------------------------------


def format_results(results: dict) -> str:
    """One line per dev split: the task metrics, then the isotropy keys; then the best dev
    epoch (its checkpoint is the run's `best_checkpoint/`)."""
    lines = [f"step {results.get('step')}  epoch {results.get('epoch')}"]
    for split, values in results.items():
        if isinstance(values, dict) and split != "best":
            cells = "  ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, float))
            lines.append(f"{split}: {cells}")
    best = results.get("best")
    if best:
        scores = "  ".join(
            f"{k} score {v['score']:.4f}" for k, v in best.items() if isinstance(v, dict)
        )
        lines.append(f"best: step {best['step']}  epoch {best['epoch']}  {scores}")
    return "\n".join(lines)


def format_metrics(task, values: dict) -> str:
    """`metric value` for the task's metrics and its GLUE score."""
    return "  ".join(f"{name} {values[name]:.4f}" for name in (*task.metrics, "score"))


def cmd_finetune(args: argparse.Namespace) -> int:
    config = finetune_config(args)
    from isojax.training import build, checkpointing, loop, run_folder, stops, throughput
    from isojax.training import config as config_lib

    if args.print_config:
        config_lib.validate_config(config)
        print(config.to_json(indent=2))
        return 0

    try:
        results = loop.train_and_evaluate(config, args.workdir)
    except (stops.NonFiniteLoss, stops.NormalizerStalled) as stop:  # no score: status 3
        print(f"{PROG} finetune: stopped: {stop}", file=sys.stderr)
        return stops.EXIT_STATUS
    # The compiled step's memory (DoesNotFit) too: one line, status 2.
    except (
        build.VocabularyMismatch,
        run_folder.ConfigChanged,
        throughput.DoesNotFit,
        checkpointing.CheckpointMismatch,  # a checkpoint of other arrays, or an edited position
    ) as err:
        raise common.UsageError(str(err)) from None
    print(format_results(results))
    print(f"results: {pathlib.Path(args.workdir) / 'results.json'}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from isojax.runs import export

    try:  # before the restore: a refused folder costs nothing
        export.check_destination(args.out, overwrite=args.overwrite)
    except export.DestinationRefused as err:
        raise common.UsageError(str(err)) from None
    restored = common.restore_run(args)
    exported = export.export_run(
        restored, args.out, data_dir=args.data_dir, overwrite=args.overwrite
    )
    where = f"{args.run_dir} ({restored.checkpoint} checkpoint, step {restored.step})"
    if exported.encoder_only is None:
        print(f"exported {where} to {args.out} as {exported.architecture}")
    else:
        print(
            f"exported {where} to {args.out} as {exported.architecture}, the encoder alone "
            f"(no classifier head): {exported.encoder_only}"
        )
    for split in restored.task.dev_splits:
        print(f"{split}: {format_metrics(restored.task, exported.evaluation[split])}")
    return 0


def _predictions_path(args: argparse.Namespace, split: str, several: bool) -> pathlib.Path:
    if args.out is None:
        return pathlib.Path(args.run_dir) / f"predictions_{split}.tsv"
    out = pathlib.Path(args.out)
    return out.with_name(f"{out.stem}_{split}{out.suffix}") if several else out


def cmd_predict(args: argparse.Namespace) -> int:
    from isojax.runs import predict

    # Before the restore: a destination of the wrong kind costs nothing.
    for flag, check, path in (
        ("--out", predict.check_file, args.out),
        ("--glue-submission", predict.check_folder, args.glue_submission),
    ):
        try:
            if path:
                check(path)
        except predict.OutputRefused as err:
            raise common.UsageError(f"{flag}: {err}") from None
    restored = common.restore_run(args)
    task = restored.task
    try:
        splits = predict.splits_of(task, args.split)
    except ValueError as err:
        raise common.UsageError(str(err)) from None
    if args.glue_submission and not set(splits) <= set(task.test_splits):
        raise common.UsageError("--glue-submission writes test-set predictions: use --split test")
    for split in splits:
        try:
            pred = predict.predict(restored, split, data_dir=args.data_dir, labelled=args.metrics)
        except ValueError as err:  # a test split asked for labels (glue names the file)
            raise common.UsageError(str(err)) from None
        path = predict.write_predictions(pred, _predictions_path(args, split, len(splits) > 1))
        print(f"{task.name} {split}: {len(pred.idx)} predictions -> {path}")
        if pred.metrics is not None:
            print(f"{split}: {format_metrics(task, pred.metrics)}")
        if args.glue_submission:
            print(f"GLUE submission: {predict.write_submission(pred, args.glue_submission)}")
    return 0


def list_benchmarks() -> dict[str, str]:
    """`{name: the first paragraph of its docstring, on one line}` of the scripts in
    experiments/bench/ (whole sentences, however many lines they take there)."""
    out = {}
    for path in sorted(BENCH_DIR.glob("*.py")):
        if path.name.startswith("_"):
            continue
        doc = ""
        try:
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        except SyntaxError:
            pass
        out[path.stem] = " ".join(doc.strip().split("\n\n")[0].split())
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    if not BENCH_DIR.is_dir():
        raise common.UsageError(
            f"the benchmarks are scripts in a source checkout's experiments/bench/, which an "
            f"installed isojax does not include (looked in {BENCH_DIR}): run `isojax bench` "
            "from a clone of the repository with it on PYTHONPATH"
        )
    available = list_benchmarks()
    if not args.name:
        width = max((len(name) for name in available), default=0)
        for name, doc in available.items():
            print(f"{name:<{width}}  {doc}")
        return 0
    name = args.name.removesuffix(".py")
    if name not in available:
        raise common.UsageError(f"unknown benchmark {args.name!r}; known: {', '.join(available)}")
    sys.stdout.flush()
    return subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"), *args.args]).returncode


# ----------------------------------------------------------------------------------------------
# Parser and entry point.
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The `isojax` parser: one sub-parser per command, each with its `run` function."""
    parser = common.Parser(
        prog=PROG, description="Isotropy-aware fine-tuning of BERT encoders.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=common.Parser)
    _add_finetune(sub)
    analyze.add_parser(sub)
    _add_export(sub)
    _add_predict(sub)
    _add_bench(sub)
    return parser


def _add_finetune(sub: argparse._SubParsersAction) -> None:
    ft = sub.add_parser(
        "finetune", help="fine-tune on a GLUE task, evaluating each epoch", allow_abbrev=False
    )
    ft.add_argument("--workdir", required=True, help="run folder (resumed if it has checkpoints)")
    ft.add_argument(
        "--config", help="NAME[:ARG]: a preset (isobn, istar) or a Python file with get_config"
    )
    for flag, key, kind, text in FINETUNE_FLAGS:
        ft.add_argument(flag, type=kind, default=None, help=f"{text} [{key}]")
    for flag in REMOVED_FLAGS:
        ft.add_argument(flag, action=_Removed, nargs="?", help=argparse.SUPPRESS)
    ft.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any config field"
    )
    ft.add_argument("--print-config", action="store_true", help="print the config and exit")
    ft.set_defaults(run=cmd_finetune)


def _add_export(sub: argparse._SubParsersAction) -> None:
    ex = sub.add_parser("export", help="a run's model as a Hugging Face folder with a model card")
    ex.add_argument("run_dir", help="run folder (isojax finetune --workdir)")
    ex.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer)")
    ex.add_argument("--data-dir", help="glue_data folder, for a checkpoint without dev results")
    ex.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in OUT (never a run folder)",
    )
    common.add_checkpoint_choice(ex)
    ex.set_defaults(run=cmd_export)


def _add_predict(sub: argparse._SubParsersAction) -> None:
    pr = sub.add_parser("predict", help="a run's predictions on dev or test; GLUE submission")
    pr.add_argument("run_dir", help="run folder (isojax finetune --workdir)")
    pr.add_argument("--split", required=True, help="dev | test | a split name of the task")
    pr.add_argument("--data-dir", help="glue_data folder (default: the run's data)")
    pr.add_argument("--out", help="predictions TSV (default RUN_DIR/predictions_SPLIT.tsv)")
    pr.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="print the task metrics (default: for dev splits; test splits have no labels)",
    )
    pr.add_argument("--glue-submission", metavar="DIR", help="write GLUE's <TASK>.tsv in DIR")
    common.add_checkpoint_choice(pr)
    pr.set_defaults(run=cmd_predict)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    be = sub.add_parser("bench", help="run a benchmark of experiments/bench (list: no name)")
    be.add_argument("name", nargs="?", help="benchmark name (file stem)")
    be.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    be.set_defaults(run=cmd_bench)


# The optional modules (`isojax.errors.EXTRAS`) each sub-command needs, checked before it runs.
NEEDS = {
    "finetune": ("ml_collections", "orbax.checkpoint", "tensorboardX", "tokenizers"),
    "analyze": ("ml_collections", "tokenizers", "transformers", "matplotlib"),
    "export": ("ml_collections", "orbax.checkpoint", "transformers", "safetensors"),
    "predict": ("ml_collections", "orbax.checkpoint", "tokenizers", "transformers"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `isojax` console script; returns the exit status."""
    from isojax import errors
    from isojax.data.tasks import GlueDataNotFound

    common.install_log_handler()
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        errors.require(*NEEDS.get(args.command, ()))  # a missing extra: one line, status 2
        return args.run(args)
    except ImportError as err:  # an optional module imported deeper down: the same line
        if (missing := errors.extra_missing(err)) is None:
            raise
        print(f"{PROG} {args.command}: error: {missing}", file=sys.stderr)
        return 2
    except common.UsageError as err:
        command = getattr(args, "command", None)
        print(f"{PROG}{' ' + command if command else ''}: error: {err}", file=sys.stderr)
        return 2
    except GlueDataNotFound as err:  # no glue_data folder and no usable tfds copy: one line
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except errors.InputError as err:  # a malformed TSV, model folder or config: one line
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except OSError as err:  # a full or read-only disk: one line naming the path, status 1
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        where = f"{err.filename}: " if err.filename else ""
        print(f"{PROG} {args.command}: error: {where}{err.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
