"""Loading the authors' repos makes no class at run time: the model is built as this package's class (no subclass
made for the load, no `__class__` swapped afterwards), their model types are module-level config classes, and no
conversion mapping is registered for our class (tests/test_import_side_effects.py: none of transformers' registries)."""

import ast
import sys
from pathlib import Path

from transformers import CONFIG_MAPPING, AutoModelForCausalLM

import loopformer_hf  # noqa: F401  (registers the Auto classes, theirs included)
from loopformer_hf import LoopFormerConfig, LoopFormerForCausalLM, LoopFormerModel
from loopformer_hf.authors.auto import AUTHORS_CONFIG_CLASSES
from loopformer_hf.authors.model_types import MODEL_TYPES

from support.reference_oracle import write_authors_repo

LOADER_MODULES = sorted((Path(loopformer_hf.__file__).parent).glob("authors/*.py")) + [
    Path(loopformer_hf.__file__).parent / "convert_authors.py"
]


def test_their_repo_is_built_as_our_class_from_the_start(tmp_path, monkeypatch):
    """Every LoopFormerForCausalLM the load builds is one when built (before: a `LoopFormerGPTForCausalLM` made with
    `type()` for the load, then `model.__class__` reassigned), and no subclass of ours appears."""
    write_authors_repo(tmp_path / "repo")
    built, post_init = [], LoopFormerForCausalLM.post_init

    def recording_post_init(self):
        built.append(type(self))
        return post_init(self)

    monkeypatch.setattr(LoopFormerForCausalLM, "post_init", recording_post_init)
    subclasses = set(LoopFormerForCausalLM.__subclasses__())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    base = LoopFormerModel.from_pretrained(tmp_path / "repo")
    assert type(model) is LoopFormerForCausalLM and type(base) is LoopFormerModel
    assert built and set(built) == {LoopFormerForCausalLM}, built
    assert set(LoopFormerForCausalLM.__subclasses__()) == subclasses


def test_a_model_of_ours_built_after_a_load_saves_in_our_layout(tmp_path):
    """Their names are mapped into the state dict the load hands to transformers, never registered for our class: a
    model built afterwards saves our names."""
    from safetensors import safe_open

    write_authors_repo(tmp_path / "repo")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "repo")
    LoopFormerForCausalLM(loaded.config).save_pretrained(tmp_path / "fresh")
    with safe_open(str(tmp_path / "fresh" / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.embed_tokens.weight" in names and not any(name.startswith("transformer.") for name in names)


def test_their_model_types_are_module_level_config_classes():
    for model_type in MODEL_TYPES:
        config_class = CONFIG_MAPPING[model_type]
        assert issubclass(config_class, LoopFormerConfig) and config_class.model_type == model_type
        assert getattr(sys.modules[config_class.__module__], config_class.__qualname__) is config_class
    assert {c.model_type for c in AUTHORS_CONFIG_CLASSES} == set(MODEL_TYPES) - {LoopFormerConfig.model_type}


def test_the_loader_calls_no_three_argument_type_and_assigns_no_class():
    for path in LOADER_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type":
                assert len(node.args) == 1, f"{path.name}:{node.lineno} makes a class with type()"
            targets = node.targets if isinstance(node, ast.Assign) else []
            assert not any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets), (
                f"{path.name}:{node.lineno} assigns __class__"
            )
