"""`isojax export` and `isojax predict`: what a finished run's checkpoint gives.

    isojax export runs/rte-isobn runs/hf/rte-isobn --best    # transformers folder + card
    isojax predict runs/rte-isobn --split dev         # predictions TSV, dev metrics
    isojax predict runs/rte-isobn --split test --glue-submission runs/submission/   # RTE.tsv

Both restore the run's checkpoint (the newest, `--step N` or `--best`: `common.restore_run`)
and check their destinations first, so a refused one costs nothing (`isojax.runs.export`,
`isojax.runs.predict`).
"""

from __future__ import annotations

import argparse
import pathlib

from isojax.cli import common


def add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The `export` sub-command and its flags, in `sub` (the `isojax` sub-parsers)."""
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


def add_predict_parser(sub: argparse._SubParsersAction) -> None:
    """The `predict` sub-command and its flags, in `sub` (the `isojax` sub-parsers)."""
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


def _predictions_path(args: argparse.Namespace, split: str, several: bool) -> pathlib.Path:
    if args.out is None:
        return pathlib.Path(args.run_dir) / f"predictions_{split}.tsv"
    out = pathlib.Path(args.out)
    return out.with_name(f"{out.stem}_{split}{out.suffix}") if several else out


def format_metrics(task, values: dict) -> str:
    """`metric value` for the task's metrics and its GLUE score."""
    return "  ".join(f"{name} {values[name]:.4f}" for name in (*task.metrics, "score"))
