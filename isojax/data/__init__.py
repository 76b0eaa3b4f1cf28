"""GLUE data: tasks and sources (`glue`), tokenisation and fixed-shape batches (`batching`)."""

from isojax.data import batching, glue

__all__ = ["batching", "glue"]
