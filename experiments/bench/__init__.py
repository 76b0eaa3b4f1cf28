"""Benchmarks, each a script: `python experiments/bench/NAME.py` (docs/guides/benchmarks.md)."""
