"""The normalisers' typed hyper-parameter schema (`normalizers.schema`, `check_hparams`,
`check_width`): every value typed and ranged from the `HPARAMS` table, so a new row is checked
without code of its own (issue 50, finding 2)."""

import numpy as np
import pytest

from isojax.core import normalizers


@pytest.mark.parametrize(
    "hparams, message",
    [
        ({"momentum": "abc"}, "momentum must be a number finite in float32, got 'abc'"),
        ({"alpha": "abc"}, "alpha must be a number finite in float32, got 'abc'"),
        ({"epsilon": float("nan")}, "epsilon must be a number finite in float32, got nan"),
        ({"group_size": 16.0}, "group_size must be a positive integer or None, got 16.0"),
        ({"group_size": True}, "group_size must be a positive integer or None, got True"),
        ({"group_size": 0}, "group_size must be a positive integer or None, got 0"),
        ({"keep_scale": "maybe"}, "keep_scale must be True or False, got 'maybe'"),
        ({"keep_scale": 1}, "keep_scale must be True or False, got 1"),
        ({"momentum": True}, "momentum must be a number finite in float32, got True"),
        ({"momentum": 1.0}, "momentum 1.0 not in (0, 1)"),
    ],
)
def test_whiten_values_are_typed_before_any_comparison(hparams, message):
    """Finding 2: `momentum=abc` raised TypeError from `<`; 16.0, True and 'maybe' passed."""
    with pytest.raises(ValueError) as err:
        normalizers.check_hparams("whiten", **hparams)
    assert str(err.value) == message


def test_good_values_pass_numpy_scalars_included():
    normalizers.check_hparams(
        "whiten", momentum=np.float32(0.9), alpha=0, epsilon=1e-5, group_size=np.int64(16),
        keep_scale=np.bool_(False),
    )  # fmt: skip
    normalizers.check_hparams("whiten", group_size=None)
    normalizers.check_hparams("batchnorm", bias_init=lambda *a: 0.0)
    with pytest.raises(ValueError, match="bias_init must be a callable, got 'zeros'"):
        normalizers.check_hparams("batchnorm", bias_init="zeros")


def test_group_size_must_divide_the_width_naming_both_numbers():
    normalizers.check_width("whiten", 32, group_size=16)
    normalizers.check_width("whiten", 32, group_size=None)
    normalizers.check_width("isobn", 32, momentum=0.9)
    with pytest.raises(ValueError) as err:
        normalizers.check_width("whiten", 32, group_size=5)
    assert str(err.value) == "group_size 5 does not divide the width 32 of whiten's input"


def test_every_row_of_the_table_has_a_schema():
    for name in normalizers.NORMALIZERS:
        assert set(normalizers.schema(name)) == set(normalizers.HPARAMS[name])
        normalizers.check_hparams(name, **normalizers.HPARAMS[name])  # the defaults pass


@pytest.fixture
def new_row(monkeypatch):
    """A normaliser row as a new method adds it (IterNorm's fields), with no code of its own."""
    row = {"momentum": 0.1, "eps": 1e-5, "T": 5, "group_size": None, "stop_gradient": False,
           "affine": True, "scale": 2.0}  # fmt: skip
    monkeypatch.setitem(normalizers.HPARAMS, "newnorm", row)
    monkeypatch.setitem(normalizers.STRUCTURAL, "newnorm", ("dtype",))
    return row


@pytest.mark.parametrize(
    "hparams, message",
    [
        ({"momentum": "x"}, "momentum must be a number finite in float32"),
        ({"momentum": 1.5}, "momentum 1.5 not in (0, 1)"),
        ({"eps": 0.0}, "eps must be > 0 in float32, got 0.0"),
        ({"T": 2.0}, "T must be an integer in [0, 6], got 2.0"),
        ({"T": -1}, "T must be an integer in [0, 6], got -1"),
        ({"group_size": True}, "group_size must be a positive integer or None"),
        ({"stop_gradient": "no"}, "stop_gradient must be True or False, got 'no'"),
        ({"affine": 0}, "affine must be True or False, got 0"),
        (
            {"scale": "2"},
            "scale must be a number finite in float32, got '2'",
        ),  # typed by its default
    ],
)
def test_a_new_row_is_typed_from_the_table(new_row, hparams, message):
    normalizers.check_hparams("newnorm", **new_row)
    with pytest.raises(ValueError, match=f"^{__import__('re').escape(message)}"):
        normalizers.check_hparams("newnorm", **hparams)
    with pytest.raises(ValueError, match="group_size 3 does not divide the width 32"):
        normalizers.check_width("newnorm", 32, group_size=3)


def test_a_none_default_without_a_rule_is_refused(monkeypatch):
    monkeypatch.setitem(normalizers.HPARAMS, "newnorm", {"whatever": None})
    with pytest.raises(TypeError, match="'whatever' .* needs a Rule in RULES"):
        normalizers.schema("newnorm")


def test_iternorms_row_is_typed_without_code_of_its_own():
    """IterNorm's row (added after the schema) is checked from the table alone."""
    for hparams, message in [
        ({"momentum": "abc"}, "momentum must be a number finite in float32, got 'abc'"),
        ({"iterations": 2.5}, "iterations must be an integer in [0, 6], got 2.5"),
        ({"stop_gradient": "yes"}, "stop_gradient must be True or False, got 'yes'"),
        ({"affine": None}, "affine must be True or False, got None"),
    ]:
        with pytest.raises(ValueError) as err:
            normalizers.check_hparams("iternorm", **hparams)
        assert str(err.value) == message
    with pytest.raises(ValueError, match="group_size 5 does not divide the width 32"):
        normalizers.check_width("iternorm", 32, group_size=5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("epsilon", 1e300, "epsilon must be a number finite in float32, got 1e+300"),
        ("epsilon", 1e-300, "epsilon must be > 0 in float32, got 1e-300"),
        ("beta", 1e300, "beta must be a number finite in float32, got 1e+300"),
        ("momentum", 5.0, "momentum 5.0 not in (0, 1)"),
        (
            "iterations",
            1000000,
            "iterations 1000000 > 6: more float32 Newton-Schulz steps amplify rounding in the "
            "batch covariance's near-null directions",
        ),
    ],
)
@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_every_normaliser_checks_its_values_in_float32_at_construction(
    front, field, value, message
):
    """Audit 6, findings 6 and 4: `epsilon`/`isobn.beta` 1e300 passed (float64-finite, inf in
    the float32 maths) and 1e-300 became 0; `IsoBN(momentum=5.0)` was accepted when built
    directly in either front end while `Whiten` refused it. Every normaliser's constructor,
    linen's and NNX's, runs the one check (`check_hparams`) on its own hyper-parameters."""
    import isojax

    classes = (isojax.linen if front == "linen" else isojax.nnx).norms.CLASSES
    checked = 0
    for name, cls in classes.items():
        if field not in normalizers.HPARAMS[name]:
            continue
        with pytest.raises(ValueError) as err:
            cls(**{field: value}) if front == "linen" else cls(8, **{field: value})
        assert str(err.value) == message, (name, str(err.value))
        checked += 1
    assert checked >= {"epsilon": 4, "beta": 1, "momentum": 5, "iterations": 1}[field]


# The check table's bad values, by field: every field of every `HPARAMS` row has some
# (`test_every_field_has_bad_values`), so a new row is refused by its constructors as it is added.
_FLAG_BAD = (1, 0, "yes", None)
_INIT_BAD = ("zeros", 0.0, None)
BAD = {
    "momentum": (5.0, 0.0, 1.0, -0.5, 1 - 1e-9, 1e-9, "0.9", True, None, float("nan")),
    "beta": (-1.0, 1e300, float("inf"), "0.5", None),
    "epsilon": (0.0, -1e-5, 1e-300, 1e300, float("nan"), "1e-5", None),
    "alpha": (-0.1, 1.5, "0.1", None),
    "group_size": (0, -4, 16.0, True, "4"),
    "iterations": (-1, 7, 2.5, True, None),
    **dict.fromkeys(("debias", "keep_scale", "stop_gradient", "affine"), _FLAG_BAD),
    **dict.fromkeys(("use_bias", "use_scale"), _FLAG_BAD),
    **dict.fromkeys(("bias_init", "scale_init"), _INIT_BAD),
}
CASES = [
    (name, field, value)
    for name in normalizers.NORMALIZERS
    for field in normalizers.HPARAMS[name]
    for value in BAD[field]
]


def _build(front: str, name: str, **hparams):
    import isojax

    cls = (isojax.linen if front == "linen" else isojax.nnx).norms.CLASSES[name]
    return cls(**hparams) if front == "linen" else cls(8, **hparams)


def test_every_field_has_bad_values():
    fields = {field for row in normalizers.HPARAMS.values() for field in row}
    assert fields <= set(BAD), sorted(fields - set(BAD))
    assert len(CASES) > 100


@pytest.mark.parametrize("front", ["linen", "nnx"])
@pytest.mark.parametrize("name, field, value", CASES, ids=lambda v: repr(v)[:12])
def test_direct_construction_refuses_every_bad_value_in_one_line(front, name, field, value):
    """Issue 60: every normaliser's constructor, linen's and NNX's, refuses each bad value of
    the table, with `check_hparams`' own one-line message naming the field (`IsoBN(momentum=5.0)`
    was accepted built directly while `Whiten` refused it)."""
    with pytest.raises(ValueError) as expected:
        normalizers.check_hparams(name, **{field: value})
    message = str(expected.value)
    assert "\n" not in message and message.startswith(field), message
    with pytest.raises(ValueError) as err:
        _build(front, name, **{field: value})
    assert str(err.value) == message


@pytest.mark.parametrize("front", ["linen", "nnx"])
@pytest.mark.parametrize("name", normalizers.NORMALIZERS)
def test_direct_construction_keeps_every_good_value(front, name):
    """The defaults, and the edges of each range, build in both front ends; NNX sets each of
    the table's fields as an attribute of the same value (one loop over the row)."""
    edges = {"momentum": 1e-3, "beta": 0.0, "epsilon": 1e-30, "alpha": 1.0, "group_size": 4}
    edges |= {"iterations": 6, "debias": True, "keep_scale": False, "affine": True}
    for row in (
        normalizers.HPARAMS[name],
        {k: v for k, v in edges.items() if k in normalizers.HPARAMS[name]},
    ):
        module = _build(front, name, **row)
        assert {k: getattr(module, k) for k in row} == row
        if front == "nnx":
            assert module.num_features == 8
