"""Benchmarks: `make bench` (bench/run.py) prints one table per section."""


class SkipSection(Exception):
    """Raised by a section's `table()` when it cannot run here (no GPU, no model)."""
