"""The layout, read from the source: the two model packages stay independent of each other and of the training code
(trust_remote_code copies a model package's files alone; not even an optional import), the tree is formatted by one
formatter (ruff, configured in pyproject.toml), one home per concern (a model file is as long as its model needs:
no line-count gate on the packages), what both packages need has one source file (copied, checked by
scripts/check_copies.py), and the publishing code stays a thin layer over huggingface_hub's card and upload
machinery."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL_PACKAGES = ("loopformer_hf", "fprm_hf")
OWN_PACKAGES = {"loopformer_hf", "fprm_hf", "looped_training"}
MAX_README_LINES = 200
MAX_PUBLISHING_LINES = 620  # the planned ~400 lines packed, 597 after `ruff format`, with slack


def _modules(package):
    """Every module of a package, its subfolders' too (`authors/`: the authors' formats)."""
    return sorted((ROOT / package).rglob("*.py"))


def _catches_import_error(node):
    return isinstance(node, ast.Try) and any(
        isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError") for h in node.handlers
    )


def _imported_top_levels(tree, optional_too=False):
    """Top-level names imported by absolute imports, leaving out optional ones (in a `try` that catches ImportError)
    unless `optional_too`."""
    optional = set()
    if not optional_too:
        optional = {id(n) for t in ast.walk(tree) if _catches_import_error(t) for s in t.body for n in ast.walk(s)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", MODEL_PACKAGES)
def test_model_package_imports_no_other_package_of_this_project(package):
    """Not even optionally (the model card was once inherited from looped_training.publish where it was installed)."""
    for path in _modules(package):
        others = _imported_top_levels(ast.parse(path.read_text()), optional_too=True) & (OWN_PACKAGES - {package})
        assert not others, f"{path.relative_to(ROOT)} imports {sorted(others)}"


# ---- one home per idea ----------------------------------------------------------------------------------------------

# What both model packages compute or check (`rms_norm`, the eager attention, the config rules) has one source,
# loopformer_hf/looped_common.py; fprm_hf holds a copy marked "Copied from" (scripts/check_copies.py and
# tests/test_check_copies.py keep it identical), so each package still loads alone with trust_remote_code.
COMMON = ROOT / "loopformer_hf" / "looped_common.py"
CHECKED_COPIES = {ROOT / "fprm_hf" / "looped_common.py"}
COMMON_IDEAS = ("rms_norm", "rotate_half", "repeat_kv", "eager_attention_forward", "attend", "is_real_number")
COMMON_IDEAS += ("check_positive_number", "check_rope_parameters", "validate_rope", "validate_rotary", "head_dim")
COMMON_IDEAS += ("rotary_dim", "_unreadable_safetensors")


def _functions(path):
    """(function name, body) of every function of `path`; the body is its arguments and statements, the docstring
    left out."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            found.append((node.name, ast.dump(node.args) + "".join(map(ast.dump, body))))
    return found


def _own_files():
    """The files of both model packages, the checked copies of another file left out."""
    return [path for package in MODEL_PACKAGES for path in _modules(package) if path not in CHECKED_COPIES]


def _trivial(body_statements):  # `pass` or `return self.x`: alike by nature, not copies
    return body_statements in ("Pass()",) or body_statements.startswith("Return(value=Attribute(value=Name(id='self'")


def test_no_function_body_is_written_twice_in_the_model_packages():
    """Fails on a copy (other than a checked one, scripts/check_copies.py): before looped_common.py, `rms_norm`,
    `rotate_half`, the config rules and the config properties stood in both packages, and LoopFormer's config had `_real`, trajectory's `_is_real_number` to the
    letter."""
    by_body = {}
    for path in _own_files():
        for name, body in _functions(path):
            statements = body.partition(")")[2] if body.startswith("arguments(") else body
            if not _trivial(statements.strip()):
                by_body.setdefault(body, []).append(f"{path.relative_to(ROOT)}:{name}")
    copies = [homes for homes in by_body.values() if len(homes) > 1]
    assert not copies, f"one body written twice: {copies}"


def test_each_idea_both_packages_need_is_defined_in_the_common_file_alone():
    """`rms_norm`, the eager attention and the config rules are defined in loopformer_hf/looped_common.py (and its
    checked copy) and nowhere else in the model packages (under any body: a second `rms_norm` with other features is
    a second home too)."""
    homes = {}
    for path in _own_files():
        for name, _ in _functions(path):
            if name in COMMON_IDEAS:
                homes.setdefault(name, []).append(str(path.relative_to(ROOT)))
    assert homes == {name: [str(COMMON.relative_to(ROOT))] for name in COMMON_IDEAS}


def _lines(path):
    return len((ROOT / path).read_text().splitlines())


def test_the_readme_is_a_front_door_of_at_most_200_lines():
    """README.md says what the project is, how to install it and the Quickstart; the rest is in docs/, linked."""
    assert _lines("README.md") <= MAX_README_LINES, (
        f"README.md: {_lines('README.md')} lines (at most {MAX_README_LINES})"
    )


def test_the_tree_is_formatted_by_the_configured_formatter():
    """`ruff format --check` at pyproject.toml's settings (transformers' line length, 119): sizes come from one
    formatter, not from lines packed to a cap."""
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, f"run `ruff format .`:\n{run.stdout}{run.stderr}"


def test_publishing_stays_near_400_lines_and_on_huggingface_hubs_card_and_upload_machinery():
    """publish.py stages and pushes; the card (looped_training.model_cards) is a `ModelCard` rendered from a template
    with `ModelCardData` and `EvalResult`s, pushed with `upload_folder`: no YAML or model-index written by hand. The
    two files together are the publishing code (the evaluation files this package writes are read by their writers'
    `card_results`, the weights checked by `checkpoints.load_model`, which every command that loads a model shares)."""
    publish, cards = (ROOT / "training" / "publish.py").read_text(), (ROOT / "model_cards" / "__init__.py").read_text()
    lines = {path: _lines(path) for path in ("training/publish.py", "model_cards/__init__.py")}
    assert sum(lines.values()) <= MAX_PUBLISHING_LINES, lines
    assert all(name in cards for name in ("ModelCard.from_template", "ModelCardData(", "EvalResult("))
    assert "upload_folder(" in publish and "import yaml" not in publish + cards


def test_the_models_push_to_hub_is_transformers_own():
    """The card is written by `looped_training.publish` (a function over the model), not inherited into the model
    classes: their `push_to_hub` is transformers' `PreTrainedModel.push_to_hub`."""
    from transformers import PreTrainedModel

    from fprm_hf import FPRMForReasoning
    from loopformer_hf import LoopFormerForCausalLM

    for model_class in (FPRMForReasoning, LoopFormerForCausalLM):
        assert model_class.push_to_hub is PreTrainedModel.push_to_hub
        assert not any(base.__module__.startswith("looped_training") for base in model_class.__mro__)


LOAD_AND_SAVE = """
import sys, tempfile, torch
import fprm_hf, loopformer_hf
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
from support.tiny_models import sequence_fprm_config, tiny_fprm, tiny_loopformer_config

folder = tempfile.mkdtemp()
loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()).save_pretrained(folder + "/lf")
AutoModelForCausalLM.from_pretrained(folder + "/lf")(torch.tensor([[1, 2, 3]]))
fprm = tiny_fprm(0, config=sequence_fprm_config(vocab_size=8, num_attention_heads=2, num_hidden_layers=1, max_loops=4))
fprm.save_pretrained(folder + "/fprm")
AutoModelForTokenClassification.from_pretrained(folder + "/fprm")(torch.tensor([[1, 2, 3]]))
print(sorted(m for m in sys.modules if m.startswith("looped_training")))
print(folder)
"""
# in a process where the packages are installed but not imported: the saved copies load, and import nothing of ours
REMOTE_CODE_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
AutoModelForCausalLM.from_pretrained(sys.argv[1] + "/lf", trust_remote_code=True)(torch.tensor([[1, 2, 3]]))
AutoModelForTokenClassification.from_pretrained(sys.argv[1] + "/fprm", trust_remote_code=True)(torch.tensor([[1, 2]]))
print(sorted(m for m in sys.modules if m.split(".")[0] in ("looped_training", "loopformer_hf", "fprm_hf")))
"""


def test_the_model_packages_import_no_training_code_to_import_load_and_save(tmp_path):
    """Neither package imports looped_training, whether it is installed or not (it is here), and a saved model's
    `trust_remote_code` copy imports nothing of ours: it behaves the same in every environment."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests"), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    out = subprocess.run(
        [sys.executable, "-c", LOAD_AND_SAVE], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modules, folder = out.stdout.strip().splitlines()[-2:]
    assert modules == "[]", out.stdout[-2000:]
    remote = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_LOAD, folder],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        env=env,
    )
    assert remote.returncode == 0, remote.stderr[-2000:]
    assert remote.stdout.strip().splitlines()[-1] == "[]", remote.stdout[-2000:]


def test_imports_run_one_way_models_training_lab():
    """loopformer_hf, fprm_hf <- looped_training <- benchmarks: neither the model packages, the training package nor
    a test of the library imports the lab (`benchmarks`); the lab's own tests are tests/lab/, and the instruments
    both use are tests/support/."""
    library = [
        *ROOT.glob("loopformer_hf/**/*.py"),
        *ROOT.glob("fprm_hf/**/*.py"),
        *ROOT.glob("training/**/*.py"),
        *(p for p in ROOT.glob("tests/**/*.py") if p.relative_to(ROOT / "tests").parts[0] != "lab"),
    ]
    offenders = [
        str(p.relative_to(ROOT)) for p in library if "benchmarks" in _imported_top_levels(ast.parse(p.read_text()))
    ]
    assert not offenders, offenders


def test_tests_mirror_the_source_tree():
    """tests/loopformer/ imports no FPRM and tests/fprm/ no LoopFormer; the training and serving tests are in their
    folders; what tests build and measure with is in tests/support/, not in a test file; and no two test files share
    a name (pytest imports each by its basename, the folders have no __init__.py)."""
    tests = ROOT / "tests"
    files = [p for p in tests.glob("**/test_*.py") if ".venv" not in p.parts]
    names = [p.name for p in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for folder, foreign in (("loopformer", "fprm_hf"), ("fprm", "loopformer_hf")):
        offenders = [
            p.name
            for p in (tests / folder).glob("test_*.py")
            if foreign in _imported_top_levels(ast.parse(p.read_text()))
        ]
        assert not offenders, (folder, offenders)
    for folder, package in (("training", "looped_training"), ("serving", "vllm")):
        assert any(package in p.read_text() for p in (tests / folder).glob("test_*.py")), folder
    modules = {p.stem for p in tests.glob("*.py")} - {"conftest", *(p.stem for p in tests.glob("test_*.py"))}
    assert not modules, f"helper modules belong in tests/support/: {sorted(modules)}"


# A model package's module and the test folder named for it: a module's tests are tests/<folder>/test_<name>*.py, its
# name without the package's suffix (plan_loopformer.py -> tests/loopformer/test_plan.py; solver_fprm.py ->
# tests/fprm/test_solver.py; test_layers_fprm.py where both folders test a `layers` module: test names are unique).
TEST_FOLDERS = {"loopformer_hf": ("loopformer", "_loopformer"), "fprm_hf": ("fprm", "_fprm")}
MIN_MODULES_WITH_A_TEST_FILE = 0.8


def _test_files_of(package, module):
    folder, suffix = TEST_FOLDERS[package]
    # a module of a subfolder is named with it: loopformer_hf/authors/files.py -> test_authors_files.py
    parts = module.relative_to(ROOT / package).with_suffix("").parts if module.is_relative_to(ROOT / package) else ()
    name = "_".join(parts[:-1] + (module.stem,)).removesuffix(suffix)
    pattern = re.compile(rf"test_{re.escape(name)}(_\w+)?\.py")
    return [p.name for p in (ROOT / "tests" / folder).glob("test_*.py") if pattern.fullmatch(p.name)]


def test_most_library_modules_have_a_test_file_named_for_them():
    """At least 80% of the modules of both model packages (every .py but `__init__.py`) have a test file named for
    them in their model's test folder, as transformers' tests/models/llama/test_modeling_llama.py is named for
    modeling_llama.py: a reader finds a module's tests by its name, and a new module without one shows here."""
    modules = [(package, p) for package in MODEL_PACKAGES for p in _modules(package) if p.name != "__init__.py"]
    untested = [f"{package}/{p.name}" for package, p in modules if not _test_files_of(package, p)]
    share = 1 - len(untested) / len(modules)
    assert share >= MIN_MODULES_WITH_A_TEST_FILE, (
        f"{len(modules) - len(untested)}/{len(modules)} modules have a test file named for them ({share:.0%}, at "
        f"least {MIN_MODULES_WITH_A_TEST_FILE:.0%} wanted); without one: {untested}"
    )


def test_the_name_rule_finds_a_modules_test_file():
    assert _test_files_of("loopformer_hf", ROOT / "loopformer_hf" / "cache_loopformer.py") == ["test_cache.py"]
    assert "test_layers_fprm.py" in _test_files_of("fprm_hf", ROOT / "fprm_hf" / "layers_fprm.py")
    assert _test_files_of("fprm_hf", ROOT / "fprm_hf" / "no_such_module_fprm.py") == []


def _imported_modules(path):
    """Every module `path` imports by an absolute import, by its full name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_training_tests_mirror_training():
    """tests/training/ has loopformer/ and fprm/ as training/ has: each model's training tests are in its folder and
    import nothing of the other model's (neither its package nor its part of looped_training); what both models'
    commands share (arguments, checkpoints, locks, publishing, ...) is tested at tests/training/."""
    tests = ROOT / "tests" / "training"
    for folder, foreign in (
        ("loopformer", ("fprm_hf", "looped_training.fprm")),
        ("fprm", ("loopformer_hf", "looped_training.loopformer")),
    ):
        assert (ROOT / "training" / folder).is_dir() and (tests / folder).is_dir(), folder
        files = sorted((tests / folder).glob("test_*.py"))
        assert files, f"tests/training/{folder}/ holds no test file"
        offenders = {
            p.name: sorted(m for m in _imported_modules(p) if any(m == f or m.startswith(f + ".") for f in foreign))
            for p in files
        }
        assert not any(offenders.values()), (folder, {k: v for k, v in offenders.items() if v})


def test_checkout_has_the_users_layout():
    """top-level training/ and model_cards/ (installed as looped_training, looped_training.model_cards)."""
    assert (ROOT / "training" / "__init__.py").is_file() and (ROOT / "model_cards" / "loopformer.md").is_file()
    assert not (ROOT / "looped_training").exists()
    import looped_training
    import looped_training.model_cards

    assert Path(looped_training.__file__).parent == ROOT / "training"
    assert Path(looped_training.model_cards.__file__).parent == ROOT / "model_cards"


def test_the_causal_lm_forward_is_llama_sized_and_reads_its_objective_as_data():
    """Llama's `forward` names 8 arguments; ours names those plus the loop knobs, one `shortcut_consistency` value
    and the cache's pre-5.24 name (≤ 14). `shift_labels` stays a keyword, as for Llama: a named one would make a
    Trainer take it for a label that every evaluation batch must carry. The model holds no slot for a training callback to attach to, so the forward cannot call one back."""
    import inspect

    from transformers import LlamaForCausalLM

    from loopformer_hf import LoopFormerForCausalLM

    def named(cls):
        return [
            p.name
            for p in inspect.signature(cls.forward).parameters.values()
            if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
        ]

    llama, ours = named(LlamaForCausalLM), named(LoopFormerForCausalLM)
    assert len(ours) <= 14 and ours[: len(llama)] == llama, ours
    assert set(ours) - set(llama) == {
        "loop_budget",
        "step_schedule",
        "halt_eps",
        "shortcut_consistency",
        "past_key_values",
    }
    source = inspect.getsource(inspect.getmodule(LoopFormerForCausalLM))
    assert "shortcut_objective" not in source and "record_terms" not in source


# ---- no import cycles: every module of the tree, function-level imports included --------------------------------

# import name -> folder (the wheel installs training/ as looped_training; tests import their helpers as `support`)
IMPORT_ROOTS = {
    "loopformer_hf": "loopformer_hf",
    "fprm_hf": "fprm_hf",
    "looped_training": "training",
    "benchmarks": "benchmarks",
    "support": "tests/support",
}


def _import_graph():
    modules = {}
    for name, folder in IMPORT_ROOTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name):  # the module `name` is, or the deepest one it lies in
        name = name.replace("tests.support", "support", 1) if name.startswith("tests.support") else name
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                    )
                found |= {known(f"{base}.{alias.name}") for alias in node.names}
        # a module's own package __init__ runs before it anyway: not an edge
        graph[module] = {
            m
            for m in found
            if m and m != module and not (module.startswith(m + ".") and modules[m].name == "__init__.py")
        }
    return graph


def test_no_import_cycles_anywhere_in_the_tree():
    graph, cycles = _import_graph(), []

    def reaches(start, goal, seen):
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)):
                return True
        return False

    cycles = sorted(m for m in graph if reaches(m, m, set()))
    assert not cycles, f"modules on an import cycle: {cycles}"


# ---- the docs name what the code holds ------------------------------------------------------------------------------


@pytest.mark.parametrize("package, doc", [("loopformer_hf", "docs/loopformer.md"), ("fprm_hf", "docs/fprm_model.md")])
def test_every_module_is_in_its_docs_files_table(package, doc):
    text = (ROOT / doc).read_text()
    names = [p.relative_to(ROOT / package).as_posix() for p in _modules(package)]  # authors/config.py, ...
    missing = [name for name in names if not name.endswith("__init__.py") and f"`{name}`" not in text]
    assert not missing, f"{doc} does not list {missing}"


def test_the_documented_option_lists_are_the_codes():
    from fprm_hf.configuration_fprm import HALT_SCOPES
    from loopformer_hf import LoopFormerForCausalLM

    def rows(doc, name):
        return [line for line in (ROOT / doc).read_text().splitlines() if line.startswith(f"| `{name}` |")]

    assert all(f'"{s}"' in row for row in rows("docs/fprm_model.md", "halt_scope") for s in HALT_SCOPES)
    doc = LoopFormerForCausalLM.generate.__doc__
    assert all(f"`{knob}`" in doc for knob in ("loop_budget", "step_schedule", "halt_eps")), doc
