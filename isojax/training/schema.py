"""The config's schema, read off the spec dataclasses: each config field is declared once.

A spec (`isojax.training.specs`) is a frozen dataclass whose fields are the config fields its
builders read. A field's name is its key in the spec's config section, its default is the
config's default, its annotation its type (`int | None`: the config may hold None), its doc
the spec's `Attributes:`. From these one declaration come `config.default_config()` (`tree`)
and every `Spec.of(config)` (`read`):

    @dataclasses.dataclass(frozen=True)
    class StateSpec(schema.Section):
        seed: int = schema.reads(FeedSpec, "seed")      # declared by FeedSpec, read here too
        optim: optim.OptimSpec = schema.section(optim.OptimSpec, "optimizer")
        ...

A field is one of:
  - a plain field: the config field `<section>.<name>`, declared here;
  - `section(Spec, name)`: a nested spec whose fields sit in config section `name` (None: in
    the parent's own section);
  - `reads(Owner, name)`: a field another spec declares, which this one reads too;
  - `parsed(raw, parse)`: the config holds `raw` by default, the spec `parse(value)`;
  - `derived(derive, default)`: an open dict field (any key), whose spec value is
    `derive(config)`;
  - `built(default)`: no config field; the build sets it (a regression task's loss).

`declarations(RunSpec)` lists every config field with its path, default and type;
`tests/training/test_specs.py` checks they are the config's fields, each declared once.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

import ml_collections
from flax import traverse_util
from ml_collections import config_dict

SECTION, SPEC, READS, PARSE, RAW, DERIVE, BUILT = (
    "section", "spec", "reads", "parse", "raw", "derive", "built",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Declared:
    """One config field as its spec declares it.

    Attributes:
      path: the config path (`"optimizer.learning_rate"`).
      default: the config's default (`raw` of a parsed field; `{}` for an open one).
      kind: its type (`int` for `int | None`).
      nullable: None is a value (the annotation admits None).
      open: an open dict: its keys are not fixed (`normalizer_kwargs`).
      owner: the spec class that declares it.
    """

    path: str
    default: Any
    kind: type
    nullable: bool
    open: bool
    owner: type


class Section:
    """A spec read from its config section (`read`): `Spec.of(config)`."""

    @classmethod
    def of(cls, config: ml_collections.ConfigDict):
        return read(cls, config)


def section(spec: type, name: str | None = None) -> Any:
    """A nested spec, its fields in config section `name` (None: the parent's section)."""
    return dataclasses.field(default_factory=spec, metadata={SECTION: name, SPEC: spec})


def reads(owner: type, name: str) -> Any:
    """A field that `owner` declares (its default too), read by this spec as well."""
    field = owner.__dataclass_fields__[name]
    parse = {PARSE: field.metadata[PARSE]} if PARSE in field.metadata else {}
    return dataclasses.field(default=field.default, metadata={READS: owner, **parse})


def parsed(raw: Any, parse: Any) -> Any:
    """A config field holding `raw` by default, whose spec value is `parse(value)`."""
    return dataclasses.field(default=parse(raw), metadata={RAW: raw, PARSE: parse})


def derived(derive: Any) -> Any:
    """An open dict config field (`{}` by default, any key), the spec holding
    `derive(config)`."""
    return dataclasses.field(default_factory=dict, metadata={DERIVE: derive})


def built(default: Any) -> Any:
    """Not a config field: set by the build (`dataclasses.replace`)."""
    return dataclasses.field(default=default, metadata={BUILT: True})


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _kind(annotation: Any, default: Any) -> tuple[type, bool]:
    """`(type, nullable)` of an annotation: `int | None` -> `(int, True)`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return typing.get_origin(args[0]) or args[0], True
    if default is not None and not isinstance(annotation, type):
        return type(default), False
    return typing.get_origin(annotation) or annotation, False


def declarations(spec: type, prefix: str = "") -> list[Declared]:
    """Every config field `spec` and its nested specs declare, in order (fields read from
    another spec, and built ones, are not declarations)."""
    return list(_declarations(spec, prefix))


@functools.cache  # a spec class never changes: its type hints are read once, not per config
def _declarations(spec: type, prefix: str) -> tuple[Declared, ...]:
    hints = typing.get_type_hints(spec)
    out = []
    for field in dataclasses.fields(spec):
        meta = field.metadata
        if BUILT in meta or READS in meta:
            continue
        if SPEC in meta:
            sub = prefix if meta[SECTION] is None else _join(prefix, meta[SECTION])
            out += declarations(meta[SPEC], sub)
            continue
        path = _join(prefix, field.name)
        if DERIVE in meta:
            out.append(Declared(path, {}, dict, False, True, spec))
            continue
        default = meta[RAW] if RAW in meta else field.default
        kind, nullable = _kind(hints[field.name], default)
        out.append(Declared(path, default, kind, nullable, False, spec))
    return tuple(out)


def _value(declared: Declared) -> Any:
    if declared.open:
        return ml_collections.ConfigDict()
    if declared.default is None:
        return config_dict.placeholder(declared.kind)
    if declared.nullable:
        return config_dict.FieldReference(declared.default, declared.kind)
    return declared.default


def tree(spec: type) -> ml_collections.ConfigDict:
    """The config `spec` declares, every field at its default (`config.default_config`).
    A path declared twice is refused (`ValueError`): one spec declares it, others read it."""
    config, owners = ml_collections.ConfigDict(), {}
    for declared in declarations(spec):
        if declared.path in owners:
            raise ValueError(
                f"config field {declared.path!r} is declared by {owners[declared.path].__name__} "
                f"and {declared.owner.__name__}: one declares it, the other reads it (schema.reads)"
            )
        owners[declared.path] = declared.owner
        *parents, leaf = declared.path.split(".")
        node = config
        for part in parents:
            if part not in node:
                node[part] = ml_collections.ConfigDict()
            node = node[part]
        node[leaf] = _value(declared)
    return config


def _plain(value: Any) -> Any:
    """A config value as a spec holds it: tuples for sequences, dicts for sub-configs."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, ml_collections.ConfigDict):
        return value.to_dict()
    return value


def lookup(config: ml_collections.ConfigDict, path: str) -> Any:
    node = config
    for part in path.split("."):
        node = node[part]
    return node


def read(spec: type, config: ml_collections.ConfigDict, prefix: str = "") -> Any:
    """`spec` with each field from its config path (`Spec.of`); built fields at default."""
    values = {}
    for field in dataclasses.fields(spec):
        meta = field.metadata
        if BUILT in meta:
            continue
        if SPEC in meta:
            sub = prefix if meta[SECTION] is None else _join(prefix, meta[SECTION])
            values[field.name] = read(meta[SPEC], config, sub)
        elif DERIVE in meta:
            values[field.name] = meta[DERIVE](config)
        else:
            value = _plain(lookup(config, _join(prefix, field.name)))
            values[field.name] = meta[PARSE](value) if PARSE in meta else value
    return spec(**values)


def flatten(tree: dict) -> dict:
    """`{"a": {"b": 1}, "c": {}}` -> `{"a.b": 1, "c": {}}` (an empty dict is a value)."""
    flat = traverse_util.flatten_dict(tree, keep_empty_nodes=True, sep=".")
    return {key: {} if value is traverse_util.empty_node else value for key, value in flat.items()}
