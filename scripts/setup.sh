#!/usr/bin/env bash
# Create .venv (once) with the pinned versions of requirements-lock.txt and install this package into it.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_quiet() {  # pip, minus the harmless "Location ... is ignored" lines of this machine's extra indexes
  local log; log="$(mktemp)"
  if ! .venv/bin/pip install --no-cache-dir -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2; rm -f "$log"; echo "pip install $* failed" >&2; return 1
  fi
  grep -v "is ignored" "$log" || true; rm -f "$log"
}
lock_sha="$(sha256sum requirements-lock.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.lock-sha 2>/dev/null)" != "$lock_sha" ]; then
  [ -x .venv/bin/python ] || python3 -m venv .venv
  pip_quiet -r requirements-lock.txt
  pip_quiet --no-deps --no-build-isolation -e .
  echo "$lock_sha" > .venv/.lock-sha
fi
bash scripts/fetch_transformers_tests.sh  # transformers' own common model tests, from its source distribution
.venv/bin/python -c "import torch, transformers, loopformer_hf, fprm_hf; print('env ok: torch', torch.__version__, 'transformers', transformers.__version__)"
