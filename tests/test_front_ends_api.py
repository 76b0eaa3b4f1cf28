"""The two front ends curate the same names where they share a concept: `isojax.linen` and
`isojax.nnx` differ only by the names listed here, each with its reason, so a name added to one
front end and not the other fails until it is added to both or listed."""

import isojax.linen as ijl
import isojax.nnx as ijx

# The same concept, spelled as each framework spells it (linen builds then loads; NNX builds a
# module that holds its weights).
TWINS = {"load_pretrained": "from_pretrained"}
# linen's variables live outside the module: functions that make them.
LINEN_ONLY = {"init_batch_stats", "init_params", "init_variables"}
# NNX's running-statistics base class, the explicit C0 install, and the linen twin in and out.
NNX_ONLY = {
    "RunningModule",
    "install_c0",
    "from_linen",
    "to_linen",
    "linen_variables",
    "load_linen_variables",
}


def test_the_front_ends_curate_the_same_names():
    linen, nnx = set(ijl.__all__), set(ijx.__all__)
    assert linen - nnx == LINEN_ONLY | set(TWINS)
    assert nnx - linen == NNX_ONLY | set(TWINS.values())


def test_every_curated_name_resolves():
    for module in (ijl, ijx):
        assert sorted(module.__all__) == sorted(set(module.__all__))
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{module.__name__}.{name}"


def test_each_front_end_defines_its_own_modules():
    """The encoder and the classifier are each front end's own, defined in its own package."""
    for module, package in ((ijl, "isojax.linen."), (ijx, "isojax.nnx.")):
        for name in ("Encoder", "SequenceClassifier", "Pretrained", "export_pretrained"):
            assert getattr(module, name).__module__.startswith(package), (module, name)
    assert ijl.EncoderOutput is ijx.EncoderOutput  # the one output record, from isojax.models
