"""Checkpoints of the whole train state plus the data position, with orbax.

    ckpt = checkpointing.Checkpointer(workdir / "checkpoints", max_to_keep=2)
    ckpt.save(step, state, {"epoch": 1, "batch": 40})
    restored = ckpt.restore(abstract_state)   # None, or (state, position) of the newest usable

Atomic: orbax's `CheckpointManager` writes each step into a temporary folder and renames it
once complete (`commit_success`), so a run killed while saving leaves the previous checkpoint
as the newest one. A newest checkpoint that exists but cannot be read (a truncated file, a
disk error) is reported with a `RuntimeWarning` and renamed `<step>.unreadable` (orbax then
ignores it), and the one before it is used. `train_and_evaluate` refuses beforehand to
resume with a config that changes the run, so a mismatch is never mistaken for damage.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from typing import Any

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores `(train state, position dict)` pairs under one folder, by step.

    Args:
      directory: the checkpoint folder (created if missing); one sub-folder per step.
      max_to_keep: how many of the newest checkpoints to keep (>= 2 keeps a fallback).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 2):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def all_steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, position: dict) -> None:
        """Writes `state` (any pytree of arrays) and the JSON-able `position` as `step`.

        Blocks until the checkpoint is committed. A step saved already is left as it is.
        """
        if step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), position=ocp.args.JsonSave(position)
            ),
        )
        self._manager.wait_until_finished()

    def restore(self, abstract_state: Any) -> tuple[Any, dict] | None:
        """The newest readable checkpoint as `(state, position)`, or None if there is none.

        Args:
          abstract_state: a pytree like the saved state whose leaves are arrays or
            `jax.ShapeDtypeStruct`s with the wanted sharding (`ocp.utils.to_shape_dtype_struct`).

        Raises:
          RuntimeError: checkpoints exist but none of them can be read.
        """
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        steps = self.all_steps()
        for i, step in enumerate(reversed(steps)):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), position=ocp.args.JsonRestore()
                    ),
                )
            except Exception as err:  # noqa: BLE001 - any read error means: fall back
                older = steps[-2 - i] if i + 1 < len(steps) else None
                warnings.warn(
                    f"checkpoint step {step} in {self.directory} cannot be restored "
                    f"({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                    + (f"falling back to step {older}" if older is not None else "none left"),
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._set_aside(step)
                continue
            return restored.state, dict(restored.position)
        if steps:
            raise RuntimeError(f"no checkpoint in {self.directory} can be restored")
        return None

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
