"""The committed seed of test seconds: each test file's seconds in the last full suite here,
which orders a clean clone's files longest first (tests/conftest.py) before pytest's cache has
a record of its own. Refresh it after a full run of the suite:

    python -m tests.seconds      # .pytest_cache's records -> tests/test_seconds.json

Only the tests that pytest collects now count: the cache keeps the records of a removed or
renamed test for as long as its file exists (tests/conftest.py), which would inflate its file.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
SEED = HERE / "test_seconds.json"
CACHE = HERE.parent / ".pytest_cache" / "v" / "isojax" / "test_seconds"


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id."""
    return nodeid.split("::", 1)[0]


def per_file(records: dict[str, float], only: set[str] | None = None) -> dict[str, float]:
    """Seconds per test file, summed over its tests' records (`node id -> seconds`), those of
    the node ids in `only` if given."""
    files: dict[str, float] = {}
    for nodeid, seconds in records.items():
        if only is not None and nodeid not in only:
            continue
        file = file_of(nodeid)
        files[file] = files.get(file, 0.0) + seconds
    return {file: round(files[file], 1) for file in sorted(files)}


def read_seed() -> dict[str, float]:
    return json.loads(SEED.read_text()) if SEED.is_file() else {}


def collected() -> set[str]:
    """The node ids of every test the suite has now (`pytest --collect-only`, one process)."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist"],
        cwd=HERE.parent, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {line for line in out.splitlines() if "::" in line}


def main() -> None:
    files = per_file(json.loads(CACHE.read_text()), only=collected())
    SEED.write_text(json.dumps(files, indent=0, sort_keys=True) + "\n")
    print(f"{SEED}: {len(files)} files, {sum(files.values()):.0f} s")


if __name__ == "__main__":
    main()
