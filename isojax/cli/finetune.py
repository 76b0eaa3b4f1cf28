"""`isojax finetune`: a run's configuration from `--config`, the flags and `--set`, then the run.

    isojax finetune --task rte --normalizer isobn --data-dir glue_data --workdir runs/rte-isobn
    isojax finetune --config istar --task rte --workdir runs/x --set istar.weight=-2
    isojax finetune --config experiments/configs/finetune.py:rte,istar --workdir runs/x \\
        --set optimizer.learning_rate=1e-5 --set istar.stabilizer.kind=ema

The configuration is built in this order, each step overriding the previous ones:
`isojax.training.config.default_config()`; `--config NAME[:ARG]`, a preset of
`isojax.training.configs` (`isobn`, `istar`: the papers' reference recipes) or a Python file's
`get_config(ARG)` (STYLE.md §21; fields it leaves out keep their defaults), read by
`isojax.training.configs.load`; the flags typed every time (`FINETUNE_FLAGS`); `--set
key.path=value`, for every other field. The result is checked by
`isojax.training.config.validate_config` before anything is loaded: an unknown task, normaliser
or penalty, or a hyperparameter out of range (zeta outside [0, 1], momentum outside (0, 1)), is
one line on stderr and exit status 2. So is a flag of the older command line (`--method`,
`--istar-zeta`, `--preset`, ...): the message names its replacement. Bad input found while the
run is built, before any training step, is one line too (`isojax.errors.InputError`): a
malformed TSV (file:line), a model folder without weights or with sizes out of bounds, a
`max_length` beyond the model's positions, a `batch_size` larger than the training data.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from typing import TYPE_CHECKING

from isojax.cli import common
from isojax.core.normalizers import NORMALIZERS
from isojax.core.penalties import PENALTIES

if TYPE_CHECKING:
    import ml_collections

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `finetune` sub-command and its flags, in `sub` (the `isojax` sub-parsers)."""
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


class _Removed(argparse.Action):
    """A flag of the older command line: refused with the spelling that replaced it."""

    def __call__(self, parser, namespace, values, option_string=None):
        raise common.UsageError(f"{option_string} was removed: use {REMOVED_FLAGS[option_string]}")


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
        print(f"{common.PROG} finetune: stopped: {stop}", file=sys.stderr)
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


def finetune_config(args: argparse.Namespace) -> ml_collections.ConfigDict:
    """The run's configuration from the parsed `finetune` arguments (not validated here:
    `train_and_evaluate` validates it once, as every run's; `--print-config` too)."""
    from isojax.training import config as config_lib
    from isojax.training import configs

    config = config_lib.default_config()
    if args.config:
        try:
            loaded = configs.load(args.config)
        except config_lib.ConfigError as err:
            raise common.UsageError(f"--config: {err}") from None
        for key, value in config_lib.flatten(loaded.to_dict()).items():
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
