#!/usr/bin/env bash
# Quickstart command 2: set up and run the whole test suite (slow runs excluded; `-m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (TEST_WORKERS; `-n 0` runs in one process), each module's tests on one worker: a module's fixtures
# (a built wheel, a trained tiny model) are made once.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-2}" --dist loadscope "$@"
