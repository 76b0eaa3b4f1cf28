"""Helpers the test modules share (no test module imports another)."""

from isojax.core.penalties import PENALTIES


def arm(method: str) -> dict:
    """The config fields of a study-style arm label: "isobn" -> normalizer isobn, "istar" ->
    penalty istar, "isobn+istar" -> both (as `experiments/configs/study_recipe.arm_fields`)."""
    fields = {"normalizer": "none", "penalty": "none"}
    for part in method.split("+"):
        if part != "none":
            fields["penalty" if part in PENALTIES else "normalizer"] = part
    return fields
