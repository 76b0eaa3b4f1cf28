"""Benchmarks, each a module: `python -m experiments.bench.NAME [ARGS]` from the checkout's root
(docs/guides/benchmarks.md); one that builds on another imports it
(`from experiments.bench import train_speed`)."""

import os


def cpu_offline() -> None:
    """What a CPU benchmark sets before its first JAX computation: JAX on the CPU unless
    `JAX_PLATFORMS` names a platform, the Hugging Face hub offline (the weights are packages or
    folders)."""
    import jax

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    jax.config.update("jax_platforms", os.environ.setdefault("JAX_PLATFORMS", "cpu"))
