"""Time estimates of a study's cells (`runner.py`'s plan, progress lines and dry run).

A cell's minutes are its epochs times the minutes per epoch measured on earlier cells of the
same task (and method, and device, where there are such), of the same model and shape; before
any is measured, the recipe's prior (`study_recipe.EPOCH_MINUTES_PRIOR`, timed on MiniLM-L6)
applies to cells of the recipe's shape only, and the time of any other cell (a tiny test grid,
another model) is unknown rather than a wrong guess (issue 26, item 8).
"""

from __future__ import annotations

import json
import statistics

PRETRAINED = "pretrained"


SHAPE_FIELDS = ("model", "max_length", "batch_size", "packing", "max_train_examples")


def _shape(config) -> tuple:
    """What an epoch's time depends on besides task, method and device (`SHAPE_FIELDS`)."""
    return tuple(json.dumps(config.get(k), sort_keys=True) for k in SHAPE_FIELDS)


def epoch_minutes(
    records: list[dict], task: str, method: str, recipe, device: str = "", config=None
) -> float | None:
    """Measured minutes per epoch (a run's wall minutes over its evaluated epochs): the median
    over ok runs on `device` of (task, method), else of the task; else the same on any device;
    else `study_recipe.EPOCH_MINUTES_PRIOR`. Given the cell's `config`, only runs of the same
    model, sequence length, batch, packing and training rows count (`SHAPE_FIELDS`), and the
    prior (measured on the recipe's MiniLM-L6) applies only to a config of the recipe's shape;
    None (unknown) otherwise."""

    def per_epoch(rows):
        out = []
        for r in rows:
            epochs = max([e["epoch"] for e in r["eval"]] + [0])
            if r["status"] == "ok" and r["kind"] == "run" and r["wall_minutes"] > 0 and epochs:
                out.append(r["wall_minutes"] / epochs)
        return out

    same_task = [r for r in records if r["fields"]["task"] == task]
    if config is not None:
        shape = _shape(config)
        same_task = [r for r in same_task if "config" in r and _shape(r["config"]) == shape]
    here = [r for r in same_task if r.get("device") == device]
    for pool in (here, same_task):
        for rows in ([r for r in pool if r["fields"]["method"] == method], pool):
            measured = per_epoch(rows)
            if measured:
                return statistics.median(measured)
    if config is not None and _shape(config) != _shape(recipe.base_config()):
        return None
    return recipe.EPOCH_MINUTES_PRIOR.get(task, max(recipe.EPOCH_MINUTES_PRIOR.values()))


def estimate_minutes(
    values: dict, config, records: list[dict], recipe, done_epochs: int, device: str = ""
) -> float | None:
    """Minutes left for the cell of field `values`: epochs x `epoch_minutes` (None: unknown),
    less the `done_epochs` a resumed folder has (its last evaluated epoch); a step-0
    evaluation counts as 1/10 epoch."""
    task, method = values["task"], values["method"]
    minutes = epoch_minutes(records, task, method, recipe, device, config)
    if minutes is None:
        return None
    if method == PRETRAINED:
        return 0.1 * minutes
    return max(0, recipe.get_field(config, "num_epochs") - done_epochs) * minutes


def clock(minutes: float) -> str:
    return f"{int(minutes // 60)}h{int(minutes % 60):02d}m"


def eta(estimates: list[float | None], explain: bool = False) -> str:
    """`1h02m`; `1h02m + 3 cells of unknown time`; `unknown` when none is known (with
    `explain`: and why)."""
    known = [m for m in estimates if m is not None]
    unknown = len(estimates) - len(known)
    if estimates and not known:
        return "unknown" + (" (no measured epoch of this model and shape yet)" if explain else "")
    return clock(sum(known)) + (f" + {unknown} cells of unknown time" if unknown else "")
