"""Benchmarks and probes, run from the repository root as `python -m benchmarks.<name>` (not part of the wheel)."""

import json
import os


def write_json(path, obj):
    """Write a benchmark's results to `path` (its folder created), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
