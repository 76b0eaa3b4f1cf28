"""A study's grid file and the cells it defines: names, tiers, configs and config hashes.

A grid file (`experiments/configs/study_*.py`) has `get_config(arg)` returning a ConfigDict:
`name`, `base` (the shared recipe), `tiers` (`{"1": blocks, ...}`, each block `{field:
[values]}` whose Cartesian product, in the block's key order, gives cells), `pretrained`,
`baseline` and `sweep` (see `runner`). A cell is named `task-method[-field=value...]-s<seed>`
(`cell_name`), e.g. `stsb-istar-istar.weight=-0.5-s2`; its config is the recipe with the cell's
fields set through `study_recipe.set_fields`, and `config_hash` identifies the run it makes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import pathlib
from typing import NamedTuple

import ml_collections

from experiments.study.records import StudyError

PRETRAINED = "pretrained"


class Cell(NamedTuple):
    """One run of a grid: its name, tier and field values (study names, `study_recipe.FIELDS`)."""

    name: str
    tier: int
    values: dict


def load_grid(spec: str) -> tuple[ml_collections.ConfigDict, object]:
    """`path.py[:arg]` -> (the grid ConfigDict, the `study_recipe` module it uses: the grid
    file's own `study_recipe`, else `experiments.configs.study_recipe`). `arg` must be one of
    the file's `ARGS` (none by default: an argument no grid reads is refused, not ignored).
    The file is read by `isojax.training.configs`' loader, by path; it imports the recipe as a
    package module (`from experiments.configs import study_recipe`), so the checkout's root
    must be importable (`python -m experiments.study` from it)."""
    from isojax.training import configs
    from isojax.training.config import ConfigError

    path, _, arg = spec.partition(":")
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise StudyError(f"grid file {path} not found")
    try:
        module = configs.find(str(path), what="grid file")
        accepted = getattr(module, "ARGS", ())  # the arguments a grid file declares it reads
        if arg and arg not in accepted:
            takes = f"one of {list(accepted)}" if accepted else "no argument"
            raise StudyError(f"grid file {path} takes {takes}, got ':{arg}'")
        grid = configs.get_config(module, arg or None, what="grid file")
    except ConfigError as err:  # one line naming the file (and its line)
        raise StudyError(str(err)) from None
    for key in ("name", "base", "tiers"):
        if key not in grid:
            raise StudyError(f"grid file {path}: get_config() has no {key!r}")
    recipe = getattr(module, "study_recipe", None)
    if recipe is None:
        from experiments.configs import study_recipe as recipe
    return grid, recipe


def _format(value) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def cell_name(values: dict) -> str:
    """`task-method[-field=value...]-s<seed>`, e.g. `stsb-istar-istar.weight=-0.5-s2`."""
    extra = [f"{k}={_format(v)}" for k, v in values.items() if k not in ("task", "method", "seed")]
    return "-".join([str(values["task"]), str(values["method"]), *extra, f"s{values['seed']}"])


def grid_cells(grid: ml_collections.ConfigDict, max_tier: int) -> list[Cell]:
    """The cells of tiers 1..max_tier, in order (tier, block, product of the block's axes)."""
    cells, seen = [], set()
    for tier in sorted(int(t) for t in grid.tiers):
        if tier > max_tier:
            continue
        for block in grid.tiers[str(tier)]:
            keys = list(block)
            for combo in itertools.product(*(block[k] for k in keys)):
                values = dict(zip(keys, combo, strict=True))
                missing = {"task", "method", "seed"} - values.keys()
                if missing:
                    raise StudyError(f"grid {grid.name} tier {tier}: block {block} lacks {missing}")
                name = cell_name(values)
                if name in seen:
                    raise StudyError(f"grid {grid.name}: cell {name} appears twice")
                seen.add(name)
                cells.append(Cell(name, tier, values))
    return cells


def grid_axes(grid: ml_collections.ConfigDict) -> list[str]:
    """Every field any block varies (task, method and seed first)."""
    axes = ["task", "method", "seed"]
    for blocks in grid.tiers.values():
        for block in blocks:
            axes += [k for k in block if k not in axes]
    return axes


def cell_config(grid, recipe, values: dict) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(grid.base.to_dict())
    return recipe.set_fields(config, values)


def config_hash(config: ml_collections.ConfigDict, recipe) -> str:
    """SHA-256 (16 hex digits) of the config without the fields that do not change the run."""
    data = json.loads(config.to_json())
    for key in recipe.NON_RUN_FIELDS:
        data.pop(key, None)
    if data.get("front_end") == "linen":  # added after recorded cells: their hash at its default
        data.pop("front_end")
    if data.get("attention_backend") == "auto":  # likewise
        data.pop("attention_backend")
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def plan(grid, recipe, max_tier: int) -> list[Cell]:
    """Pre-trained cells (one per task of the grid, tier 0) then the grid's cells of tiers
    1..`max_tier` (>= 1: tier 0 names no grid tier, it is the pre-trained rows' own)."""
    if isinstance(max_tier, bool) or not isinstance(max_tier, int) or max_tier < 1:
        tiers = ", ".join(sorted(grid.tiers, key=int))
        raise StudyError(f"--tier must be >= 1 (tiers 1..N run in order; {grid.name} has tiers "
                         f"{tiers}), got {max_tier!r}")  # fmt: skip
    cells = grid_cells(grid, max_tier)
    if grid.get("pretrained", False):
        tasks = list(dict.fromkeys(c.values["task"] for c in cells))
        seed = cells[0].values["seed"] if cells else 0
        pre = [
            Cell(f"{t}-{PRETRAINED}", 0, {"task": t, "method": PRETRAINED, "seed": seed})
            for t in tasks
        ]
        cells = pre + cells
    return cells


def config_of(cell: Cell, grid, recipe) -> ml_collections.ConfigDict:
    """The train config of `cell` (a pre-trained cell: method none, never trained)."""
    if cell.values["method"] == PRETRAINED:  # the plain encoder + classifier, evaluated at step 0
        return cell_config(grid, recipe, {**cell.values, "method": "none"})
    return cell_config(grid, recipe, cell.values)
