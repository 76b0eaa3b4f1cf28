"""Fine-tune one task with several methods and print their dev metric and isotropy side by side.

    python -m experiments.examples.compare --config experiments/configs/main_job.py \
        --methods none,isobn,istar --workdir runs/main_job

Each method runs `loop.train_and_evaluate(get_config(method), WORKDIR/method)`; a finished or
interrupted run is resumed from its checkpoints, so running the script again only redoes what is
missing. The first row is the pre-trained encoder on the same dev split (the runs' dev
evaluation at step 0; its dev metric is blank: the classifier head is untrained). "minutes" is
the wall time of the call that finished a run (a resumed run counts only its last part).
Isotropy columns: the dev sentence vectors the head reads (`config.sentence`: the pooler
output or [CLS]) before the normaliser, the classifier's input after it ("head": IsoBN's
output), and every layer's tokens ("tokens Iso", the quantity I-STAR's penalty moves).

It prints one progress line per row (the run's folder, its dev score, the minutes) and then the
table, also saved as WORKDIR/table.md; each row's numbers stay in JSON beside the run:
WORKDIR/pretrained.json, and each run's own results.json (with compare_minutes.json).
"""

import argparse
import json
import pathlib
import sys
import time

from isojax.data import tasks
from isojax.logs import install_log_handler
from isojax.training import config as config_lib
from isojax.training import configs, evaluation, loop


def pretrained_row(config) -> dict:
    """Isotropy of the pre-trained encoder on the dev split: the dev evaluation of the step-0
    state of `config` with method "none" (the same eval step and keys as the runs' rows; the
    untrained head's score is left out). The evaluation reads no training rows: setup encodes
    one batch of them (the state it builds needs a schedule length, unused at step 0)."""
    config = config.copy_and_resolve_references()
    config.normalizer, config.penalty = "none", "none"
    config.max_train_examples = config.batch_size
    run = loop.setup(config)
    split = tasks.get_task(config.task).dev_splits[0]
    result = evaluation.evaluate(run, run.state, run.dev_encoded[split])
    return {key: value for key, value in result.items() if key in ISOTROPY_KEYS}


COLUMNS = (
    ("dev", "score", "{:.4f}"),
    ("EV_1", "sentence_ev1", "{:.4f}"),
    ("EV_3", "sentence_ev3", "{:.4f}"),
    ("IsoScore", "sentence_isoscore", "{:.4f}"),
    ("mean cos", "sentence_mean_cosine", "{:.4f}"),
    ("head EV_3", "pre_logits_ev3", "{:.4f}"),
    ("head Iso", "pre_logits_isoscore", "{:.4f}"),
    ("head cos", "pre_logits_mean_cosine", "{:.4f}"),
    ("tokens Iso", "tokens_isoscore", "{:.4f}"),
    ("minutes", "minutes", "{:.1f}"),
)
ISOTROPY_KEYS = [key for _, key, _ in COLUMNS if key not in ("score", "minutes")]


def format_table(rows: dict[str, dict]) -> str:
    """Rows `{name: values}` as an aligned Markdown table (blank where a value is missing)."""
    header = "| run | " + " | ".join(name for name, _, _ in COLUMNS) + " |"
    lines = [header, "|---|" + "---:|" * len(COLUMNS)]
    for name, values in rows.items():
        cells = [fmt.format(values[key]) if key in values else "" for _, key, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    install_log_handler()  # the runs' progress and notices, as `isojax finetune` shows them
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], prog="python -m experiments.examples.compare"
    )
    parser.add_argument("--config", required=True, help="a configs/*.py file: get_config(method)")
    parser.add_argument(
        "--methods",
        default="none,isobn",
        help="comma-separated arms: a normaliser and/or a penalty (isobn, istar, isobn+istar)",
    )
    parser.add_argument("--workdir", default="runs/compare", help="one sub-folder per method")
    parser.add_argument("--no-pretrained", action="store_true", help="skip the pre-trained row")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir)
    methods = [m for m in args.methods.split(",") if m]
    runs = {method: configs.load(args.config, method) for method in methods}
    for config in runs.values():
        config_lib.validate_config(config)  # every run's config is checked before the first starts

    first = runs[methods[0]]
    split = tasks.get_task(first.task).dev_splits[0]
    rows = {}
    if not args.no_pretrained:
        start = time.perf_counter()
        rows["pre-trained"] = pretrained_row(first)
        rows["pre-trained"]["minutes"] = (time.perf_counter() - start) / 60
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "pretrained.json").write_text(json.dumps(rows["pre-trained"], indent=2) + "\n")
        print(
            f"pre-trained: evaluated in {rows['pre-trained']['minutes']:.1f} min "
            f"({workdir / 'pretrained.json'})",
            flush=True,
        )
    for method, config in runs.items():
        run_dir = workdir / method
        timing = run_dir / "compare_minutes.json"  # training time of the run that finished it
        start = time.perf_counter()
        print(f"== {method}: {run_dir}", flush=True)
        results = loop.train_and_evaluate(config, run_dir)
        if not timing.exists():
            timing.write_text(json.dumps((time.perf_counter() - start) / 60) + "\n")
        rows[method] = dict(results[split]) | {"minutes": json.loads(timing.read_text())}
        print(
            f"{method}: {split} score {rows[method]['score']:.4f} after "
            f"{rows[method]['minutes']:.1f} min ({run_dir / 'results.json'})",
            flush=True,
        )
    print()
    print(f"{first.task} {split}, {first.model}, sentence vector: {first.sentence}, "
          f"{first.num_epochs} epochs, max length {first.max_length}, batch {first.batch_size}, "
          f"seed {first.seed}")  # fmt: skip
    print(format_table(rows))
    (workdir / "table.md").write_text(format_table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
