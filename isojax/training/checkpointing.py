"""Checkpoints of the whole train state plus the data position, with orbax.

    ckpt = checkpointing.Checkpointer(workdir / "checkpoints", max_to_keep=2)
    ckpt.save(step, state, {"epoch": 1, "batch": 40})
    restored = ckpt.restore(abstract_state)   # None, or (state, position) of the newest usable

Atomic: orbax's `CheckpointManager` writes each step into a temporary folder and renames it
once complete (`commit_success`), so a run killed while saving leaves the previous checkpoint
as the newest one. A newest checkpoint that exists but cannot be read (a truncated file, a
disk error) is reported in a logged warning and renamed `<step>.unreadable` (orbax then
ignores it), and the one before it is used. A reader (`read_only=True`: `isojax predict`,
`export`, `analyze --run`) falls back the same way but renames, creates and deletes nothing.

A save that fails for want of space (`ENOSPC`, also a quota's `EDQUOT`) removes its own
unfinished folder and raises `CheckpointWriteError`, one line naming the folder and the error:
the checkpoints saved before stay as they were. Orbax's writer threads die with a traceback
for each array write that the full disk cut short ("Event loop is closed"), some of them after
the save has raised, absl logs each failure, and asyncio logs their tasks' errors when they are
collected: a save catches its threads' exceptions (`threading.excepthook`, and for
tensorstore's C++ threads `sys.unraisablehook` and `sys.excepthook`; logged here at DEBUG),
filters the absl and asyncio records (`isojax.logs.quieted`, a `logging.Filter`), and after a
full disk waits for those threads to fall quiet and collects the tasks, so that the
one line is all a user reads. Nothing swaps `sys.stderr`.

A checkpoint that reads fine but holds another train state (a code or config change added,
removed, reshaped or retyped an array) is not damage: `restore` raises `CheckpointMismatch`,
naming each differing array, and leaves every file where it is. The check compares the saved
metadata (names, shapes, dtypes) with the requested state before any array is read. A state
that names its older layouts (`older_layouts()`: an NNX run saved by isojax 0.4.0 in linen's
tree) is read in the one its checkpoint holds and converted.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from isojax.logs import quieted

logger = logging.getLogger(__name__)


class CheckpointMismatch(ValueError):
    """A readable checkpoint whose arrays differ from the requested train state."""


class CheckpointNotFound(ValueError):
    """No checkpoint at the requested step."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written for want of space (one-line message naming the
    folder); the older checkpoints are kept."""


# What a full disk looks like inside orbax's error (tensorstore reports the OS error code).
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded|os_error_code='(28|122)'")


def _no_space(err: BaseException) -> bool:
    """Whether `err` (or an error it wraps) is a full disk or an exhausted quota."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if _NO_SPACE.search(str(err)):
            return True
        err = err.__cause__ or err.__context__
    return False


class _ThreadErrors:
    """For the block, an error that ends a writer thread is logged at DEBUG (`log`) instead of
    printed: `threading.excepthook` for Python threads, and `sys.unraisablehook` and
    `sys.excepthook` for tensorstore's C++ threads, which print a callback's error with
    `PyErr_WriteUnraisable` or `PyErr_Print` ("Event loop is closed" after a full disk).
    `wait_until_quiet` returns once none has come for `quiet_s` (or after `limit_s`), for
    writer threads that fail after the save raised."""

    def __init__(self):
        self.last = time.monotonic()

    def _hook(self, args) -> None:  # threading.excepthook, sys.unraisablehook
        self._log(args.exc_value)

    def _excepthook(self, kind, value, traceback) -> None:  # sys.excepthook
        self._log(value)

    def _log(self, value: BaseException | None) -> None:
        self.last = time.monotonic()
        logger.debug("checkpoint writer thread: %r", value)

    @contextlib.contextmanager
    def caught(self):
        previous = threading.excepthook, sys.unraisablehook, sys.excepthook
        threading.excepthook, sys.unraisablehook, sys.excepthook = (
            self._hook,
            self._hook,
            self._excepthook,
        )
        try:
            yield self
        finally:
            threading.excepthook, sys.unraisablehook, sys.excepthook = previous

    def wait_until_quiet(self, quiet_s: float = 0.5, limit_s: float = 5.0) -> None:
        start = time.monotonic()
        while time.monotonic() - self.last < quiet_s and time.monotonic() - start < limit_s:
            time.sleep(0.05)


def _collect_quietly() -> None:
    """Collects garbage with the asyncio logger filtered: the tasks of the writes a full disk
    cut short log "Task exception was never retrieved" (asyncio ERROR) when collected."""
    with quieted("asyncio", logging.CRITICAL + 1):
        gc.collect()


class _Unreadable(Exception):
    """A checkpoint's files cannot be read (the cause is the read error)."""


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message` (at most 200 characters of it)."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def _array_specs(flat: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{"params.w": (shape, dtype name)}` of the array leaves of an orbax flat dict."""
    return {
        ".".join(map(str, key)): (tuple(leaf.shape), str(jax.numpy.dtype(leaf.dtype)))
        for key, leaf in flat.items()
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    }


def _differences(saved: dict, wanted: dict) -> list[str]:
    """One line per array that is missing, extra, or of another shape or dtype."""
    lines = [
        f"{name}: in the checkpoint, not in the train state"
        for name in saved.keys() - wanted.keys()
    ]
    lines += [
        f"{name}: in the train state, not in the checkpoint"
        for name in wanted.keys() - saved.keys()
    ]
    for name in saved.keys() & wanted.keys():
        (s_shape, s_dtype), (w_shape, w_dtype) = saved[name], wanted[name]
        if s_shape != w_shape or s_dtype != w_dtype:
            lines.append(
                f"{name}: saved {s_dtype}{list(s_shape)}, train state {w_dtype}{list(w_shape)}"
            )
    return sorted(lines)


def _specs(target: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """`_array_specs` of a state to restore into."""
    return _array_specs(
        ocp.tree.to_flat_dict(ocp.tree.serialize_tree(target, keep_empty_nodes=True))
    )


def _older_layouts(target: Any) -> tuple:
    """`((abstract state, convert), ...)`: the older layouts of a state that has them
    (`steps.TrainState.older_layouts`: an NNX run saved by isojax 0.4.0), else none."""
    layouts = getattr(target, "older_layouts", None)
    return layouts() if callable(layouts) else ()


REPLACED = ".replaced"  # a checkpoint being replaced by `Checkpointer.save`


def _put_back_replaced(directory: pathlib.Path) -> None:
    """After a kill during a replacing save: a `<step>.replaced` folder whose step was written
    again is removed, one whose step is missing is renamed back (process 0)."""
    if jax.process_index() != 0 or not directory.is_dir():
        return
    for path in directory.glob(f"*{REPLACED}"):
        step = directory / path.name.removesuffix(REPLACED)
        if step.exists():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.rename(step)


class Checkpointer:
    """Saves and restores `(train state, position dict)` pairs under one folder, by step.

    Args:
      directory: the checkpoint folder (created if missing); one sub-folder per step.
      max_to_keep: how many of the newest checkpoints to keep (>= 2 keeps a fallback).
      read_only: restore only: nothing under `directory` is created, renamed or deleted (an
        unreadable step is skipped, not set aside); `save` raises.
    """

    def __init__(
        self, directory: str | os.PathLike, *, max_to_keep: int = 2, read_only: bool = False
    ):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.read_only = read_only
        # orbax logs (absl WARNING) that a read-only manager neither saves nor deletes: that
        # is what was asked for.
        with quieted("absl", logging.ERROR if read_only else logging.NOTSET):
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=False,
                create=not read_only,
                read_only=read_only,
            )
            if not read_only:
                _put_back_replaced(self.directory)
            self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, position: dict) -> None:
        """Writes `state` (any pytree of arrays) and the JSON-able `position` as `step`.

        Blocks until the checkpoint is committed. Never a silent no-op: saved steps at or after
        `step` (which orbax would keep, skipping this one) are replaced by it, unless `step` is
        saved already with this very position (then nothing is written). Each is first renamed
        `<step>.replaced`, then removed once `step` is committed; after a kill in between, the
        next `Checkpointer` of the folder puts it back.

        Raises:
          CheckpointWriteError: the disk (or quota) is full; the unfinished folder of `step`
            is removed and the checkpoints before it are kept.
        """
        if self.read_only:
            raise ValueError(f"{self.directory}: opened read-only, cannot save step {step}")
        later = [s for s in self._manager.all_steps() if s >= step]
        if later == [step] and self._same_position(step, position):
            return
        aside = [self._move_aside(s) for s in later]
        try:
            self._write(step, state, position)
        except BaseException:
            _put_back_replaced(self.directory)  # the replaced steps are kept
            self._manager.reload()
            raise
        if jax.process_index() == 0:
            for path in aside:
                shutil.rmtree(path, ignore_errors=True)

    def _same_position(self, step: int, position: dict) -> bool:
        """Whether checkpoint `step` holds `position` (compared as JSON)."""
        saved = self._manager.restore(
            step, args=ocp.args.Composite(position=ocp.args.JsonRestore())
        ).position
        return json.loads(json.dumps(position)) == saved

    def _move_aside(self, step: int) -> pathlib.Path:
        """Renames checkpoint `step` to `<step>.replaced` (orbax ignores it) for `save`."""
        target = self.directory / f"{step}{REPLACED}"
        if jax.process_index() == 0:
            shutil.rmtree(target, ignore_errors=True)
            (self.directory / str(step)).rename(target)
        self._manager.reload()
        return target

    def _write(self, step: int, state: Any, position: dict) -> None:
        """Orbax's save of `step`, a full disk raised as `CheckpointWriteError`."""
        # orbax's writer threads log each failure with its traceback (absl ERROR) before the
        # save raises it, and die with the tracebacks of the writes it cut short (module
        # docstring): the one line below says it instead.
        full, threads = False, _ThreadErrors()
        with threads.caught(), quieted("absl", logging.CRITICAL + 1):
            try:
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state), position=ocp.args.JsonSave(position)
                    ),
                )
                self._manager.wait_until_finished()
            except Exception as err:
                if not _no_space(err):
                    raise
                full = True
            if full:  # outside the handler, so that the orbax error and its frames can go
                threads.wait_until_quiet()
                _collect_quietly()
        if full:
            self._remove_unfinished(step)
            kept = self.all_steps()
            raise CheckpointWriteError(
                errno.ENOSPC,
                f"cannot write checkpoint step {step} in {self.directory}: "
                f"{os.strerror(errno.ENOSPC)}; "
                + (f"the checkpoints of steps {kept} are kept" if kept else "no older checkpoint"),
            )

    def _remove_unfinished(self, step: int) -> None:
        """Deletes `<step>.orbax-checkpoint-tmp*`, the folder of a save that failed."""
        if jax.process_index() == 0:
            for path in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(path, ignore_errors=True)
        self._manager.reload()

    def restore(self, abstract_state: Any, *, step: int | None = None) -> tuple[Any, dict] | None:
        """The newest readable checkpoint (or the one at `step`) as `(state, position)`; None
        if there is none.

        Without `step`, only a read or format error of a checkpoint's files (truncated, empty,
        unparsable) sets that checkpoint aside (renamed, unless `read_only`) and falls back to
        the one before it. With `step`, that checkpoint alone is read and nothing is moved.

        Args:
          abstract_state: a pytree like the saved state whose leaves are arrays or
            `jax.ShapeDtypeStruct`s with the wanted sharding (`ocp.utils.to_shape_dtype_struct`).
          step: the step to restore; None: the newest readable one.

        Raises:
          CheckpointMismatch: the checkpoint holds other arrays (names, shapes or dtypes) than
            `abstract_state`; the message lists each difference, and no file is moved.
          CheckpointNotFound: (a `ValueError`) no checkpoint at `step`; the message lists the
            saved steps.
          RuntimeError: checkpoints exist but none of them (or not the one at `step`) can be
            read.
        """
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        wanted = _specs(target)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise CheckpointNotFound(
                    f"no checkpoint at step {step} in {self.directory}; saved steps: {steps}"
                )
            try:
                return self._read(step, target, wanted)
            except _Unreadable as err:
                raise RuntimeError(
                    f"checkpoint step {step} in {self.directory} cannot be restored "
                    f"({_one_line(err.__cause__)})"
                ) from err.__cause__
        for i, newest in enumerate(reversed(steps)):
            try:
                return self._read(newest, target, wanted)
            except _Unreadable as err:
                self._fall_back(steps, i, err.__cause__)
        if steps:
            raise RuntimeError(f"no checkpoint in {self.directory} can be restored")
        return None

    def _read(self, step: int, target: Any, wanted: dict) -> tuple[Any, dict]:
        """`(state, position)` of `step`; `CheckpointMismatch` for other arrays, `_Unreadable`
        (from the read error) for damaged files."""
        try:
            saved = self._saved_specs(step)
        except Exception as err:  # noqa: BLE001 - unreadable metadata: the files are damaged
            raise _Unreadable from err
        differences = _differences(saved, wanted)
        if differences:
            for older, convert in _older_layouts(target):
                if not _differences(saved, _specs(older)):
                    state, position = self._read(step, older, saved)
                    return convert(state), position
            raise CheckpointMismatch(
                f"checkpoint step {step} in {self.directory} does not hold this train state "
                f"(a code or config change?); {len(differences)} difference(s): "
                + "; ".join(differences[:20])
                + ("; ..." if len(differences) > 20 else "")
                + ". No file was moved."
            )
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), position=ocp.args.JsonRestore()
                ),
            )
        except Exception as err:  # noqa: BLE001 - the arrays match: a read error remains
            raise _Unreadable from err
        return restored.state, dict(restored.position)

    def _saved_specs(self, step: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Names, shapes and dtypes of the arrays saved at `step`, from its metadata file."""
        # orbax logs (absl WARNING) that a step's own metadata file is absent; the tree
        # metadata it reads here is there.
        with quieted("absl", logging.ERROR), ocp.StandardCheckpointer() as reader:
            metadata = reader.metadata(self.directory / str(step) / "state")
        return _array_specs(ocp.tree.to_flat_dict(metadata.item_metadata.tree))

    def _fall_back(self, steps: list[int], i: int, err: Exception) -> None:
        """Warns that the `i`-th newest step cannot be read, and sets it aside."""
        step = steps[-1 - i]
        older = steps[-2 - i] if i + 1 < len(steps) else None
        logger.warning(
            "checkpoint step %d in %s cannot be restored (%s); %s",
            step,
            self.directory,
            _one_line(err),
            f"falling back to step {older}" if older is not None else "none left",
        )
        if not self.read_only:
            self._set_aside(step)

    def _set_aside(self, step: int) -> None:
        """Renames an unreadable step folder to `<step>.unreadable[-k]` (kept for inspection,
        ignored by orbax), so that the step can be written again."""
        if jax.process_index() == 0:
            source = self.directory / str(step)
            target = self.directory / f"{step}.unreadable"
            k = 0
            while target.exists():
                k += 1
                target = self.directory / f"{step}.unreadable-{k}"
            source.rename(target)
        self._manager.reload()

    def close(self) -> None:
        """Releases orbax's background resources (also on leaving a `with` block)."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
