"""Imported by Python at the start of every child process of the tests: `children.child_env`
puts this folder on PYTHONPATH. The children share the session's compilation cache and, like
the test processes, skip jax's eviction scans (`children.skip_eviction_scans`)."""

import importlib.util
import pathlib
import sys

_spec = importlib.util.spec_from_file_location(
    "children", pathlib.Path(__file__).resolve().parents[1] / "children.py"
)
_children = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_children)
sys.meta_path.insert(0, _children.SkipEvictionScansOnImport())
