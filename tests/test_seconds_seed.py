"""The committed seed of test seconds (tests/seconds.py) that orders a clean clone's files."""

import seconds


def test_per_file_sums_each_files_tests():
    records = {"tests/a.py::t1": 1.25, "tests/a.py::t2[x]": 2.0, "tests/b/c.py::t": 0.5}
    assert seconds.per_file(records) == {"tests/a.py": 3.2, "tests/b/c.py": 0.5}
    # a record whose test is gone (renamed, removed) is left out when the collected ids are known
    assert seconds.per_file(records, only={"tests/a.py::t1", "tests/b/c.py::t"}) == {
        "tests/a.py": 1.2,
        "tests/b/c.py": 0.5,
    }


def test_the_committed_seed_names_test_files_with_their_seconds():
    seed = seconds.read_seed()
    assert seed, "tests/test_seconds.json is missing: python -m tests.seconds"
    assert all(f.startswith("tests/") and f.endswith(".py") and s >= 0 for f, s in seed.items())
