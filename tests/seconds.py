"""The committed seed of test seconds: each test file's seconds in the last full suite here,
which orders a clean clone's files longest first (tests/conftest.py) before pytest's cache has
a record of its own. Refresh it after a full run of the suite:

    python -m tests.seconds      # .pytest_cache's records -> tests/test_seconds.json
"""

from __future__ import annotations

import json
import pathlib

HERE = pathlib.Path(__file__).resolve().parent
SEED = HERE / "test_seconds.json"
CACHE = HERE.parent / ".pytest_cache" / "v" / "isojax" / "test_seconds"


def file_of(nodeid: str) -> str:
    """The test file of a pytest node id."""
    return nodeid.split("::", 1)[0]


def per_file(records: dict[str, float]) -> dict[str, float]:
    """Seconds per test file, summed over its tests' records (`node id -> seconds`)."""
    files: dict[str, float] = {}
    for nodeid, seconds in records.items():
        file = file_of(nodeid)
        files[file] = files.get(file, 0.0) + seconds
    return {file: round(files[file], 1) for file in sorted(files)}


def read_seed() -> dict[str, float]:
    return json.loads(SEED.read_text()) if SEED.is_file() else {}


def main() -> None:
    files = per_file(json.loads(CACHE.read_text()))
    SEED.write_text(json.dumps(files, indent=0, sort_keys=True) + "\n")
    print(f"{SEED}: {len(files)} files, {sum(files.values()):.0f} s")


if __name__ == "__main__":
    main()
