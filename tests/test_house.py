"""The house rules that read the package's files (issue 60): no library file over 500 lines."""

import pathlib

import pytest

import isojax

PACKAGE = pathlib.Path(isojax.__file__).parent
MAX_LINES = 500


def too_long(root: pathlib.Path, limit: int = MAX_LINES) -> dict[str, int]:
    """`{path relative to root: lines}` of every Python file under `root` over `limit` lines."""
    lines = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in root.rglob("*.py")}
    return {str(p.relative_to(root)): n for p, n in sorted(lines.items()) if n > limit}


def test_no_library_file_is_over_500_lines():
    assert sum(1 for _ in PACKAGE.rglob("*.py")) > 50  # the package, not an empty folder
    assert too_long(PACKAGE) == {}


@pytest.mark.parametrize("lines, over", [(MAX_LINES, False), (MAX_LINES + 1, True)])
def test_the_count_sees_a_long_file(tmp_path, lines, over):
    """The twin: a file of 501 lines is named, one of 500 is not."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * lines)
    assert too_long(tmp_path) == ({"sub/long.py": lines} if over else {})
