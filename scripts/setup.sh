#!/usr/bin/env bash
# Create .venv (once) with the pinned versions of requirements-lock.txt and install this package into it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import torch, transformers, loopformer_hf" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check -r requirements-lock.txt 2>&1 | grep -v "is ignored" || true
  .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true
fi
bash scripts/fetch_transformers_tests.sh  # transformers' own common model tests, from its source distribution
.venv/bin/python -c "import torch, transformers, loopformer_hf, fprm_hf; print('env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
