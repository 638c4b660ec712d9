#!/usr/bin/env bash
# Make transformers' common model tests (ModelTesterMixin, ConfigTester) importable for
# tests/test_transformers_common.py. Idempotent: does nothing when they are already there for the installed version.
#
# Source: the sdist of the *installed* transformers release from PyPI (pip download, cached under .venv/), of which
# only the test files are extracted, into the package .venv/transformers-tests/hf_common_tests/ (a name that cannot
# clash with this repo's own `tests` folder; the extracted files only use relative imports, so no rewriting).
#
# The sdist ships tests/*.py but not tests/generation/, tests/exporters/ nor tests/utils/, which
# test_modeling_common.py and test_configuration_common.py import from. Minimal stand-ins are written for those
# three imports (no export tests, no generation tests: GenerationTesterMixin is absent, so the stand-in is an empty
# class; config_common_kwargs is a small hand-written set of general PreTrainedConfig arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
VERSION="$($PY -c 'import transformers; print(transformers.__version__)')"
CACHE=.venv/cache/transformers-sdist
DEST=.venv/transformers-tests
PKG="$DEST/hf_common_tests"
STAMP="$DEST/VERSION"

# test_modeling_common.py needs `parameterized` (a test-only dependency, not in requirements-lock.txt).
if ! $PY -c "import parameterized" 2>/dev/null; then
  .venv/bin/pip install -q --disable-pip-version-check "parameterized==0.9.0" 2> >(grep -v "is ignored" >&2)
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$VERSION" ] && [ -f "$PKG/test_modeling_common.py" ]; then
  echo "transformers $VERSION common tests already in $PKG"
  exit 0
fi

SDIST="$CACHE/transformers-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  mkdir -p "$CACHE"
  .venv/bin/pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$CACHE" "transformers==$VERSION" 2> >(grep -v "is ignored" >&2)
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
FILES=(test_modeling_common.py test_configuration_common.py)
tar -xzf "$SDIST" -C "$TMP" "${FILES[@]/#/transformers-$VERSION/tests/}"

rm -rf "$PKG"
mkdir -p "$PKG/generation" "$PKG/exporters" "$PKG/utils"
for f in "${FILES[@]}"; do cp "$TMP/transformers-$VERSION/tests/$f" "$PKG/$f"; done
echo '"""transformers tests/ (test files of the sdist, plus stand-ins for modules the sdist does not ship)."""' \
  > "$PKG/__init__.py"
for sub in generation exporters utils; do : > "$PKG/$sub/__init__.py"; done
cat > "$PKG/generation/test_utils.py" <<'EOF'
# Stand-in: the transformers sdist does not ship tests/generation/. No generation tests are available.
class GenerationTesterMixin:
    pass
EOF
cat > "$PKG/exporters/test_export.py" <<'EOF'
# Stand-in: the transformers sdist does not ship tests/exporters/. No export tests are available.
class ExportTesterMixin:
    pass
EOF
cat > "$PKG/utils/test_configuration_utils.py" <<'EOF'
# Stand-in: the transformers sdist does not ship tests/utils/. General PreTrainedConfig arguments, each set to a
# non-default value; ConfigTester.check_config_arguments_init checks that a config keeps them.
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "finetuning_task": "translation",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
EOF
echo "$VERSION" > "$STAMP"
echo "transformers $VERSION common tests extracted to $PKG"
