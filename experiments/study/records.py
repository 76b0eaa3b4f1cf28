"""A study's results file (one JSON line per recorded cell) and the locks that let several
`runner.py` runners share one grid: the results file's lock and a claim per cell (issue 25,
items 2 and 3).

`read_records` reads the lines (a torn, non-JSON or non-record line is refused, naming it; so
are a folder and a file that is not UTF-8 text); `write_record`
appends one line in one `write`, or replaces a failed line of the same cell (the file rewritten
to a temporary and renamed), under the results lock.

The locks are `fcntl.flock` locks on an open file. The kernel drops such a lock when its
holder closes the file or dies (SIGKILL, a lost session), so a lock is never stale: nothing
needs cleaning up after a crash, and the files themselves stay behind, empty or naming the
last holder, and mean nothing. Runners on several machines need a shared disk whose flock reaches
every machine (local disks; NFSv4, where Linux maps flock to POSIX byte-range locks).

- `results_lock(path)`: `<path>.lock` beside the results JSONL, held while a line is written
  (appended, or a failed line replaced by rewriting the file). Keyed by the results file
  itself, so two runners that share it but not a `--runs-dir` still exclude each other.
- `claim(workdir)`: `<workdir>/.study_claim`, held while a runner trains the cell in that
  folder. Taken without waiting: a held claim returns its holder's description ("pid 1234 on
  host-a since 19:02:11 UTC"), and the runner goes on to the next free cell.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import pathlib
import socket
from collections.abc import Iterator

CLAIM_FILE = ".study_claim"


class StudyError(ValueError):
    """A grid, results file or option the runner refuses: one line, exit status 2."""


def lock_path_of(results: pathlib.Path) -> pathlib.Path:
    """The results file's lock: `<results>.lock` in the same folder."""
    return results.with_name(results.name + ".lock")


@contextlib.contextmanager
def results_lock(results: pathlib.Path, *, create: bool = True) -> Iterator[None]:
    """Holds the exclusive lock of `results` (waiting for it) for the `with` block; without
    `create`, the lock file must exist (it is opened to read, and nothing is written)."""
    lock = lock_path_of(results)
    if create:
        lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a" if create else "r") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class Claim:
    """A held claim on a cell's folder; `release()` (or the holder's exit) frees it."""

    def __init__(self, fd: int, path: pathlib.Path):
        self._fd, self.path = fd, path

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def claim(workdir: pathlib.Path) -> Claim | str:
    """Claims `workdir` for this process: a `Claim`, or, when another process holds it, that
    holder's description (read from the claim file, which the holder wrote after locking)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / CLAIM_FILE
    # No O_TRUNC: the file names the holder, and a refused opener must still read it.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with open(path) as handle:
            holder = handle.read().strip()
        os.close(fd)
        return holder or "another process (starting)"
    except BaseException:
        os.close(fd)
        raise
    now = datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S UTC")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}\n".encode(), 0)
    return Claim(fd, path)


def holder(workdir: pathlib.Path) -> str | None:
    """Who holds `workdir`'s claim now (None: nobody); takes and drops the claim if free."""
    if not (workdir / CLAIM_FILE).exists():
        return None
    got = claim(workdir)
    if isinstance(got, Claim):
        got.release()
        return None
    return got


# What the runner, its estimates and `analyze` read from every record ("full"), by type: a
# record of another shape is one line naming its line, not a traceback deep in the runner.
TYPES = {
    "study": str, "cell": str, "kind": str, "status": str, "config_hash": str, "fields": dict,
    "seed": int, "eval": list, "wall_minutes": (int, float),
}  # fmt: skip
FIELD_TYPES = {"task": str, "method": str}
STATUSES = ("ok", "failed")


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def _wrong(row: dict, types: dict, where: str = "") -> str | None:
    """The first key of `types` that `row` lacks or holds with another type (a bool is no int)."""
    for key, kind in types.items():
        if key not in row:
            return f"no {where}{key!r}"
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{where}{key} is {value!r}, a {_type_name(value)}"
    return None


def not_a_record(record, full: bool) -> str | None:
    """Why `record` is not a study record (None: it is): not a JSON object, or without a `cell`
    and a `status`; with `full`, a key of `TYPES` (or of its fields, `FIELD_TYPES`) missing or
    of another type, or an eval row that is not an object with an `epoch`."""
    if not isinstance(record, dict):
        return f"a JSON {_type_name(record)}, not an object"
    wrong = _wrong(record, TYPES if full else {"cell": str, "status": str})
    if full and not wrong:
        wrong = _wrong(record["fields"], FIELD_TYPES, "fields.")
    if wrong:
        return wrong
    if record["status"] not in STATUSES:
        return f"status is {record['status']!r}, not one of {STATUSES}"
    for index, row in enumerate(record["eval"] if full else ()):
        if not isinstance(row, dict) or "epoch" not in row:
            return f"its eval row {index} is not an object with an 'epoch'"
    return None


def _text(path: pathlib.Path) -> str:
    """The results file's text; a folder, an unreadable file or bytes that are not UTF-8 raise
    StudyError, naming it (and the line of the first bad byte)."""
    if path.is_dir():
        raise StudyError(f"{path} is a folder, not a results file (a JSONL)")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise StudyError(f"{path}: cannot be read ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise StudyError(
            f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x}): not a results file"
        ) from None


def read_records(path: pathlib.Path, *, full: bool = False) -> list[dict]:
    """The lines of a results JSONL (empty if there is none); a bad line raises, naming it: not
    JSON, or not a record (`not_a_record`; `full`: every key the runner reads, typed)."""
    if not path.exists():
        return []
    text = _text(path)
    if text and not text.endswith("\n"):
        raise StudyError(f"{path}: the last line is unfinished (a torn write); remove it")
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise StudyError(f"{path}:{number}: not JSON ({err})") from None
        what = not_a_record(record, full)
        if what:
            raise StudyError(f"{path}:{number}: not a study record ({what})")
        records.append(record)
    return records


def read_records_locked(
    path: pathlib.Path, *, full: bool = True, create: bool = True
) -> list[dict]:
    """`read_records` under the results lock (no line half-written by another runner). Without
    `create` (a dry run, which writes nothing), a lock file that does not exist yet is not made:
    no runner has written the file then, and it is read as it is."""
    if path.is_dir():
        raise StudyError(f"{path} is a folder, not a results file (a JSONL)")
    if not create and not lock_path_of(path).exists():
        return read_records(path, full=full)
    with results_lock(path, create=create):
        return read_records(path, full=full)


def write_record(path: pathlib.Path, record: dict) -> None:
    """Appends `record` as one line, in one `write`; a failed line of the same cell is replaced
    (the file rewritten to a temporary and renamed); any other line of the cell raises. Under
    `<path>.lock` (`results_lock`), whoever else writes to `path`."""
    line = json.dumps(record, sort_keys=True, allow_nan=True) + "\n"
    if path.is_dir():
        raise StudyError(f"{path} is a folder, not a results file (a JSONL)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with results_lock(path):
        records = read_records(path)
        same = [r for r in records if r["cell"] == record["cell"]]
        if any(r["status"] != "failed" for r in same):
            raise StudyError(f"{path}: cell {record['cell']} is recorded already")
        if same:
            kept = [r for r in records if r["cell"] != record["cell"]]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept) + line)
            os.replace(tmp, path)
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
