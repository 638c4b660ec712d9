"""The authors' checkpoints (armenjeddi/LoopFormer-*, Base-Loop-*) loaded into this package's classes.

What is known of the published files (public traces of armenjeddi/LoopFormer-3block-8iterations at 2b4fbaa; the Hub
cannot be reached from where this was written): config.json of 296 bytes with `architectures`
["LoopFormerGPTForCausalLM"], `auto_map` (their custom code), `dtype`, `model_type` ("loopformer"; the Base-Loop repos
"base_loop" and "base_loop_ee") and `transformers_version`, and no sizes: those come from the defaults of the
configuration class in the repo's own code. model.safetensors holds 29 bf16 tensors named as their GitHub `GPT`'s
state dict under a `gpt.` prefix, the tied head stored once as `transformer.wte.weight`; GPT-2's tokenizer files.
What is inferred: which keys the 1- and 2-block repos state (most likely `n_layer`, perhaps `steps`).

The modules of this folder, in the order a load reads them: `files` (config.json, the weights' header), `config`
(the config every value of which comes from the first file that determines it), `code_defaults` (their
configuration class's defaults, parsed, never executed), `weights` (their names onto ours), and this one; `auto`
holds the classes the Auto registries reach it by.

The weights are then read as stored (every shard), renamed by the one table of `weights.py` (the fused `c_attn`
split in three), and handed as a state dict to transformers' own `from_pretrained` (dtype, `device_map`,
quantisation, the missing/unexpected-key report), which builds a `LoopFormerForCausalLM` as such; the repo's
generation_config.json is then read as `from_pretrained` reads it for any folder. No registry of transformers' is
touched, not even for the duration of a load (two threads load side by side), and `save_pretrained` writes this
package's layout. A key left unmapped or a parameter left unfilled is refused, never initialised at random.
"""

import os
import re

import torch
from transformers.modeling_utils import PreTrainedModel

from ..configuration_loopformer import HUB_OPTIONS as HUB_KWARGS
from ..configuration_loopformer import LoopFormerConfig
from .code_defaults import source_defaults
from .config import derive_config, resolve_config
from .files import read_config_dict, read_weight_shapes, read_weights, resolve_file
from .model_types import MODEL_TYPES, OWN_CONFIG_KEYS, is_reference_config
from .weights import (
    FUSED_QKV,
    is_reference_weight_name,
    map_names,
    mapped_reference_state_dict,
    our_name,
    renames_for,
    strip_wrapper_prefixes,
    wrapper_prefix,
)


def _check_tied_head(path, prefix, names, hub_kwargs):
    """Both `lm_head.weight` and `transformer.wte.weight` stored: their model ties them, so they must be equal."""
    if not {"lm_head.weight", "transformer.wte.weight"} <= names:
        return
    from safetensors import safe_open

    resolved = resolve_file(path, "model.safetensors", hub_kwargs)
    if resolved is None:
        return  # sharded or pickled: transformers loads both into the one tied parameter
    with safe_open(resolved, "pt") as handle:
        head, wte = handle.get_tensor(prefix + "lm_head.weight"), handle.get_tensor(prefix + "transformer.wte.weight")
    if head.shape != wte.shape or not torch.equal(head, wte):
        raise ValueError(
            f"{resolved!r}: lm_head.weight differs from transformer.wte.weight; their model ties them "
            "(one tensor), so this checkpoint is not one of theirs."
        )


# ---- from_pretrained -----------------------------------------------------------------------------------------------


def _refuse_reference_weights_under_our_config(path, hub_kwargs):
    """Our config.json over weights named as theirs would load as a randomly initialised model (transformers only
    warns about missing keys): refuse it, reading only the weight names."""
    try:
        names = read_weight_shapes(path, hub_kwargs)
    except OSError:
        return  # from_pretrained's own load names the file
    theirs = sorted(name for name in names if is_reference_weight_name(name))
    if theirs:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json is in this package's layout (it has {' / '.join(OWN_CONFIG_KEYS)}), "
            f"but the weights are named as the authors' GPT ({theirs[:3]}, …): the config was replaced or edited. "
            f"Use their config.json (it is translated), or convert with `python -m loopformer_hf.convert_authors`."
        )


def _config_for(path, config_dict, hub_kwargs, shapes, kwargs):
    """The config to load with: the one the files determine (`derive_config`), with the caller's overrides: those
    AutoConfig set on the config it derived the same way (with transformers' default Hub options), or config fields
    among `kwargs` (popped); a config of the caller's own, as is."""
    given = kwargs.pop("config", None)
    config = LoopFormerConfig(**derive_config(config_dict, path, hub_kwargs, shapes))
    if isinstance(given, LoopFormerConfig) and getattr(given, "authors_config_sources", None) is not None:
        auto = config if not hub_kwargs else LoopFormerConfig(**derive_config(config_dict, path))
        derived = auto.to_dict()
        for key, value in given.to_dict().items():
            if derived.get(key) != value and key not in ("_name_or_path", "transformers_version"):
                setattr(config, key, value)
    elif given is not None:
        config = given
    fields = config.to_dict()
    for key in [key for key in kwargs if key in fields and key not in ("dtype", "torch_dtype")]:
        setattr(config, key, kwargs.pop(key))  # validated on assignment
    return config


def _refuse_incomplete(path, config, config_dict, info, stored):
    """transformers' loading report of their repo: a key no mapping knows (named as stored), a parameter nothing
    fills or a shape that differs is a ValueError, where transformers would initialise at random and log."""
    missing = sorted(set(info["missing_keys"]) - {"lm_head.weight"})  # the tie restores the head
    unexpected = sorted(stored.get(key, key) for key in info["unexpected_keys"])
    mismatched = sorted(map(str, info["mismatched_keys"]))
    if missing or unexpected or mismatched:
        raise ValueError(
            f"{os.fspath(path)!r} in the authors' layout does not fill a {config.num_hidden_layers}-block "
            f"{config_dict['model_type']!r} model: "
            + "; ".join(
                f"{what}: {keys}"
                for what, keys in (
                    ("unknown keys (no mapping knows them)", unexpected),
                    ("missing keys (parameters nothing fills)", missing),
                    ("shapes that differ", mismatched),
                )
                if keys
            )
            + ". Nothing was initialised at random."
        )


def _refuse_wrong_shapes(path, config, causal_lm, shapes, renames):
    """A stored tensor whose shape the derived model does not have is a ValueError naming it and both shapes, from
    the header, before transformers loads anything (it printed a loading report that reads as success, then raised
    its own RuntimeError). The fused c_attn is compared with q, k and v stacked."""
    with torch.device("meta"):
        expected = {name: tuple(tensor.shape) for name, tensor in causal_lm(config).state_dict().items()}
    fused, parts = FUSED_QKV
    wrong = []
    for key, shape in shapes.items():
        name = our_name(key, renames)
        want = expected.get(name)
        if want is not None and fused in key:
            stacked = [expected.get(name.replace(parts[0], part)) for part in parts]
            want = (sum(s[0] for s in stacked), *want[1:]) if None not in stacked else None
        if want is not None and tuple(shape) != want:
            wrong.append(f"{key} has shape {tuple(shape)}, the model needs {want}")
    if wrong:
        raise ValueError(
            f"{os.fspath(path)!r}: " + "; ".join(sorted(wrong)) + f" (a {config.num_hidden_layers}-block "
            f"model of width {config.hidden_size} with {config.num_attention_heads} heads, as the other "
            f"tensors and config.json say). Nothing was loaded."
        )


# from_pretrained kwargs that change nothing here (no remote code is run)
_ACCEPTED_NOOPS = ("trust_remote_code", "code_revision", "_from_auto", "adapter_kwargs")


def _load_mapped(causal_lm, path, state_dict, config, hub_kwargs, kwargs):
    """transformers' own `from_pretrained` of `causal_lm` (past any override of ours, which routed here) from
    `state_dict` (their tensors under our names), then the repo's generation_config.json as `from_pretrained` reads it
    for a folder. Returns (model, loading info)."""
    generation_config = kwargs.get("generation_config")
    kwargs = {key: value for key, value in kwargs.items() if key not in HUB_KWARGS}
    try:
        model, info = PreTrainedModel.from_pretrained.__func__(  # transformers' own, with `causal_lm` as the class
            causal_lm, None, config=config, state_dict=state_dict, output_loading_info=True, **kwargs
        )
    except TypeError as error:  # an option transformers passed on to the model's constructor
        unknown = re.findall(r"unexpected keyword argument '(\w+)'", str(error))
        if not unknown:
            raise
        raise ValueError(
            f"from_pretrained got keyword arguments that are neither config fields nor loading options: {unknown}."
        ) from None
    model.config._name_or_path = os.fspath(path)
    if generation_config is None:  # transformers' defaults of the options that locate the file
        options = dict(cache_dir=None, force_download=False, proxies=None, local_files_only=False, token=None)
        options.update(dict(revision=None, subfolder=""), **hub_kwargs)
        model.adjust_generation_fn(None, False, False, os.fspath(path), trust_remote_code=False, **options)
    return model, info


def _refuse_our_weights_under_their_config(path, shapes):
    if "model.embed_tokens.weight" in shapes:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json has none of this package's fields ({', '.join(OWN_CONFIG_KEYS)}), as "
            f"the authors' configs, but the weights are in this package's layout (model.embed_tokens.weight, …): the "
            f"config was edited or truncated. Restore it (num_loops is the number of loop steps L it was trained with)."
        )


def load_authors_repo(cls, path, model_args, kwargs):
    """`cls.from_pretrained(path, *model_args, **kwargs)` for a repo in the authors' layout, or None when `path` is not
    one (a folder of ours whose weights are named as theirs is refused). `cls`: LoopFormerForCausalLM or
    LoopFormerModel (the base model of the loaded causal LM)."""
    hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if kwargs.get(key) is not None}
    config_dict = read_config_dict(path, hub_kwargs)
    if config_dict is None or config_dict.get("model_type") not in MODEL_TYPES:
        return None
    if not is_reference_config(config_dict):
        _refuse_reference_weights_under_our_config(path, hub_kwargs)
        return None
    from ..modeling_loopformer import LoopFormerForCausalLM

    if model_args:
        raise ValueError(f"positional model arguments {model_args!r} are not accepted for the authors' layout.")
    kwargs = {key: value for key, value in kwargs.items() if key not in _ACCEPTED_NOOPS}
    shapes = read_weight_shapes(path, hub_kwargs)
    _refuse_our_weights_under_their_config(path, shapes)
    config = _config_for(path, config_dict, hub_kwargs, shapes, kwargs)
    names = set(strip_wrapper_prefixes(dict.fromkeys(shapes)))
    prefix = wrapper_prefix(shapes)
    _check_tied_head(path, prefix, names, hub_kwargs)

    causal_lm = cls if issubclass(cls, LoopFormerForCausalLM) else LoopFormerForCausalLM
    renames = renames_for(prefix, names)
    _refuse_wrong_shapes(path, config, causal_lm, shapes, renames)
    output_loading_info = kwargs.pop("output_loading_info", False)
    rows = list(map_names(read_weights(path, hub_kwargs)))  # (their name, ours, tensor): the fused c_attn in three
    state_dict = {ours: tensor for _, ours, tensor in rows if ours != "lm_head.weight"}  # the tie restores the head
    model, info = _load_mapped(causal_lm, path, state_dict, config, hub_kwargs, kwargs)
    _refuse_incomplete(path, config, config_dict, info, {ours: theirs for theirs, ours, _ in rows})
    if model.generation_config.do_sample is None:  # theirs sets nothing: greedy, as our generate documents
        model.generation_config.do_sample = False
    for key in ("eos_token_id", "bos_token_id"):  # theirs names none: the tokenizer's (derive_config)
        if getattr(model.generation_config, key) is None:
            setattr(model.generation_config, key, getattr(model.config, key))
    if causal_lm is not cls:  # LoopFormerModel (AutoModel): the base model of the translated causal LM
        model = model.model
    return (model, info) if output_loading_info else model


def from_pretrained_authors(pretrained_model_name_or_path, *model_args, model_class=None, **kwargs):
    """One of the authors' Hub repos (or a folder in their layout) loaded as a `LoopFormerForCausalLM` (or, with
    `model_class=LoopFormerModel`, its base model), whatever transformers' Auto registries hold: this is what
    `AutoModelForCausalLM.from_pretrained` runs for their repos after `import loopformer_hf`, and what to call where
    another library holds one of their model types ("base", ...). `kwargs`: `from_pretrained`'s (Hub options,
    `dtype`, `device_map`, `config`, config fields). A folder not in their layout is a ValueError."""
    from ..modeling_loopformer import LoopFormerForCausalLM, LoopFormerModel

    model_class = LoopFormerForCausalLM if model_class is None else model_class
    if not (isinstance(model_class, type) and issubclass(model_class, (LoopFormerForCausalLM, LoopFormerModel))):
        raise ValueError(f"`model_class` must be LoopFormerForCausalLM or LoopFormerModel, got {model_class!r}.")
    model = load_authors_repo(model_class, pretrained_model_name_or_path, model_args, kwargs)
    if model is None:
        raise ValueError(
            f"{os.fspath(pretrained_model_name_or_path)!r} is not in the authors' layout (a config.json whose "
            f"model_type is one of {sorted(MODEL_TYPES)}, without {' / '.join(OWN_CONFIG_KEYS)}): load it with "
            f"{model_class.__name__}.from_pretrained."
        )
    return model


# what other modules read from here: the loader, the config translation and the weight table (vLLM's loader, the
# benchmarks), each defined in the module named above
__all__ = [
    "derive_config",
    "from_pretrained_authors",
    "load_authors_repo",
    "is_reference_config",
    "is_reference_weight_name",
    "map_names",
    "mapped_reference_state_dict",
    "read_config_dict",
    "read_weight_shapes",
    "resolve_config",
    "source_defaults",
    "strip_wrapper_prefixes",
]
