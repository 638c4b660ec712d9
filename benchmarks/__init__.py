"""Benchmarks and probes, run from the repository root as `python -m benchmarks.<name>` (not part of the wheel)."""

import json
import os

from torch.utils._python_dispatch import TorchDispatchMode


def write_json(path, obj):
    """Write a benchmark's results to `path` (its folder created), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


class CountOps(TorchDispatchMode):
    """Counts the tensor operations (ATen calls) dispatched inside the `with` block: at small widths each costs about
    the same fixed overhead, so counts compare per-token work exactly where times on a shared CPU are noisy."""

    def __enter__(self):
        self.count = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
