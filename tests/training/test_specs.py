"""The run's specs (`isojax.training.specs`): every config field a builder reads reaches its spec,
and below the boundary no function of `isojax.training` or `isojax.runs` takes the config."""

import ast
import dataclasses

import jax.numpy as jnp
import pytest
from helpers import REPO, finetune_args

from isojax.training import config as config_lib
from isojax.training import specs

# A value other than the default for each field (those that need one of a fixed set).
OTHER = {
    "task": "mrpc",
    "model": "another-model",
    "front_end": "nnx",
    "tokenizer": "a-tokenizer",
    "data_dir": "glue_data",
    "tfds_data_dir": "tfds",
    "normalizer": "layernorm",
    "penalty": "cosreg",
    "sentence": "cls",
    "policy": "p=f32,c=bf16,o=f32",
    "loss_scale": "dynamic",
    "rng_impl": "rbg",
    "optimizer.schedule": "constant",
    "optimizer.clip_norm": 0.5,
    "istar.stabilizer.kind": "ema",
    "istar.stabilizer.unit": "steps",
    "istar.stabilizer.window": 5,
    "dropout_rate": 0.2,
    "buckets": (16,),
    "row_buckets": (2, 4),
    "profile_steps": (1, 2),
    "peak_flops": 1e12,
    "attention_backend": "xla",
}
# Fields under a section that only one choice reads: changed on a base that makes the choice.
BASES = {"istar": {"penalty": "istar"}, "cosreg": {"penalty": "cosreg"}}
# What each C0 mode reads of `istar.stabilizer`.
C0_MODE = {"window": "epoch", "unit": "epoch", "momentum": "ema", "debias": "ema"}


def _other(key, default):
    if key in OTHER:
        return OTHER[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    return None  # placeholders without an entry in OTHER (None -> any int)


def _spec(config) -> specs.RunSpec:
    return dataclasses.replace(specs.RunSpec.of(config), fields={})


def _fields():
    defaults = config_lib.flatten(config_lib.default_config().to_dict())
    return [(key, value) for key, value in defaults.items() if key not in ("normalizer_kwargs",)]


@pytest.mark.parametrize("key, default", _fields())
def test_every_config_field_reaches_a_spec(key, default):
    """Changing any field of `default_config` changes the `RunSpec` built from it (on a base
    where the field is read: its penalty, its C0 mode): no field the run uses is dropped at
    the boundary. The specs hold no `ConfigDict`."""
    config = config_lib.default_config()
    section = key.split(".")[0]
    for base_key, value in BASES.get(section, {}).items():
        config[base_key] = value
    if key.startswith("istar.stabilizer.") and key.split(".")[-1] in C0_MODE:
        config.istar.stabilizer.kind = C0_MODE[key.split(".")[-1]]
    if section == "isobn":
        config.normalizer = "isobn"
    before = _spec(config)
    value = _other(key, default)
    if value is None:
        value = 3
    config.update_from_flattened_dict({key: value})
    assert _spec(config) != before, f"{key} reaches no spec"
    saved = specs.RunSpec.of(config).fields[key]  # what config.json and the stamps record
    assert saved == (list(value) if isinstance(value, tuple) else value)


@pytest.mark.parametrize(
    "key, value, where, expected",
    [
        ("max_length", 64, ("model.max_length", "data.max_length"), 64),
        ("seed", 7, ("feed.seed", "state.seed"), 7),
        ("grad_accum_steps", 2, ("feed.grad_accum_steps", "state.objective.grad_accum_steps"), 2),
        ("optimizer.learning_rate", 1e-3, ("state.optim.learning_rate",), 1e-3),
        ("istar.zeta", 0.5, ("state.objective.zeta",), 0.5),
        ("istar.stabilizer.tokens", 512, ("state.objective.c0_tokens",), 512),
        ("keep_checkpoints", 3, ("loop.keep_checkpoints",), 3),
        ("eval_batch_size", 16, ("feed.eval_batch_size",), 16),
        ("max_eval_examples", 16, ("data.max_eval_examples",), 16),
        ("front_end", "nnx", ("state.front_end",), "nnx"),
        ("fsdp", True, ("state.fsdp",), True),
    ],
)
def test_a_config_field_reaches_the_spec_of_its_builder(key, value, where, expected):
    config = config_lib.default_config()
    config.update_from_flattened_dict({key: value})
    spec = specs.RunSpec.of(config)
    for path in where:
        node = spec
        for part in path.split("."):
            node = getattr(node, part)
        assert node == expected, path


def test_the_specs_derive_what_the_builders_used_to():
    """The policy parsed once, IsoBN's fields under `normalizer_kwargs`, the penalty's own
    weight and padding, the C0 settings of each mode (`ObjectiveSpec.c0_settings`)."""
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {"policy": "c=bf16", "normalizer": "isobn", "normalizer_kwargs.epsilon": 1e-5}
    )
    spec = specs.RunSpec.of(config)
    assert spec.model.policy.compute_dtype == jnp.bfloat16 == spec.state.policy.compute_dtype
    assert spec.model.normalizer_kwargs == config.isobn.to_dict() | {"epsilon": 1e-5}
    assert spec.state.objective.weight == 0.0 and spec.state.objective.c0_settings(9) == {}
    config.update_from_flattened_dict({"penalty": "cosreg", "cosreg.include_padding": True})
    objective = specs.ObjectiveSpec.of(config)
    assert (objective.weight, objective.include_padding) == (1.0, True)
    config.update_from_flattened_dict({"penalty": "istar", "istar.stabilizer.kind": "epoch"})
    epoch = {"window": 250_000, "window_unit": "tokens"}
    assert specs.ObjectiveSpec.of(config).c0_settings(9) == epoch
    config.istar.stabilizer.unit = "steps"
    assert specs.ObjectiveSpec.of(config).c0_settings(9) == {"window": 9, "window_unit": "steps"}
    config.istar.stabilizer.kind = "ema"
    assert specs.ObjectiveSpec.of(config).c0_settings(9) == {"momentum": 0.99, "debias": True}


class _Stop(Exception):
    pass


def test_isojax_finetune_validates_the_config_once(monkeypatch, tmp_path, glue_dir, minilm_dir):
    """`isojax finetune` -> `train_and_evaluate`: one `validate_config`, then the spec is built
    and passed down (stopped at `build_run`, which receives the `RunSpec`)."""
    from isojax import cli
    from isojax.training import loop

    calls, real = [], config_lib.validate_config
    monkeypatch.setattr(config_lib, "validate_config", lambda c: calls.append(c) or real(c))

    def stop(spec, **kwargs):
        assert isinstance(spec, specs.RunSpec) and spec.data.task == "rte"
        raise _Stop

    monkeypatch.setattr(loop, "build_run", stop)
    with pytest.raises(_Stop):
        cli.main(finetune_args(glue_dir, minilm_dir, tmp_path / "run"))
    assert len(calls) == 1


# The boundary: where a `ConfigDict` is validated and its `RunSpec` built. `config.py` is the
# config's own module (its fields, defaults and validation).
BOUNDARY = {
    "isojax/training/loop.py": {"train_and_evaluate", "setup"},
    "isojax/training/specs.py": {"of"},
}
CONFIG_MODULE = "isojax/training/config.py"


def _takes_config(function: ast.FunctionDef) -> bool:
    arguments = function.args
    for arg in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
        annotation = ast.unparse(arg.annotation) if arg.annotation else ""
        if arg.arg == "config" or "ConfigDict" in annotation:
            return True
    return False


def test_no_builder_below_the_boundary_takes_the_config():
    """Past `train_and_evaluate`/`setup` (and `runs.restore`'s `load_config`), builders take
    the spec they need: no function of `isojax.training` or `isojax.runs` but the boundary's
    has a parameter named `config` or typed `ConfigDict`."""
    offenders = []
    for package in ("isojax/training", "isojax/runs"):
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name == CONFIG_MODULE or "/configs/" in name:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                if node.name in BOUNDARY.get(name, ()) or not _takes_config(node):
                    continue
                offenders.append(f"{name}:{node.lineno} {node.name}")
    assert not offenders, offenders


def test_the_ast_check_sees_a_config_parameter():
    """The check above is seen failing on a planted builder that takes the config."""
    planted = ast.parse("def build(config: ml_collections.ConfigDict, n): ...").body[0]
    typed = ast.parse("def build(cfg: ConfigDict): ...").body[0]
    clean = ast.parse("def build(spec: specs.FeedSpec, n): ...").body[0]
    assert _takes_config(planted) and _takes_config(typed) and not _takes_config(clean)
