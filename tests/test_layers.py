"""The layer rule of ARCHITECTURE.md, read from the imports of `isojax/` with `ast`.

A module imports only modules of a lower layer or of its own folder (the two front ends share
layer 3; the NNX front end's export module alone imports linen, whose twin it exports through);
no module imports another
module's private name (`_x`); `core/` and `models/` (the front-end-free half of the encoders)
import neither `flax.linen` nor `flax.nnx`, and no facade is excepted. Every import
counts, at the top of a module or inside a function. A planted violation of each kind is
reported (the checker itself is tested, so the rule cannot pass by accident).
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "isojax"
# Layers, bottom up; a folder's modules may import any lower layer's and their own folder's.
LAYERS = {
    "errors": 0,
    "logs": 0,
    "core": 1,
    "data": 2,
    "models": 2,
    "linen": 3,
    "nnx": 3,
    "training": 4,
    "runs": 5,
    "analysis": 6,
    "cli": 7,
}
# The one import across a floor: `isojax.nnx.export` writes an NNX model through its linen twin.
ACROSS = {("nnx/export.py", "linen")}
MODULE_SYSTEMS = ("flax.linen", "flax.nnx")
# Neither front end's module system below the front ends: models/ is the pure half of the
# encoders that both build on.
FRONT_END_FREE = ("core", "models")


def _unit(module: str) -> str | None:
    """`isojax.core.stats` -> "core"; `isojax.errors` -> "errors"; `isojax` -> None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "isojax" else None


def _imports(tree: ast.Module, package: str):
    """(line, imported module, names) of every import of `tree` (relative ones resolved)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            yield node.lineno, base, [a.name for a in node.names]


def violations(root: pathlib.Path) -> list[str]:
    """Every breach of the rule in the package at `root` (a folder named `isojax`)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        module = ".".join(rel.with_suffix("").parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        unit = _unit(module.removesuffix(".__init__"))
        tree = ast.parse(path.read_text())
        for line, imported, names in _imports(tree, package):
            where = f"{rel}:{line}"
            if unit in FRONT_END_FREE and imported.startswith(MODULE_SYSTEMS):
                found.append(f"{where}: {unit}/ imports {imported}")
            if not imported.startswith("isojax"):
                continue
            target = _unit(imported)
            if unit is not None and target is not None and target != unit:
                if ("/".join(rel.parts[1:]), target) in ACROSS:
                    continue
                if LAYERS[target] >= LAYERS[unit]:
                    found.append(f"{where}: {unit}/ (layer {LAYERS[unit]}) imports {imported}")
            for name in names:
                if name.startswith("_"):
                    found.append(f"{where}: imports the private {imported}.{name}")
        found += _private_attributes(tree, rel)
    return found


def _private_attributes(tree: ast.Module, rel: pathlib.PurePath) -> list[str]:
    """`mod._name` where `mod` is a name bound by an isojax import."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("isojax"):
            bound |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            bound |= {a.asname or a.name for a in node.names if a.name.startswith("isojax")}
    return [
        f"{rel}:{node.lineno}: reads the private {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in bound
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_the_package_keeps_the_layer_rule():
    assert violations(PACKAGE) == []


def test_every_folder_has_a_layer():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert folders | modules <= set(LAYERS), sorted((folders | modules) - set(LAYERS))


@pytest.mark.parametrize(
    "file, source, message",
    [
        ("core/bad.py", "from isojax.training import loop\n", "core/ (layer 1) imports"),
        ("core/bad.py", "def f():\n    import flax.linen as nn\n", "core/ imports flax.linen"),
        ("linen/bad.py", "from isojax.nnx import norms\n", "linen/ (layer 3) imports"),
        ("nnx/bad.py", "from isojax.linen import heads\n", "nnx/ (layer 3) imports"),
        ("nnx/bad.py", "from isojax.training import loop\n", "nnx/ (layer 3) imports"),
        ("models/bad.py", "from isojax.linen import encoder\n", "models/ (layer 2) imports"),
        ("models/bad.py", "from isojax.data import glue\n", "models/ (layer 2) imports"),
        ("models/bad.py", "import flax.linen as nn\n", "models/ imports flax.linen"),
        ("cli/bad.py", "from isojax.core.stats import _flatten\n", "imports the private"),
        ("runs/bad.py", "from isojax.data import glue\nglue._rows()\n", "reads the private"),
    ],
)
def test_a_planted_violation_is_reported(tmp_path, file, source, message):
    root = tmp_path / "isojax"
    for unit in ("core", "linen", "nnx", "models", "cli", "runs"):
        (root / unit).mkdir(parents=True, exist_ok=True)
    (root / "core" / "ok.py").write_text("import jax\nfrom isojax.core import stats\n")
    assert violations(root) == []
    (root / file).write_text(source)
    (found,) = violations(root)
    assert message in found and file in found


def _module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """`{dotted name: file}` of every module of the package at `root` (a package by its name)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_cycles(root: pathlib.Path) -> list[list[str]]:
    """Every cycle of module imports in the package at `root` (each import counts, typing-only
    ones too; `from pkg import mod` is an import of `pkg.mod`), each once."""
    files = _module_files(root)
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for _, imported, names in _imports(ast.parse(path.read_text()), package):
            subs = {f"{imported}.{n}" for n in names} & files.keys()
            edges |= subs or ({imported} & files.keys())
        graph[name] = edges - {name}
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among the package's modules (the loop and the evaluation were one)."""
    assert import_cycles(PACKAGE) == []


def test_a_planted_cycle_is_found(tmp_path):
    pkg = tmp_path / "isojax"
    (pkg / "training").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "training" / "__init__.py").write_text("")
    (pkg / "training" / "loop.py").write_text("from isojax.training import evaluation\n")
    typing_only = "if TYPE_CHECKING:\n    from isojax.training.loop import Run\n"
    (pkg / "training" / "evaluation.py").write_text(
        f"from typing import TYPE_CHECKING\n{typing_only}"
    )
    assert import_cycles(pkg) == [
        ["isojax.training.evaluation", "isojax.training.loop", "isojax.training.evaluation"]
    ]
