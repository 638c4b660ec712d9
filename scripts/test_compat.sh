#!/usr/bin/env bash
# Run the model tests (LoopFormer and FPRM) against another transformers release of the declared range (default 5.17.0,
# the oldest), in a separate venv: bash scripts/test_compat.sh [VERSION]
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-5.17.0}"
venv=".venv-transformers-$version"
if [ ! -x "$venv/bin/pytest" ]; then  # built in a temporary folder, so that a failed install is not taken as done
  rm -rf "$venv.partial"
  python3 -m venv "$venv.partial"
  # the lock's pins but transformers and the two it pins to its own releases (huggingface_hub, tokenizers)
  grep -vE '^(transformers|huggingface_hub|tokenizers)==' requirements-lock.txt > "$venv.partial/requirements.txt"
  "$venv.partial/bin/pip" install --no-cache-dir -q --disable-pip-version-check \
    -r "$venv.partial/requirements.txt" "transformers==$version" 2>&1 | grep -v "is ignored" || true
  "$venv.partial/bin/python" -c "import pytest, transformers; assert transformers.__version__ == '$version'"
  rm -rf "$venv" && mv "$venv.partial" "$venv"
fi
# (lm-eval runs `python -m looped_training...`, a name only the installed package has)
PYTHONPATH="$PWD:$PWD/tests" exec "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/loopformer/test_{modeling,cache,halting,generation_modes}.py tests/loopformer/test_loopformer_validation.py \
  tests/fprm/test_{modeling_fprm,fprm_conventions,convert_authors_fprm}.py tests/loopformer/test_authors_checkpoints{,_usage,_classes}.py \
  tests/fprm/test_authors_checkpoints_fprm.py \
  --deselect tests/loopformer/test_authors_checkpoints_usage.py::test_lm_eval_through_our_route \
  --deselect tests/fprm/test_authors_checkpoints_fprm.py::test_round_trip_and_publish_with_a_card_crediting_their_repo_and_step \
  --deselect tests/fprm/test_authors_checkpoints_fprm.py::test_from_the_hub_by_repo_id_and_subfolder
