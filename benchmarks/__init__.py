"""Benchmarks and probes, run from the repository root as `python -m benchmarks.<name>` (not part of the wheel)."""
