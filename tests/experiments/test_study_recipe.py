"""The study recipe's arm labels (`study_recipe.arm_fields` / `arm_label`), variants included."""

import pytest

from experiments.configs import study_recipe

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
