"""Importing `loopformer_hf` and `fprm_hf` registers the models with the Auto classes (their public `register`) and
changes nothing else of transformers; loading the authors' checkpoints (both layouts) changes nothing of it at all.

A fresh process snapshots transformers as it is loaded, before and after `import loopformer_hf, fprm_hf`, and after
loading a stand-in of each authors' layout (tests/support's writers): every attribute of every class and every
module-level name of every transformers module (by identity), and the contents of every dict, list and set among them
(the Auto mappings, the conversion-mapping registry, the attention and RoPE registries, ...), by key and identity.
Before issue 65 the import replaced `PreTrainedConfig.get_config_dict`, and each authors' load registered a conversion
mapping for `LoopFormerForCausalLM`, then put the one before back."""

import json
import subprocess
import sys

from loopformer_hf.authors.model_types import MODEL_TYPES
from support import REPO_ROOT

SNAPSHOT_SCRIPT = r'''
import collections, importlib, json, sys, tempfile
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForTokenClassification  # noqa: F401
from transformers import AutoTokenizer, PreTrainedConfig, PreTrainedModel  # noqa: F401
import transformers.conversion_mapping as conversion_mapping
import transformers.models.auto.configuration_auto, transformers.models.auto.modeling_auto  # noqa: F401
import transformers.models.auto.tokenization_auto  # noqa: F401

conversion_mapping.get_checkpoint_conversion_mapping("llama")  # builds transformers' registry (lazily built)


def _contents(value):
    """A container's contents by key and identity (a registry mutated in place keeps its own identity)."""
    mapping = getattr(value, "_extra_content", None)  # the Auto classes' lazy mappings: what `register` adds
    if isinstance(mapping, dict):
        return {repr(k): id(v) for k, v in mapping.items()}
    if isinstance(value, dict) and (type(value) is dict or isinstance(value, collections.OrderedDict)):
        return {repr(k): id(v) for k, v in value.items()}
    if type(value) in (list, set, frozenset, tuple):  # a member named by its repr where it is a class (or a name)
        return {repr(v) if isinstance(v, (type, str)) else f"id {id(v)}": id(v) for v in value}
    return None


def snapshot():
    state = {}
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("transformers") or module is None:
            continue
        for name, value in list(vars(module).items()):
            key = f"{module_name}.{name}"
            state[key] = [id(value), _contents(value)]
            if isinstance(value, type) and value.__module__ == module_name:  # the class's own attributes
                for attr, member in list(vars(value).items()):
                    state[f"{key}.{attr}"] = [id(member), _contents(member)]
    return state


def changes(before, after):
    """Names present in both snapshots whose object or contents differ (modules transformers imports lazily, and
    names a lazy module fills in on first use, are new, not changed)."""
    out = {}
    for key in sorted(before.keys() & after.keys()):
        (id_a, content_a), (id_b, content_b) = before[key], after[key]
        if id_a != id_b:
            out[key] = "replaced"
        elif content_a != content_b:
            added = sorted(content_b.keys() - content_a.keys())
            other = sorted(k for k in content_a if content_b.get(k) != content_a[k])
            out[key] = {"added": added, "removed_or_replaced": other}
    return out


# transformers' own lazy loading first: the modules our import loads (listed by the caller's first process), so that
# the snapshot compares what our import changes, not what a first import of a transformers module does
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except Exception:  # an optional backend missing: transformers' business
        pass
before = snapshot()
import loopformer_hf, fprm_hf  # noqa: E401

imported = snapshot()

sys.path.insert(0, sys.argv[1])
from support.fprm_reference_oracle import write_published_folder
from support.reference_oracle import write_authors_repo

tmp = Path(tempfile.mkdtemp())
write_authors_repo(tmp / "loopformer")
write_published_folder(tmp / "fprm" / "sudoku", "sudoku", steps=(10,))
AutoModelForCausalLM.from_pretrained(tmp / "loopformer")
loopformer_hf.LoopFormerModel.from_pretrained(tmp / "loopformer")
AutoConfig.from_pretrained(tmp / "loopformer")
fprm_hf.FPRMForReasoning.from_pretrained(tmp / "fprm", subfolder="sudoku")
fprm_hf.FPRMConfig.from_pretrained(tmp / "fprm", subfolder="sudoku")
try:
    AutoConfig.from_pretrained(tmp / "fprm", subfolder="sudoku")
    auto_config_error = None  # read: through a patch
except (OSError, ValueError) as error:  # transformers' own, whichever it raises
    auto_config_error = str(error).splitlines()[0]
loaded = snapshot()
print(json.dumps(dict(on_import=changes(before, imported), on_load=changes(imported, loaded),
                      auto_config_error=auto_config_error)))
'''

LIST_MODULES = (
    "import json, sys, loopformer_hf, fprm_hf; "
    "print(json.dumps(sorted(m for m in sys.modules if m.startswith('transformers'))))"
)
# what `register` adds: our model types (the authors' among them), classes of ours, our tokenizer's name
OURS = {repr(model_type) for model_type in (*MODEL_TYPES, "fprm")} | {"'LoopFormerTokenizerFast'"}
# the Auto mappings that must have gained our entries
REGISTERED_IN = (
    "transformers.models.auto.configuration_auto.CONFIG_MAPPING",
    "transformers.models.auto.modeling_auto.MODEL_MAPPING",
    "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING",
    "transformers.models.auto.modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    "transformers.models.auto.tokenization_auto.TOKENIZER_MAPPING",
)


def _python(*args):
    done = subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _is_ours(entry):
    return entry in OURS or "loopformer_hf." in entry or "fprm_hf." in entry


def test_import_registers_with_the_auto_classes_and_changes_nothing_else_and_loading_changes_nothing():
    modules = _python("-c", LIST_MODULES)
    result = _python("-c", SNAPSHOT_SCRIPT, str(REPO_ROOT / "tests"), json.dumps(modules))
    on_import = result["on_import"]
    assert set(REGISTERED_IN) <= on_import.keys(), f"not registered with {set(REGISTERED_IN) - on_import.keys()}"
    # our registrations (the Auto classes' `register`; transformers' ModelOutput keeps its subclasses, ours among
    # them): entries of ours added, nothing replaced or removed
    others = {
        name: change
        for name, change in on_import.items()
        if change == "replaced" or change["removed_or_replaced"] or not all(map(_is_ours, change["added"]))
    }
    assert others == {}, f"importing the packages changed transformers: {others}"
    assert result["on_load"] == {}, f"loading the authors' checkpoints changed transformers: {result['on_load']}"
    # an authors' FPRM folder has no config.json: AutoConfig gives transformers' own error (FPRMConfig reads it)
    assert "config.json" in (result["auto_config_error"] or "AutoConfig read it")
