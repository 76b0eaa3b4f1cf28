"""GLUE data: the task registry (`tasks`), its sources (`glue`: TSVs and `load`; `tfds_source`),
tokenisation and fixed-shape batches (`batching`)."""

from isojax.data import batching, glue, tasks

__all__ = ["batching", "glue", "tasks"]
