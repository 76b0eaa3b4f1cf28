"""A run folder is one run's: its layout, the config stamps, the same-run check, the lock.

A run folder keeps the newest checkpoints in `checkpoints/` (`LATEST_DIR`) and, beside them,
the one with the best dev score so far in `best_checkpoint/` (`BEST_DIR`: the IsoBN
protocol's early stopping), with `config.json`, `metrics.jsonl` and `results.json`.

Each checkpoint's position JSON also holds the run's config (`config_stamp`: its fields and
their SHA-256), so that a restore compares the config it is asked to use with the one the state
was trained with (`check_stamp`), not with an editable `config.json`.

`check_same_run` refuses a config other than the one of what the folder holds (checkpoints,
the best one, `metrics.jsonl`, `results.json`), `check_not_model_folder` a folder that holds
a model (a foreign `config.json` or weights), and `hold_run_folder` a second process training
in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pathlib
import socket
from collections.abc import Iterator

from isojax import errors
from isojax.training import config as config_lib

LATEST_DIR = "checkpoints"  # the newest `keep_checkpoints` checkpoints of a run folder
BEST_DIR = "best_checkpoint"  # the checkpoint with the best dev score


# Fields a resumed run may change: they touch neither the train state nor the data order.
_RESUMABLE_CHANGES = {
    "data_dir", "tfds_data_dir", "eval_batch_size", "max_eval_examples", "checkpoint_every",
    "keep_checkpoints", "log_every", "progress", "tensorboard", "remat", "max_nonfinite_steps",
    "throughput", "peak_flops", "profile_steps",
}  # fmt: skip


class ConfigChanged(ValueError):
    """A checkpoint restored with a config that changes the run (one line naming the fields)."""


def _changed_fields(before: dict, now: dict) -> list[str]:
    """Flat keys whose values differ between two flattened configs, except `_RESUMABLE_CHANGES`
    and fields `before` lacks that `now` holds at their default (added by a newer isojax)."""
    defaults = config_lib.flatten(json.loads(config_lib.default_config().to_json()))
    missing = object()
    return sorted(
        key
        for key in before.keys() | now.keys()
        if key.split(".")[0] not in _RESUMABLE_CHANGES
        and before.get(key, missing) != now.get(key, missing)
        and not (key not in before and key in defaults and now.get(key) == defaults[key])
    )


def config_stamp(fields: dict) -> dict:
    """`{"config": {"sha256", "fields"}}`: the flattened config `fields` (JSON values,
    `specs.RunSpec.fields`) and the SHA-256 of those that change the run (all but
    `_RESUMABLE_CHANGES`), saved with each checkpoint."""
    run = {k: v for k, v in fields.items() if k.split(".")[0] not in _RESUMABLE_CHANGES}
    digest = hashlib.sha256(json.dumps(run, sort_keys=True).encode()).hexdigest()
    return {"config": {"sha256": digest, "fields": fields}}


def check_stamp(stamp: dict | None, fields: dict, where: str) -> bool:
    """Refuses (`ConfigChanged`) to restore the checkpoint `where` whose `config_stamp` differs
    from the flattened config `fields` (`specs.RunSpec.fields`) in a field that changes the
    run, naming each with both values. Returns False for a checkpoint saved without a stamp
    (isojax before stamps: nothing to compare), True when the config is the run's."""
    if stamp is None:
        return False
    if stamp["sha256"] == config_stamp(fields)["config"]["sha256"]:
        return True
    before, now = config_lib.translate(stamp["fields"]), fields  # renamed paths: new names
    changed = _changed_fields(before, now)
    if changed:
        missing = "(absent)"
        shown = "; ".join(
            f"{k}: {before.get(k, missing)!r} -> {now.get(k, missing)!r}" for k in changed[:8]
        )
        raise ConfigChanged(
            f"{where} was trained with another config ({shown}"
            + ("; ..." if len(changed) > 8 else "")
            + "): restore it with the config it was trained with (was config.json edited?)"
        )
    return True


def run_artefacts(workdir: pathlib.Path) -> list[str]:
    """What of a run `workdir` holds: `checkpoints/`, `best_checkpoint/`, a non-empty
    `metrics.jsonl`, `results.json`."""
    found = [f"{name}/" for name in (LATEST_DIR, BEST_DIR) if (workdir / name).is_dir()]
    metrics = workdir / "metrics.jsonl"
    found += ["metrics.jsonl"] if metrics.is_file() and metrics.stat().st_size else []
    return found + (["results.json"] if (workdir / "results.json").exists() else [])


def check_same_run(fields: dict, workdir: pathlib.Path) -> None:
    """Refuses (`ConfigChanged`) a `workdir` holding any run artefact (`run_artefacts`) of a
    run with another config than the flattened `fields` (`specs.RunSpec.fields`; its
    `config.json`), or holding some without a `config.json` (unless checkpoints, whose stamps
    `restore` compares); and (`ModelFolderRefused`) one that holds a model, whose
    `config.json` the run's would replace (`check_not_model_folder`)."""
    check_not_model_folder(workdir, "the run's config.json")
    found, saved = run_artefacts(workdir), workdir / "config.json"
    if not found:
        return
    if not saved.exists():
        if f"{LATEST_DIR}/" in found:
            return  # the checkpoints' own config stamps are compared on restore
        raise ConfigChanged(
            f"{workdir} holds a run ({', '.join(found)}) but no config.json to compare this "
            "config with: use a new workdir, or put the run's config.json back"
        )
    before = config_lib.translate(config_lib.flatten(json.loads(saved.read_text())))
    changed = _changed_fields(before, fields)
    if changed:
        raise ConfigChanged(
            f"{workdir} holds a run ({', '.join(found)}) with another config "
            f"({_differ(changed)}): resume with its config.json, or use a new workdir"
        )


def _differ(changed: list[str]) -> str:
    """ "a differs" / "a and b differ" / "a, b and c differ", a key left out when a changed
    key under it names it better (an empty `normalizer_kwargs` against `.iterations`)."""
    keys = [k for k in changed if not any(o.startswith(k + ".") for o in changed)]
    if len(keys) == 1:
        return f"{keys[0]} differs"
    return f"{', '.join(keys[:-1])} and {keys[-1]} differ"


# A model's weights, as transformers, Flax, TensorFlow and others save them.
WEIGHT_FILES = (
    "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.bin.index.json",
    "*.msgpack", "*.msgpack.index.json", "*.h5", "*.onnx", "*.gguf", "*.pt", "*.pth", "*.ckpt",
)  # fmt: skip


def is_run_config(saved: object) -> bool:
    """Whether a parsed `config.json` is an isojax run's: one with a task and a normaliser, or
    a method (an older run)."""
    return (
        isinstance(saved, dict) and "task" in saved and bool({"normalizer", "method"} & set(saved))
    )


def model_files(folder: pathlib.Path) -> list[str]:
    """What of a model `folder` holds (top level): a `config.json` that is not an isojax run's
    (`is_run_config`; unreadable counts as foreign), then its weight files (`WEIGHT_FILES`)."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return []
    found = sorted({p.name for pattern in WEIGHT_FILES for p in folder.glob(pattern)})
    config = folder / "config.json"
    if config.exists():
        try:
            saved = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            saved = None
        if not is_run_config(saved):
            found.insert(0, "config.json")
    return found


class ModelFolderRefused(errors.InputError):
    """A destination that holds a model: a foreign `config.json` or weights (one line)."""


def check_not_model_folder(folder: pathlib.Path, writer: str) -> None:
    """Refuses (`ModelFolderRefused`) a `folder` that holds a model (`model_files`), which
    `writer` (what would write there) could write over: nothing is written."""
    found = model_files(folder)
    if found:
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ModelFolderRefused(
            f"{folder} holds a model ({shown}), not an isojax run: {writer} would write over "
            "it; choose another folder"
        )


class RunFolderBusy(errors.InputError):
    """Another process trains in the run folder (one line naming it)."""


LOCK_FILE = ".isojax_lock"  # `hold_run_folder`'s lock, naming its holder


@contextlib.contextmanager
def hold_run_folder(workdir: pathlib.Path, lead: bool = True) -> Iterator[None]:
    """Holds an exclusive `fcntl.flock` on `workdir/LOCK_FILE` for the block (process 0 of a
    run; the kernel drops it when the holder exits or dies, so it is never stale), or raises
    `RunFolderBusy` naming the process that holds it."""
    if not lead:
        yield
        return
    path = workdir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: it names the holder
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise RunFolderBusy(
                f"{workdir} is in use by {holder}: wait for that run to end, or use another workdir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"isojax pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing drops the flock
