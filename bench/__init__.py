"""Benchmarks (run as ``python -m bench.<name>``); measured results live in ``docs/benchmarks.md``."""
