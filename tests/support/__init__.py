"""Test support code: what the tests build and measure with, not tests themselves (the tiny models and data, the
oracles, the refusal table, the local Hub server, the instruments; tests/README.md lists them). Tests import it as
`support.<module>` (tests/ is on pytest's path); the lab's benchmarks, run from the repository root, as
`tests.support.<module>`."""

import signal
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout
TESTS_DIR = REPO_ROOT / "tests"  # on the path of a test run in a subprocess, for `support` and the tests' own modules


def sigint_as_in_a_terminal():
    """`preexec_fn` of a run that a test ends by SIGINT: the handler a terminal's Ctrl-C meets. A run of pytest
    started as a shell's background job (`cmd &`) has SIGINT ignored, and its children would inherit that and never
    raise KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
