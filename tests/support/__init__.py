"""Test support code: what the tests build and measure with, not tests themselves. `instruments` (the op counter,
the saved-activation meter) is here; the tiny models, the oracles, the refusal table and the local Hub server are
to follow. Tests import it as `support.<module>` (tests/ is on pytest's path); the lab's benchmarks, run from the
repository root, as `tests.support.<module>`."""
