"""The authors' formats (armenjeddi/LoopFormer-* Hub repos, and their training checkpoints), read on their loading
path only: a config of this package's format never enters this folder.

- `auto.py`: their model types and the classes transformers' Auto classes reach them by (registered at import);
- `files.py`, `config.py`, `code_defaults.py`, `weights.py`: their repo read (config.json, weight shapes, the
  defaults in their code, their weight names onto ours);
- `checkpoints.py`: the loader, `from_pretrained_authors` (what `AutoModelForCausalLM.from_pretrained` runs for
  their repos);
- `convert.py`: `python -m loopformer_hf.convert_authors` (their checkpoints saved in this package's format).

The names below are imported on first use (`import loopformer_hf` loads `auto.py` alone).
"""

import importlib

# public name -> the module of this folder that defines it
_HOMES = {
    "from_pretrained_authors": "checkpoints",
    "load_authors_repo": "checkpoints",
    "derive_config": "config",
    "resolve_config": "config",
    "source_defaults": "code_defaults",
    "read_config_dict": "files",
    "read_weight_shapes": "files",
    "is_reference_weight_name": "weights",
    "map_names": "weights",
    "mapped_reference_state_dict": "weights",
    "strip_wrapper_prefixes": "weights",
    "convert": "convert",
    "convert_hub_repo": "convert",
    "MODEL_TYPES": "model_types",
    "AUTHORS_CONFIG_CLASSES": "auto",
    "LoopFormerAuthorsConfig": "auto",
    "is_reference_config": "model_types",
}


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)


__all__ = [
    "AUTHORS_CONFIG_CLASSES",
    "LoopFormerAuthorsConfig",
    "MODEL_TYPES",
    "convert",
    "convert_hub_repo",
    "derive_config",
    "from_pretrained_authors",
    "is_reference_config",
    "is_reference_weight_name",
    "load_authors_repo",
    "map_names",
    "mapped_reference_state_dict",
    "read_config_dict",
    "read_weight_shapes",
    "resolve_config",
    "source_defaults",
    "strip_wrapper_prefixes",
]
