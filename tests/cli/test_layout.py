"""The command's house (issue 60): `isojax/cli/__init__.py` reads top-down (`main` first, under
150 lines, one module per command); no library module imports `experiments` or reaches into the
checkout's `experiments/` by path; one loader reads `get_config` files."""

import ast
import pathlib

import pytest
from helpers import REPO

from isojax import cli

PACKAGE = REPO / "isojax"


def definitions(path: pathlib.Path) -> list[str]:
    """The names of the top-level functions and classes of `path`, in order."""
    tree = ast.parse(path.read_text())
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body if isinstance(node, kinds)]


def experiments_reached(root: pathlib.Path) -> list[str]:
    """`file:line` of each import of `experiments` (`import experiments...`, `from
    experiments... import`, `importlib.import_module("experiments...")`) and each string
    naming the checkout's folder (`"experiments"`, `"experiments/..."`) in the package at
    `root`; docstrings and comments do not count."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in docstrings:
                    names = [node.value.replace("/", ".")]
            if any(name == "experiments" or name.startswith("experiments.") for name in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_cli_init_is_main_first_and_under_150_lines():
    path = PACKAGE / "cli" / "__init__.py"
    assert len(path.read_text().splitlines()) < 150
    assert definitions(path) == ["main", "build_parser"]
    # One module per command, each adding its own sub-parser.
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert list(sub.choices) == list(cli.COMMANDS) == ["finetune", "analyze", "export", "predict"]
    modules = {name: sub.choices[name].get_default("run").__module__ for name in cli.COMMANDS}
    assert modules == {
        "finetune": "isojax.cli.finetune",
        "analyze": "isojax.cli.analyze",
        "export": "isojax.cli.runs",
        "predict": "isojax.cli.runs",
    }


def test_no_library_module_reaches_the_experiments():
    assert experiments_reached(PACKAGE) == []


@pytest.mark.parametrize(
    "source",
    [
        "from experiments.bench import train_speed\n",
        "def f():\n    import experiments.study\n",
        "import importlib\nmod = importlib.import_module('experiments.bench')\n",
        "import pathlib\nBENCH = pathlib.Path(__file__).parents[2] / 'experiments' / 'bench'\n",
    ],
)
def test_a_planted_reach_into_the_experiments_is_found(tmp_path, source):
    root = tmp_path / "isojax"
    (root / "cli").mkdir(parents=True)
    (root / "cli" / "ok.py").write_text('"""Run `python -m experiments.bench.NAME`."""\n')
    assert experiments_reached(root) == []
    (root / "cli" / "bad.py").write_text(source)
    assert experiments_reached(root) == [f"isojax/cli/bad.py:{source.count(chr(10))}"]


def test_one_loader_reads_get_config_files():
    """Only `isojax.training.configs` loads a Python file by path: the CLI's `--config`, the
    examples and the study's grid files go through its `load` (or `find`/`get_config`), and
    the benchmarks import each other as modules."""
    loaders = [
        str(path.relative_to(REPO))
        for folder in ("isojax", "experiments")
        for path in sorted((REPO / folder).rglob("*.py"))
        if "spec_from_file_location" in path.read_text()
    ]
    assert loaders == ["isojax/training/configs/__init__.py"]
