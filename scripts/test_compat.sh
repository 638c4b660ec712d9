#!/usr/bin/env bash
# Run the LoopFormer model tests against another transformers release of the declared range (default 5.17.0,
# the oldest), in a separate venv: bash scripts/test_compat.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-5.17.0}"
venv=".venv-transformers-$version"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --no-cache-dir -q --disable-pip-version-check -r requirements-lock.txt "transformers==$version" 2>&1 | grep -v "is ignored" || true
fi
PYTHONPATH="$PWD:$PWD/tests" exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_loopformer_model.py tests/test_loopformer_cache.py tests/test_loopformer_halting.py
