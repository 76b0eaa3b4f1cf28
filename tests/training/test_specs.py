"""The run's specs (`isojax.training.specs`): every config field a builder reads reaches its spec,
and below the boundary no function of `isojax.training` or `isojax.runs` takes the config."""

import ast
import collections
import dataclasses
import json

import jax.numpy as jnp
import pytest
from helpers import REPO, finetune_args

from isojax.training import config as config_lib
from isojax.training import optim, run_folder, schema, specs

# The config fields whose spec checks or parses the value: another valid one.
VALID = {"policy": "p=f32,c=bf16,o=f32", "optimizer.schedule": "constant"}


def _other(declared: schema.Declared):
    """A value other than the field's default, of its type (`VALID` for checked strings)."""
    key, default, kind = declared.path, declared.default, declared.kind
    if key in VALID:
        return VALID[key]
    if kind is bool:
        return not default
    if kind in (int, float):
        return kind(3) if default is None else (default / 2 if kind is float else default + 1)
    if kind is tuple:
        return (*(default or ()), 3)
    return "other"


def _spec(config) -> specs.RunSpec:
    return dataclasses.replace(specs.RunSpec.of(config), fields={})


def _fields():
    return [d for d in schema.declarations(specs.RunSpec) if not d.open]


@pytest.mark.parametrize("declared", _fields(), ids=lambda d: d.path)
def test_every_config_field_reaches_a_spec(declared):
    """Changing any field of `default_config` changes the `RunSpec` built from it: no field
    the run uses is dropped at the boundary, and `RunSpec.fields` records the new value."""
    config = config_lib.default_config()
    before = _spec(config)
    value = _other(declared)
    config.update_from_flattened_dict({declared.path: value})
    assert _spec(config) != before, f"{declared.path} reaches no spec"
    saved = specs.RunSpec.of(config).fields[declared.path]  # what config.json records
    assert saved == (list(value) if isinstance(value, tuple) else value)


def _walk(spec: type, prefix: str = "") -> list[tuple[str, str, type]]:
    """`(config path, "declares" | "reads" | "built", spec)` of every leaf field under `spec`."""
    rows = []
    for field in dataclasses.fields(spec):
        meta = field.metadata
        path = f"{prefix}.{field.name}" if prefix else field.name
        if schema.SPEC in meta:
            name = meta[schema.SECTION]
            sub = prefix if name is None else (f"{prefix}.{name}" if prefix else name)
            rows += _walk(meta[schema.SPEC], sub)
        elif schema.BUILT in meta:
            rows.append((path, "built", spec))
        else:
            rows.append((path, "reads" if schema.READS in meta else "declares", spec))
    return rows


def _one_place(spec: type, config) -> list[str]:
    """What breaks "one field, one place" between the specs under `spec` and `config`: a
    config field declared twice, or by no spec; a declaration not in the config; a field read
    that its named owner does not declare; a renamed path still declared."""
    rows = _walk(spec)
    declared = collections.Counter(path for path, how, _ in rows if how == "declares")
    flat = set(config_lib.flatten(config.to_dict()))
    problems = [f"{p}: declared {n} times" for p, n in declared.items() if n > 1]
    problems += [f"{p}: in the config, declared by no spec" for p in sorted(flat - set(declared))]
    problems += [f"{p}: declared, not in the config" for p in sorted(set(declared) - flat)]
    owners = {path: owner for path, how, owner in rows if how == "declares"}
    for path, how, reader in rows:
        field = {f.name: f for f in dataclasses.fields(reader)}[path.rsplit(".", 1)[-1]]
        if how == "reads" and owners.get(path) is not field.metadata[schema.READS]:
            problems.append(f"{path}: read by {reader.__name__}, not declared by its owner")
    problems += [f"{old}: renamed, still declared" for old in config_lib.RENAMED if old in flat]
    return problems


def test_one_field_one_place():
    """The specs' declarations and `default_config`'s flattened keys are one set, each field
    declared once (the other specs that read it say whose it is); the renamed paths are
    history (`config.RENAMED`), their new paths declared. Every spec class of `specs` is a
    section of `RunSpec`, so no spec holds fields outside the config."""
    config = config_lib.default_config()
    assert _one_place(specs.RunSpec, config) == []
    paths = {path for path, how, _ in _walk(specs.RunSpec) if how == "declares"}
    for old, new in config_lib.RENAMED.items():
        assert old not in paths and (new in paths or " " in new), old  # a path, or advice
    reached = {spec for _, _, spec in _walk(specs.RunSpec)} | {specs.RunSpec}
    classes = {
        c
        for c in vars(specs).values()
        if isinstance(c, type)
        and c.__module__ in (specs.__name__, optim.__name__)
        and dataclasses.is_dataclass(c)
    }
    assert classes - reached == set()
    # The config's defaults are the dataclasses' own: a spec built with no argument is the
    # spec of the default config.
    assert _spec(config) == specs.RunSpec()


def test_one_field_one_place_sees_a_field_declared_twice_or_nowhere():
    """The check above, seen failing on planted twins: `seed` declared by `FeedSpec` and
    again by a state spec, and a config field no spec declares."""

    @dataclasses.dataclass(frozen=True)
    class TwinState(schema.Section):
        seed: int = 0  # declared again, not `schema.reads(FeedSpec, "seed")`

    @dataclasses.dataclass(frozen=True)
    class Twin(schema.Section):
        feed: specs.FeedSpec = schema.section(specs.FeedSpec)
        state: TwinState = schema.section(TwinState)

    assert _one_place(Twin, schema.tree(specs.FeedSpec)) == ["seed: declared 2 times"]
    with pytest.raises(ValueError, match="'seed' is declared by FeedSpec and TwinState"):
        schema.tree(Twin)  # nor does the config build
    config = config_lib.default_config()
    config.extra = 1  # a field written into the config by hand
    assert _one_place(specs.RunSpec, config) == ["extra: in the config, declared by no spec"]


@pytest.mark.parametrize(
    "key, value, where, expected",
    [
        ("max_length", 64, ("model.max_length", "data.max_length"), 64),
        ("seed", 7, ("feed.seed", "state.seed"), 7),
        ("grad_accum_steps", 2, ("feed.grad_accum_steps", "state.objective.grad_accum_steps"), 2),
        ("optimizer.learning_rate", 1e-3, ("state.optim.learning_rate",), 1e-3),
        ("istar.zeta", 0.5, ("state.objective.istar.zeta",), 0.5),
        ("istar.stabilizer.tokens", 512, ("state.objective.istar.stabilizer.tokens",), 512),
        ("istar.stabilizer.kind", "ema", ("state.objective.istar.stabilizer.kind",), "ema"),
        ("optimizer.clip_norm", None, ("state.optim.clip_norm",), None),
        (
            "policy",
            "c=bf16",
            ("model.policy.compute_dtype", "state.policy.compute_dtype"),
            jnp.bfloat16,
        ),
        ("packing", True, ("feed.packing", "model.packing"), True),
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
    weight and padding, the C0 settings of each kind (`StabilizerSpec.settings`), the window
    in steps an epoch of micro-batches (`ObjectiveSpec.for_run`)."""
    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {"policy": "c=bf16", "normalizer": "isobn", "normalizer_kwargs.epsilon": 1e-5}
    )
    spec = specs.RunSpec.of(config)
    assert spec.model.policy.compute_dtype == jnp.bfloat16 == spec.state.policy.compute_dtype
    assert spec.model.normalizer_kwargs == config.isobn.to_dict() | {"epsilon": 1e-5}
    objective = spec.state.objective
    assert objective.weight == 0.0 and objective.istar.stabilizer.settings() == {}
    config.update_from_flattened_dict({"penalty": "cosreg", "cosreg.include_padding": True})
    objective = specs.ObjectiveSpec.of(config)
    assert (objective.weight, objective.include_padding) == (1.0, True)
    config.update_from_flattened_dict({"penalty": "istar", "istar.stabilizer.kind": "epoch"})
    epoch = {"window": 250_000, "window_unit": "tokens"}
    assert specs.ObjectiveSpec.of(config).for_run(False, 9).istar.stabilizer.settings() == epoch
    config.update_from_flattened_dict({"istar.stabilizer.unit": "steps", "grad_accum_steps": 2})
    objective = specs.ObjectiveSpec.of(config)
    with pytest.raises(ValueError, match="needs the epoch's length"):
        objective.istar.stabilizer.settings()
    run = objective.for_run(True, 9)
    assert run.istar.stabilizer.settings() == {"window": 18, "window_unit": "steps"}
    assert run.regression and not objective.regression
    config.istar.stabilizer.kind = "ema"
    ema = {"momentum": 0.99, "debias": True}
    assert specs.ObjectiveSpec.of(config).istar.stabilizer.settings() == ema


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
    "isojax/training/specs.py": {"of", "normalizer_of"},
    "isojax/training/schema.py": {"of", "read", "lookup"},  # how a spec reads its section
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


def _old_spelling(config) -> dict:
    """`config`'s JSON with I-STAR's C0 in the spelling before the `istar.stabilizer` section
    (`config.RENAMED`)."""
    saved = json.loads(config.to_json())
    c0 = saved["istar"].pop("stabilizer")
    saved["istar"]["stabilizer"] = c0["kind"]
    for old, new in [("tokens", "tokens"), ("window", "window"), ("window_unit", "unit")]:
        saved["istar"][f"stabilizer_{old}"] = c0[new]
    saved["istar"] |= {"stabilizer_momentum": c0["momentum"], "stabilizer_debias": c0["debias"]}
    return saved


def test_renamed_paths_read_under_their_new_names(tmp_path):
    """A run folder's `config.json` and a checkpoint's config stamp that spell a field by its
    old path (`config.RENAMED`) read under the new one (`config.translate`): `load_config`
    restores the values, the stamp and the same-run check see no change; a field that names
    no path ("method") is refused in one line."""
    from isojax.runs import folder

    config = config_lib.default_config()
    config.update_from_flattened_dict(
        {"penalty": "istar", "istar.stabilizer.kind": "ema", "istar.stabilizer.tokens": 512}
    )
    old = _old_spelling(config)
    assert "istar.stabilizer_tokens" in config_lib.flatten(old)
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert folder.load_config(tmp_path).to_dict() == config.to_dict()
    fields = specs.RunSpec.of(config).fields
    stamp = run_folder.config_stamp(config_lib.flatten(old))["config"]
    assert run_folder.check_stamp(stamp, fields, "step 1")  # no ConfigChanged
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    run_folder.check_same_run(fields, tmp_path)  # no ConfigChanged
    changed = dict(fields, **{"istar.stabilizer.tokens": 1024})
    with pytest.raises(run_folder.ConfigChanged, match=r"istar.stabilizer.tokens: 512 -> 1024"):
        run_folder.check_stamp(stamp, changed, "step 1")
    (tmp_path / "config.json").write_text(json.dumps(old | {"method": "istar"}))
    with pytest.raises(folder.RunNotRestorable, match="field 'method' is now two fields"):
        folder.load_config(tmp_path)
