"""Sphinx configuration: MyST Markdown guides, the API reference by autosummary/autodoc of the
curated modules (`isojax`, `isojax.linen`, `isojax.nnx`, `isojax.models`, `isojax.data`).
Built by `bash experiments/docs.sh` with warnings as errors: a broken cross-reference or an API
page that does not import fails the build."""

import inspect
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import isojax  # noqa: E402

project = "isojax"
author = "the isojax authors"
copyright = "2026, the isojax authors"
release = version = isojax.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

templates_path = ["_templates"]
autosummary_generate = True
autosummary_ignore_module_all = False  # a curated module's page lists its __all__
autosummary_imported_members = False
autodoc_typehints = "none"  # the docstrings name shapes and dtypes
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields, not a second entry beside autodoc's
nitpicky = False

html_theme = "furo"
html_title = f"isojax {release}"


# isojax's docstrings are written to read as plain text and Markdown (`code`, indented examples
# after a colon, *emphasis* beside operators such as `**hparams`). Before napoleon reads the
# Google sections, this turns them into the reStructuredText autodoc parses: single backticks
# become literals, a stray `*` is escaped, and a block indented under a paragraph line (outside
# the Args/Returns sections) becomes a literal block, closed by a blank line.
SECTION = re.compile(
    r"^\s*(Args|Arguments|Returns|Yields|Raises|Attributes|Examples?|References|Notes?|"
    r"Keyword Args|Warns|See Also|Todo):\s*$"
)
TICK = re.compile(r"(?<![`:\w])`([^`]+)`(?![`_])")
FIELDS = re.compile(r"^\s*(Args|Arguments|Attributes|Keyword Args|Raises):")
BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
STAR = re.compile(r"(?<!\*)\*(?!\*)")


def _word_after(m: re.Match) -> bool:
    return m.end() < len(m.string) and (m.string[m.end()].isalnum())


def _inline(line: str) -> str:
    if line.lstrip().startswith((">>>", "...")):
        return line
    line = TICK.sub(lambda m: f"``{m[1]}``" + ("\\ " if _word_after(m) else ""), line)
    parts = re.split(r"(``[^`]+``(?:\\ )?|:math:`[^`]+`|`[^`]+`_)", line)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            part = STAR.sub(r"\\*", part).replace("|", "\\|")
        out.append(part)
    return "".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_docstring(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_section, literal_at, section = None, None, ""
    for line in lines:
        if not line.strip():
            out.append(line)
            continue
        ind = _indent(line)
        if literal_at is not None and ind <= literal_at:
            literal_at = None
            if out and out[-1].strip():
                out.append("")
        if literal_at is not None:
            out.append(line)
            continue
        if SECTION.match(line):
            in_section, section = ind, line
            out.append(line)
            continue
        if in_section is not None and ind <= in_section:
            in_section = None
        elif in_section is not None and not FIELDS.match(section) and out[-1].strip():
            if ind < _indent(out[-1]):  # a definition list inside Returns/Yields ends here
                out.append("")
        prev = next((p for p in reversed(out) if p.strip()), None)
        prev_blank = bool(out) and not out[-1].strip()
        bullet = prev is not None and BULLET.match(prev)
        if (
            in_section is None
            and prev is not None
            and ind > _indent(prev)
            and not (bullet and ind == bullet.end())  # a list item's next line
            and not line.lstrip().startswith((">>>", "..."))
        ):
            literal_at = _indent(prev)
            if prev_blank:
                out[-1:] = []
            if not out[-1].rstrip().endswith("::"):
                out[-1] = out[-1].rstrip() + ("::" if out[-1].rstrip().endswith(":") else " ::")
            out += ["", line]
            continue
        out.append(line if line.lstrip().startswith((">>>", "...")) else _inline(line))
    return out


def _process(app, what, name, obj, options, lines):
    own = getattr(type(obj), "__doc__", None)
    if what in ("data", "attribute") and lines and isinstance(own, str) and own.strip():
        if lines[0].strip() == own.strip().splitlines()[0].strip():
            lines[:] = []  # a constant's type's docstring (dict, tuple), not the constant's
            return
    lines[:] = rst_docstring(list(lines))


def _noindex() -> set[str]:
    """The curated names that repeat an object an earlier curated module documents (the linen
    `Encoder` is `isojax.linen.Encoder`): their pages are written with `:no-index:`."""
    import importlib

    seen, repeated = set(), set()
    for module in (
        "isojax", "isojax.linen", "isojax.nnx", "isojax.models", "isojax.data",
        "isojax.training", "isojax.runs", "isojax.analysis",
    ):  # fmt: skip
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            key = f"{obj.__module__}.{obj.__qualname__}"
            if key in seen:
                repeated.add(f"{module}.{name}")
            seen.add(key)
    return repeated


autosummary_context = {"noindex": _noindex()}


# The study findings page (generated by experiments/report/findings.py) links the reports beside
# their JSONLs, experiments/results/<study>.md, as the repository lays them out. The build copies
# them (with their figures) into study/reports/ (git-ignored) and points the page's links there.
RESULTS = ROOT / "experiments" / "results"
REPORTS = pathlib.Path(__file__).resolve().parent / "study" / "reports"


def _copy_reports(app, config):
    shutil.rmtree(REPORTS, ignore_errors=True)
    REPORTS.mkdir(parents=True)
    # A study's report and its figures; GPU records' (results/gpu/) into reports/gpu/.
    for jsonl in [*RESULTS.glob("*.jsonl"), *RESULTS.glob("gpu/*.jsonl")]:
        report = jsonl.with_suffix(".md")
        if report.exists():
            out = REPORTS / jsonl.parent.relative_to(RESULTS)
            out.mkdir(parents=True, exist_ok=True)
            text = report.read_text()
            (out / report.name).write_text("---\norphan: true\n---\n\n" + text)
            for png in jsonl.parent.glob(f"{jsonl.stem}_*.png"):
                shutil.copy(png, out / png.name)


def _findings_links(app, docname, source):
    if docname == "study/findings":
        source[0] = source[0].replace("](../../experiments/results/", "](reports/")


def setup(app):
    app.connect("autodoc-process-docstring", _process, priority=400)
    app.connect("config-inited", _copy_reports)
    app.connect("source-read", _findings_links)
