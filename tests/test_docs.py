"""The documentation cannot rot (issue 37): the docstring examples run as doctests, the study
findings page's verdict lines are the study report's own, and `bash experiments/docs.sh`
builds with every warning an error (a broken cross-reference or a missing API page fails).
The Python blocks of docs/**/*.md run in tests/test_readme.py."""

from __future__ import annotations

import doctest
import importlib
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
# The committed study with the fewest records: a fixed, small JSONL (9 runs and 1 pre-trained
# evaluation) whose report has verdict lines of three families.
SMALL_JSONL = EXPERIMENTS / "results" / "cosreg.jsonl"


@pytest.mark.parametrize("module", ["isojax", "isojax.linen", "isojax.nnx"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), verbose=False)
    assert result.attempted > 0, f"{module} has no >>> example"
    assert result.failed == 0


def _report_verdicts(markdown: str) -> list[str]:
    section = markdown.split("## Verdicts (SPEC.md §9)", 1)[1]
    section = re.split(r"^## ", section, maxsplit=1, flags=re.MULTILINE)[0]
    return [line for line in section.splitlines() if line.startswith("- ")]


def test_findings_verdict_lines_are_the_reports(tmp_path):
    from experiments.report import findings
    from experiments.report import page as report

    jsonl = tmp_path / SMALL_JSONL.name
    shutil.copy(SMALL_JSONL, jsonl)
    lines = findings.study_verdicts(jsonl)
    written = report.write_report(jsonl).read_text()
    assert lines and lines == _report_verdicts(written)
    page = findings.render({"cosreg": lines}, {})
    for line in lines:  # every verdict line lands in the page's table, once
        m = findings.LINE.match(line)
        assert m, line
        assert page.count(f"**{m['verdict']}** | {findings._cell(m['details'], 'cosreg')} |") >= 1


def test_findings_page_names_every_claim():
    from experiments.report import findings

    page = findings.render({}, {})
    for claim in findings.CLAIMS:
        assert page.count(f"| {claim.text} |") == 1, claim.text
        assert claim.untestable in page


@pytest.mark.e2e
@pytest.mark.slow
def test_docs_build_without_warnings():
    done = subprocess.run(
        ["bash", str(EXPERIMENTS / "docs.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={"PATH": str(pathlib.Path(sys.executable).parent) + ":/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    html = REPO / "docs" / "_build" / "html"
    for page in ("index", "api/generated/isojax.linen.IsoBN", "study/findings", "guides/istar"):
        assert (html / f"{page}.html").is_file(), page


def test_every_test_file_the_pages_and_code_name_exists():
    """A page or docstring that cites `tests/...py` as evidence names a file that exists (the
    test layout moved every file once; CHANGELOG, a record of the past, is left out)."""
    sources = [REPO / "README.md", REPO / "ARCHITECTURE.md", *(REPO / "docs").rglob("*.md")]
    sources += [*(REPO / "isojax").rglob("*.py"), *(REPO / "experiments").rglob("*.py")]
    missing = [
        f"{path.relative_to(REPO)}: {name}"
        for path in sources
        if "_build" not in path.parts
        for name in sorted(set(re.findall(r"tests/[\w/]+\.py", path.read_text())))
        if not (REPO / name).exists()
    ]
    assert not missing, missing


# A backticked dotted name under `isojax` (``isojax.x``, `isojax.x.y(...)`, :mod:`~isojax.x`).
ISOJAX_NAME = re.compile(r"`~?(isojax(?:\.[A-Za-z_]\w*)+)")


def resolve(name: str) -> bool:
    """Whether `isojax.a.b.c` names something: the longest importable module prefix, then
    attributes (an extra that is not installed counts as resolving)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name and not err.name.startswith("isojax"):
                return True
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def stale_names(paths) -> list[str]:
    """`path: name` of every backticked `isojax.…` name in `paths` that does not resolve."""
    return [
        f"{path.relative_to(REPO)}: {name}"
        for path in paths
        for name in sorted(set(ISOJAX_NAME.findall(path.read_text())))
        if not resolve(name)
    ]


def test_every_isojax_name_the_docs_and_docstrings_cite_resolves():
    """docs/ (the changelog, a record of old names, left out), README, ARCHITECTURE and every
    module of the package: each backticked `isojax.…` name imports (`resolve`)."""
    pages = [REPO / "README.md", REPO / "ARCHITECTURE.md", *(REPO / "docs").rglob("*.md")]
    pages = [p for p in pages if "_build" not in p.parts and p.name != "changelog.md"]
    stale = stale_names([*pages, *sorted((REPO / "isojax").rglob("*.py"))])
    assert not stale, stale


def test_a_stale_name_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("See `isojax.training.loop.train_and_evaluate` and `isojax.train.setup`.")
    assert stale_names([page]) == ["page.md: isojax.train.setup"]
