"""The study recipe's arm labels (`study_recipe.arm_fields` / `arm_label`), variants included;
the committed studies' records read and hash as they were recorded."""

import json
import pathlib

import ml_collections
import pytest

from experiments.configs import study_recipe
from experiments.study import grid
from isojax.training import config as config_lib

LABELS = ["none", "isobn", "istar", "isobn+istar", *study_recipe.VARIANTS]


@pytest.mark.parametrize("label", LABELS)
def test_a_label_round_trips_through_the_config(label):
    config = study_recipe.set_fields(study_recipe.base_config(), {"method": label})
    assert study_recipe.get_field(config, "method") == label


def test_each_variant_changes_exactly_its_fields():
    base = study_recipe.base_config()
    expected = {
        "iternorm-sg": ("iternorm", {"stop_gradient": True}, None),
        "iternorm-g16": ("iternorm", {"group_size": 16}, None),
        "whiten-nodrop": ("whiten", {}, 0.0),
        "whiten-a05": ("whiten", {"alpha": 0.5}, None),
    }
    for label, (normalizer, kwargs, dropout) in expected.items():
        config = study_recipe.set_fields(study_recipe.base_config(), {"method": label})
        assert (config.normalizer, config.normalizer_kwargs.to_dict()) == (normalizer, kwargs)
        assert config.dropout_rate == dropout and config.penalty == "none"
        config.normalizer, config.normalizer_kwargs, config.dropout_rate = "none", {}, None
        assert config.to_dict() == base.to_dict(), label


def test_the_plain_arm_is_not_read_as_a_variant():
    config = study_recipe.set_fields(study_recipe.base_config(), {"method": "whiten"})
    config.normalizer_kwargs = {"alpha": 0.25}  # not the variant's 0.5
    assert study_recipe.get_field(config, "method") == "whiten"


RESULTS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.jsonl")), ids=lambda p: p.name)
def test_recorded_cells_hash_and_read_as_they_were_recorded(path):
    """Every recorded cell of a committed study: `grid.config_hash` of its recorded config is
    its recorded hash, and this checkout's config of the cell (its grid file, the recipe)
    holds the recorded value at every recorded path (fields that do not change a run and
    `config.RENAMED` history aside): the config's paths, defaults and the hash read recorded
    studies unchanged. Fields added since are checked by `runner.check_hashes`."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "config_hash" in r and "config" in r]
    if not records:
        pytest.skip(f"{path.name} records no config hash (not a study grid's results)")
    grid_file = path.parents[1] / "configs" / f"study_{records[0]['study']}.py"
    loaded, recipe = grid.load_grid(str(grid_file))
    cells = {c.name: c for c in grid.plan(loaded, recipe, max(int(t) for t in loaded.tiers))}
    for record in records:
        recorded = ml_collections.ConfigDict(record["config"])
        assert grid.config_hash(recorded, recipe) == record["config_hash"], record["cell"]
        now = config_lib.flatten(
            json.loads(grid.config_of(cells[record["cell"]], loaded, recipe).to_json())
        )
        skip = set(config_lib.RENAMED) | set(recipe.NON_RUN_FIELDS)
        moved = {
            key: (value, now.get(key, "(absent)"))
            for key, value in config_lib.flatten(record["config"]).items()
            if key not in skip and now.get(key, "(absent)") != value
        }
        assert not moved, (record["cell"], moved)
