"""A run folder to a Hugging Face folder that transformers serves, with a model card.

    restored = runs.restore("runs/rte-isobn", best=True)
    exported = export.export_run(restored, "hf/rte-isobn")
    # transformers.AutoModelForSequenceClassification.from_pretrained("hf/rte-isobn")

The folder holds `config.json` (with the task's `id2label`/`label2id`), `model.safetensors`,
the tokenizer files and a `README.md` model card: base model, task, normaliser, penalty and their
hyper-parameters, recipe, seed, the checkpoint, its dev metrics and the isotropy of the dev
sentence vectors, and the isojax version. `isojax.linen.export_pretrained` writes the weights: a
normaliser that is affine at inference (IsoBN, batch norm, re-centring) is folded into the
classifier; a head transformers' classes cannot compute (layer norm, raw [CLS]) leaves the
encoder alone, and `Exported.encoder_only` says why.

The destination (`check_destination`) must be absent or an empty folder; `overwrite=True` also
takes a folder holding an earlier export (plain files beside a Hugging Face `config.json`). A
run folder is refused either way (its `config.json` would be replaced), and so is any folder
holding a sub-folder. The export is written into a temporary sibling folder and renamed into
place, so an overwrite leaves no stale file of the earlier export (a `pytorch_model.bin` beside
the new `model.safetensors`), and a failed export leaves the destination as it was.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from typing import NamedTuple

import isojax
from isojax import logs, runs
from isojax.linen import pretrained as linen_pretrained
from isojax.models import hf_import
from isojax.runs import predict
from isojax.training import run_folder, specs

ISOTROPY_ROWS = (
    ("sentence", "sentence vector (the head's input)"),
    ("pre_logits", "after the normaliser (the classifier's input)"),
)


EXPORT_MARK = "Exported by isojax"  # in the model card: the folder is an earlier export


class DestinationRefused(ValueError):
    """The export's folder is a run folder, a file, or not empty (one-line message)."""


def check_destination(folder: str | pathlib.Path, *, overwrite: bool = False) -> None:
    """Raises `DestinationRefused` unless `folder` is absent, an empty folder, or (with
    `overwrite`) an earlier export: only plain files, one of them a Hugging Face
    `config.json` (with "architectures"). A run folder (`runs.is_run_folder`) is never
    taken, nor a folder among a run's own files (`runs.run_owning`: under its checkpoints) or
    under a file, nor a model folder that no isojax export wrote (`run_folder.model_files`: a
    foreign `config.json` or weights, and no model card of an export: `ModelFolderRefused`,
    even with `overwrite`)."""
    folder = pathlib.Path(folder)
    parent = next(p for p in folder.absolute().parents if p.exists())
    if not (folder.exists() or parent.is_dir()):
        raise DestinationRefused(f"{folder}: {parent} is a file, not a folder")
    run = runs.run_owning(folder)
    if run is not None:
        raise DestinationRefused(
            f"{folder} is among the run folder {run}'s own files: choose a folder outside them"
        )
    if not folder.exists():
        return
    if not folder.is_dir():
        raise DestinationRefused(f"{folder} is a file: export writes a folder")
    if runs.is_run_folder(folder):
        raise DestinationRefused(
            f"{folder} is a run folder: an export there would replace its config.json; "
            "choose another folder (--overwrite never replaces a run)"
        )
    entries = sorted(folder.iterdir())
    if not entries:
        return
    card = folder / "README.md"
    exported = card.is_file() and EXPORT_MARK in card.read_text(encoding="utf-8", errors="replace")
    if not exported:  # a model folder (`--model`'s, a download): never written over
        run_folder.check_not_model_folder(folder, "an export")
    if not overwrite:
        raise DestinationRefused(
            f"{folder} is not empty: choose an empty or new folder, or --overwrite to replace "
            "an earlier export there"
        )
    folders = [p.name for p in entries if p.is_dir()]
    if folders:
        raise DestinationRefused(
            f"{folder} holds the folder {folders[0]!r}: --overwrite replaces only an earlier "
            "export (plain files); choose another folder"
        )
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        hf = None
    if not (isinstance(hf, dict) and "architectures" in hf):
        raise DestinationRefused(
            f"{folder} holds no Hugging Face config.json: --overwrite replaces only an earlier "
            "export; choose another folder"
        )


class Exported(NamedTuple):
    """What `export_run` wrote: the folder, the transformers class, why the head was left out
    (None when it was exported), and the dev evaluation the card reports."""

    folder: pathlib.Path
    architecture: str
    encoder_only: str | None
    evaluation: dict


def hf_tokenizer(spec: specs.ModelSpec):
    """The run's tokenizer as a transformers tokenizer (which saves in HF's layout)."""
    folder = hf_import.resolve_folder(spec.tokenizer or spec.model)
    tokenizer = hf_import.load_tokenizer(folder)
    if tokenizer is None:
        raise runs.RunNotRestorable(f"{folder}: no tokenizer files to export")
    return tokenizer


def dev_evaluation(restored: runs.Restored, data_dir: str | None = None) -> dict:
    """The run's own dev evaluation of this checkpoint, or (for a checkpoint taken between
    evaluations) the same evaluation now: `{"step", "epoch", split: {metrics, isotropy}}`."""
    if restored.evaluation is not None:
        return restored.evaluation
    out = {"step": restored.step, "epoch": restored.position.get("epoch")}
    for split in restored.task.dev_splits:
        out[split] = predict.predict(restored, split, data_dir=data_dir).metrics
    return out


def export_run(
    restored: runs.Restored,
    folder: str | pathlib.Path,
    *,
    data_dir: str | None = None,
    overwrite: bool = False,
) -> Exported:
    """Writes the Hugging Face folder and its model card; returns what was written.

    `data_dir` is read only when the checkpoint has no evaluation of its own (one saved
    between epochs by `checkpoint_every`). `overwrite`: replace an earlier export in `folder`
    (`check_destination`, which raises `DestinationRefused` for what it refuses)."""
    folder = pathlib.Path(folder)
    check_destination(folder, overwrite=overwrite)
    evaluation = dev_evaluation(restored, data_dir)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.export-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        exported = _write(restored, tmp, evaluation)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = folder.parent / f".{folder.name}.export-old-{os.getpid()}"
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)  # an earlier export (or an empty folder), checked above
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return exported._replace(folder=folder)


def _write(restored: runs.Restored, folder: pathlib.Path, evaluation: dict) -> Exported:
    """The export itself, into `folder` (created)."""
    task = restored.task
    module, variables = restored.linen_twin()  # NNX: its linen twin, the same weights
    # The reason, said once by the caller (`isojax export` prints it): not logged again.
    encoder_only = linen_pretrained.encoder_only_reason(module, variables)
    with logs.quieted(linen_pretrained.__name__, logging.ERROR):
        linen_pretrained.export_pretrained(
            folder,
            module,
            variables,
            tokenizer=hf_tokenizer(restored.spec.model),
            label_names=None if task.is_regression else task.label_names,
        )
    architecture = json.loads((folder / "config.json").read_text())["architectures"][0]
    card = model_card(restored, evaluation, architecture, encoder_only)
    (folder / "README.md").write_text(card)
    return Exported(folder, architecture, encoder_only, evaluation)


def penalty_hparams(spec: specs.ObjectiveSpec) -> dict:
    """The hyper-parameters of the run's token penalty (empty for "none")."""
    common = {"weight": spec.weight}
    if spec.penalty == "istar":
        c0 = spec.istar.stabilizer
        kind = c0.kind
        return common | {
            "zeta": spec.istar.zeta,
            "include_padding": spec.include_padding,
            "stabilizer": kind,
            **({"tokens": c0.tokens} if kind == "pass" else {}),
            **({"window": c0.window, "unit": c0.unit} if kind == "epoch" else {}),
            **({"momentum": c0.momentum, "debias": c0.debias} if kind == "ema" else {}),
        }
    if spec.penalty == "cosreg":
        return common | {"include_padding": spec.include_padding}
    return {}


def _hparams_text(hparams: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in hparams.items()) or "defaults"


def _recipe(spec: specs.RunSpec) -> str:
    opt, data, loop = spec.state.optim, spec.data, spec.loop
    length = f"{loop.num_epochs} epochs" + (
        f" (stopped at step {loop.max_steps})" if loop.max_steps else ""
    )
    return (
        f"AdamW lr {opt.learning_rate:g} ({opt.schedule}, warm-up {opt.warmup_fraction:g}), "
        f"weight decay {opt.weight_decay:g}, betas ({opt.b1:g}, {opt.b2:g}), eps "
        f"{opt.adam_eps:g}, gradient clipping {opt.clip_norm}; batch {spec.feed.batch_size}, "
        f"max length {data.max_length}, {length}; precision `{spec.state.policy}`"
        + (f"; first {data.max_train_examples} training rows" if data.max_train_examples else "")
    )


def _head(restored: runs.Restored, architecture: str, encoder_only: str | None) -> str:
    module = restored.model
    head = (
        f"{module.sentence} sentence vector -> {module.normalizer} -> dropout "
        f"{module.dropout_rate:g} -> linear"
    )
    if encoder_only is not None:
        return f"{head}; exported as `{architecture}`, the encoder alone: {encoder_only}"
    folded = "" if module.normalizer == "none" else " (the normaliser folded into the classifier)"
    return f"{head}; exported as `{architecture}`{folded}"


def _split_section(task, split: str, evaluation: dict) -> list[str]:
    """The model card's section of one dev split: its metrics and the isotropy tables."""
    values, names = evaluation[split], [*task.metrics, "score"]
    return [
        f"## {task.folder} {split} (step {evaluation['step']})",
        "",
        "| " + " | ".join(names) + " |",
        "|" + "---:|" * len(names),
        "| " + " | ".join(f"{values[name]:.4f}" for name in names) + " |",
        "",
        "Isotropy of the dev sentence vectors (EV_k: variance share of the top k principal "
        "axes; IsoScore 1 is isotropic):",
        "",
        "| vectors | EV_1 | EV_3 | IsoScore |",
        "|---|---:|---:|---:|",
        *(
            f"| {label} | {values[f'{key}_ev1']:.4f} | {values[f'{key}_ev3']:.4f} | "
            f"{values[f'{key}_isoscore']:.4f} |"
            for key, label in ISOTROPY_ROWS
        ),
        "",
        f"Mean cosine of the sentence vectors {values['sentence_mean_cosine']:.4f}; "
        f"IsoScore of every layer's tokens {values['tokens_isoscore']:.4f}.",
        "",
    ]


def model_card(
    restored: runs.Restored, evaluation: dict, architecture: str, encoder_only: str | None
) -> str:
    """The README.md of the exported folder (Hugging Face model card, YAML front matter)."""
    spec, task = restored.spec, restored.task
    model, objective = spec.model, spec.state.objective
    labels = (
        "regression, a similarity score in [0, 5]"
        if task.is_regression
        else ", ".join(f"{i} = {name}" for i, name in enumerate(task.label_names))
    )
    method = "+".join(m for m in (model.normalizer, objective.penalty) if m != "none") or "none"
    tags = ["isojax", "glue", f"glue-{task.name}", *method.split("+")]
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-classification",
        "tags:",
        *(f"- {tag}" for tag in tags),
        "---",
        "",
        f"# {model.model} fine-tuned on GLUE {task.folder} with isojax ({method})",
        "",
        f"{EXPORT_MARK} {isojax.__version__} from the run `{restored.run_dir}`, "
        f"{restored.checkpoint} checkpoint (step {restored.step}, "
        f"epoch {evaluation.get('epoch')}).",
        "",
        "| | |",
        "|---|---|",
        f"| base model | `{model.model}`"
        + (f" (tokenizer `{model.tokenizer}`)" if model.tokenizer else "")
        + " |",
        f"| task | GLUE {task.folder}: {labels} |",
        f"| normalizer | `{model.normalizer}`: {_hparams_text(model.normalizer_kwargs)} |",
        f"| penalty | `{objective.penalty}`: {_hparams_text(penalty_hparams(objective))} |",
        f"| head | {_head(restored, architecture, encoder_only)} |",
        f"| recipe | {_recipe(spec)} |",
        f"| seed | {spec.state.seed} |",
        f"| isojax | {isojax.__version__} |",
        "",
    ]
    for split in task.dev_splits:
        lines += _split_section(task, split, evaluation)
    auto = "AutoModel" if encoder_only is not None else "AutoModelForSequenceClassification"
    lines += [
        "## Use",
        "",
        "```python",
        f"from transformers import {auto}, AutoTokenizer",
        "",
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        f'model = {auto}.from_pretrained("PATH")',
        "```",
        "",
    ]
    return "\n".join(lines)
