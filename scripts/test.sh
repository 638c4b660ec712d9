#!/usr/bin/env bash
# Quickstart command 2: set up and run the whole test suite (slow runs excluded; `-m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
