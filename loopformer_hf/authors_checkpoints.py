"""The authors' published checkpoints (armenjeddi/LoopFormer-*, Base-Loop-*) loaded into this package's classes.

Their Hub repos were written by their own wrapper around the GitHub `GPT` (models/loopformer.py and siblings) and are
read back by its `GPT.from_pretrained`; the layout below is rebuilt from that loader (the Hub files themselves could
not be reached from the machine this was written on):

- config.json: `model_type` (loopformer, tmlt, base_loop, base_loop_ee, …), nanoGPT keys or their GPT-2 aliases
  (`n_embd`/`hidden_size`, `n_layer`/`num_hidden_layers`, `n_head`/`num_attention_heads`, `block_size`/
  `n_positions`/`max_position_embeddings`, `intermediate_dim`/`n_inner` (default 4·n_embd), `dropout`/`resid_pdrop`,
  `bias`) and `steps`: LoopFormer's default trajectory (step sizes summing to 1) or Base-Loop's loop count;
  their forward's default (`[1/8]*8`, 8) when absent.
- weights: their `GPT`'s state-dict names under a wrapper prefix (`gpt.`, `model.`, `module.`, stripped as their
  loader strips them), the tied head saved only as `transformer.wte.weight`.

`LoopFormerConfig.from_dict` translates such a config (`translate_config`), and `from_pretrained` maps the weights
through `convert_reference.map_reference_state_dict`, which names every key it cannot map or the model misses in one
`ValueError`: a repo in their layout never loads as a randomly initialised model.
"""

import json
import os

import torch

from .convert_reference import MODEL_TYPES, map_reference_state_dict


# Fields only this package's configs carry: a config.json with any of them is ours, not the authors'.
OWN_CONFIG_KEYS = ("num_loops", "loop_conditioning")
# nanoGPT name -> the names their loader also accepts, in its order of preference (`_get` in GPT.from_pretrained).
REFERENCE_CONFIG_KEYS = {
    "block_size": ("block_size", "n_positions", "max_position_embeddings"),
    "vocab_size": ("vocab_size",),
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_head": ("n_head", "num_attention_heads"),
    "n_embd": ("n_embd", "hidden_size"),
    "dropout": ("dropout", "resid_pdrop"),
    "bias": ("bias",),
    "intermediate_dim": ("intermediate_dim", "n_inner"),
}
REQUIRED_REFERENCE_KEYS = ("vocab_size", "n_layer", "n_head", "n_embd")
DEFAULT_BLOCK_SIZE = 1024  # their GPTConfig's
DEFAULT_STEPS = 8  # their forward's default: steps=[1/8]*8 (LoopFormer) or steps=8 (TMLT, Base-Loop)
WRAPPER_PREFIXES = ("gpt.", "model.", "module.")  # their loader's `_strip_prefixes`
# their GPT's modules; `lm_head.` is both theirs and ours, so it decides nothing
REFERENCE_WEIGHT_ROOTS = ("transformer.", "time_embedder.", "dt_embedder.")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")


def is_reference_config(config_dict):
    """True for a config.json in the authors' layout: one of their model types and none of our own fields."""
    return config_dict.get("model_type") in MODEL_TYPES and not any(key in config_dict for key in OWN_CONFIG_KEYS)


def _reference_value(config_dict, name):
    for key in REFERENCE_CONFIG_KEYS[name]:
        if config_dict.get(key) is not None:
            return config_dict[key]
    return None


def _trajectory(steps, model_type):
    """(L, default step schedule) from their `steps`: a list of step sizes, or a loop count."""
    if steps is None:
        return DEFAULT_STEPS, "uniform"
    if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1:
        return steps, "uniform"
    if isinstance(steps, (list, tuple)) and steps:
        if len({round(float(s), 9) for s in steps}) == 1:
            return len(steps), "uniform"
        if model_type != "loopformer":
            raise ValueError(f"`steps`={steps!r}: a {model_type!r} model only counts its loop steps; unequal step "
                             "sizes need model_type 'loopformer'.")
        return len(steps), [float(s) for s in steps]
    raise ValueError(f"`steps` must be a loop count >= 1 or a list of step sizes summing to 1, got {steps!r}.")


def translate_config(config_dict):
    """`LoopFormerConfig` keyword arguments for a config.json in the authors' layout (`is_reference_config`)."""
    model_type = config_dict["model_type"]
    values = {name: _reference_value(config_dict, name) for name in REFERENCE_CONFIG_KEYS}
    missing = [name for name in REQUIRED_REFERENCE_KEYS if values[name] is None]
    if missing:
        raise ValueError(
            f"config.json claims model_type {model_type!r} but is neither this package's layout (no "
            f"{' / '.join(OWN_CONFIG_KEYS)}) nor the authors' (no "
            f"{', '.join(' / '.join(REFERENCE_CONFIG_KEYS[name]) for name in missing)}); its keys are "
            f"{sorted(config_dict)}."
        )
    loop_conditioning, block_norm_weight, plain_list = MODEL_TYPES[model_type]
    num_loops, schedule = (1, "uniform") if plain_list else _trajectory(config_dict.get("steps"), model_type)
    n_embd, bias = int(values["n_embd"]), bool(values["bias"] or False)
    return dict(
        vocab_size=int(values["vocab_size"]),
        hidden_size=n_embd,
        num_attention_heads=int(values["n_head"]),
        intermediate_size=int(values["intermediate_dim"] or 4 * n_embd),
        num_hidden_layers=int(values["n_layer"]),
        num_loops=num_loops,
        default_step_schedule=schedule,
        loop_conditioning=loop_conditioning,
        block_norm_weight=block_norm_weight,
        hidden_act="gelu",
        position_embedding_type="learned",
        max_position_embeddings=int(values["block_size"] or DEFAULT_BLOCK_SIZE),
        tie_word_embeddings=True,
        rms_norm_eps=None,  # torch's default, as their nn.RMSNorm
        attention_bias=bias,
        mlp_bias=bias,
        attention_dropout=float(values["dropout"] or 0.0),
        architectures=["LoopFormerForCausalLM"],  # the class that now holds the weights (vLLM resolves by it)
        bos_token_id=config_dict.get("bos_token_id"),
        eos_token_id=config_dict.get("eos_token_id"),
        pad_token_id=config_dict.get("pad_token_id"),
    )


# ---- weights -------------------------------------------------------------------------------------------------------


def strip_wrapper_prefixes(state_dict):
    """Their loader's `_strip_prefixes`: `gpt.`, `model.` and `module.` removed, repeatedly, from every key."""
    out = {}
    for key, tensor in state_dict.items():
        name = key
        while name.startswith(WRAPPER_PREFIXES):
            name = name[len(next(p for p in WRAPPER_PREFIXES if name.startswith(p))):]
        if name in out:
            raise ValueError(f"two tensors of the checkpoint map to {name!r} once the wrapper prefixes "
                             f"{WRAPPER_PREFIXES} are removed (one of them is {key!r}).")
        out[name] = tensor
    return out


def reference_model_type(config, keys):
    """The reference file a model of `config` comes from, as `MODEL_TYPES` names it (blocks in a plain list: base)."""
    if config.loop_conditioning == "shortcut":
        return "loopformer"
    if config.loop_conditioning == "timestep":
        return "tmlt"
    return "base" if any(k.startswith("transformer.h.") and not k.startswith("transformer.h.blocks.")
                         for k in keys) else "base_loop"


def is_reference_weight_name(name):
    """True for a tensor name of their `GPT` (after the wrapper prefixes), never for one of ours (`model.…`)."""
    return next(iter(strip_wrapper_prefixes({name: None}))).startswith(REFERENCE_WEIGHT_ROOTS)


def mapped_reference_state_dict(state_dict, config):
    """Their state dict (wrapper prefixes allowed) under our names, every key checked (`map_reference_state_dict`)."""
    reference = strip_wrapper_prefixes(state_dict)
    return map_reference_state_dict(reference, config, reference_model_type(config, reference))


def _resolve(path, filename, hub_kwargs):
    from transformers.utils import cached_file

    return cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)


def read_config_dict(path, hub_kwargs):
    """config.json of a folder or Hub repo as a dict, or None when there is none."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return None  # a single file is not a repo
    resolved = _resolve(path, "config.json", hub_kwargs)
    if resolved is None:
        return None
    with open(resolved, encoding="utf-8") as handle:
        return json.load(handle)


def _refuse_reference_weights_under_our_config(path, hub_kwargs):
    """Our config.json over weights named as theirs would load as a randomly initialised model (transformers only
    warns about missing keys): refuse it, reading only the weight names (a safetensors header or shard index)."""
    from safetensors import SafetensorError, safe_open

    resolved = _resolve(path, "model.safetensors", hub_kwargs)
    if resolved is not None:
        try:
            with safe_open(resolved, "pt") as handle:
                names = list(handle.keys())
        except SafetensorError:
            return  # not a safetensors file: from_pretrained's own load names it
    else:
        index = _resolve(path, "model.safetensors.index.json", hub_kwargs)
        if index is None:
            return
        with open(index, encoding="utf-8") as handle:
            names = list(json.load(handle)["weight_map"])
    theirs = sorted(name for name in names if is_reference_weight_name(name))
    if theirs:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json is in this package's layout (it has {' / '.join(OWN_CONFIG_KEYS)}), "
            f"but the weights are named as the authors' GPT ({theirs[:3]}, …): the config was replaced or edited. "
            f"Use their config.json (it is translated), or convert with `python -m loopformer_hf.convert_reference`."
        )


def read_weights(path, hub_kwargs):
    """The flat state dict of a repo's weights: model.safetensors, its sharded index, or pytorch_model.bin
    (read with `weights_only=True`)."""
    from safetensors.torch import load_file

    for filename in WEIGHT_FILES:
        resolved = _resolve(path, filename, hub_kwargs)
        if resolved is None:
            continue
        if filename.endswith(".index.json"):
            with open(resolved, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            state_dict = {}
            for shard in shards:
                state_dict.update(load_file(_resolve(path, shard, hub_kwargs)))
            return state_dict
        if filename.endswith(".safetensors"):
            return load_file(resolved)
        return torch.load(resolved, map_location="cpu", weights_only=True)
    raise OSError(f"{os.fspath(path)!r} holds none of {WEIGHT_FILES}: there are no weights to load.")


def load_reference_model(cls, path, config, dtype=None, hub_kwargs=None, device=None):
    """A `LoopFormerForCausalLM` (eval) with the weights of the authors' repo `path`, whose translated config is
    `config`. `dtype`: None or "auto" keeps the checkpoint's dtype."""
    weights = read_weights(path, hub_kwargs or {})
    if "model.embed_tokens.weight" in weights:
        raise ValueError(
            f"{os.fspath(path)!r}: config.json has none of this package's fields ({', '.join(OWN_CONFIG_KEYS)}), as "
            f"the authors' configs, but the weights are in this package's layout (model.embed_tokens.weight, …): the "
            f"config was edited or truncated. Restore it (num_loops is the number of loop steps L it was trained with)."
        )
    state_dict = mapped_reference_state_dict(weights, config)
    if dtype in (None, "auto"):
        dtype = next(t.dtype for t in state_dict.values() if t.is_floating_point())
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):  # every parameter comes from the checkpoint: nothing to initialise
        model = cls(config)
    model.load_state_dict({k: v.to(dtype=dtype, device=device or "cpu") for k, v in state_dict.items()},
                          strict=False, assign=True)
    model.lm_head.weight = model.model.embed_tokens.weight  # the tie their checkpoint stores once
    left_on_meta = [name for name, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left_on_meta:  # map_reference_state_dict checked the keys; this would be a bug of the mapping
        raise RuntimeError(f"internal error: not loaded from the checkpoint: {left_on_meta}")
    model.config.dtype = dtype
    return model.eval()


def load_generation_config(model, path, hub_kwargs):
    """The repo's generation_config.json, through the hook `from_pretrained` uses (loop knobs written there by hand
    count, and a bad one is refused naming the file). Theirs sets nothing ({"_from_model_config": true}): generation
    is then greedy, as our `generate` documents, and says so, so that pipelines do not fall back to sampling."""
    defaults = {"cache_dir": None, "force_download": False, "proxies": None, "local_files_only": False,
                "token": None, "revision": "main", "subfolder": ""}  # from_pretrained's
    options = {name: hub_kwargs.get(name, default) for name, default in defaults.items()}
    model.adjust_generation_fn(None, False, False, path, trust_remote_code=False, **options)
    if model.generation_config.do_sample is None:
        model.generation_config.do_sample = False
    model.generation_config._from_model_config = False


__all__ = ["is_reference_config", "translate_config", "strip_wrapper_prefixes", "load_reference_model",
           "read_config_dict", "read_weights"]


def reference_config_classes():
    """One `LoopFormerConfig` subclass per model type of theirs other than "loopformer" (ours), so that
    `AutoConfig` recognises their repos; `from_dict` returns a plain `LoopFormerConfig` for each."""
    from .configuration_loopformer import LoopFormerConfig

    return [type(f"Reference_{name}_Config", (LoopFormerConfig,), {"model_type": name, "__module__": __name__})
            for name in MODEL_TYPES if name != LoopFormerConfig.model_type]


# from_pretrained kwargs that change nothing here (the weights are read whole, on the CPU, without remote code; a
# tensor of another shape than the config's is refused whatever ignore_mismatched_sizes says, never re-initialised)
_ACCEPTED_NOOPS = ("trust_remote_code", "low_cpu_mem_usage", "_from_auto", "_from_pipeline", "use_safetensors",
                   "code_revision", "adapter_kwargs", "ignore_mismatched_sizes")


def from_pretrained_reference(cls, path, model_args, kwargs):
    """`cls.from_pretrained(path, ...)` for a repo in the authors' layout, or None when `path` is not one."""
    hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if kwargs.get(key) is not None}
    config_dict = read_config_dict(path, hub_kwargs)
    if config_dict is None or config_dict.get("model_type") not in MODEL_TYPES:
        return None
    if not is_reference_config(config_dict):
        _refuse_reference_weights_under_our_config(path, hub_kwargs)
        return None
    from .configuration_loopformer import LoopFormerConfig

    # None is transformers' default for every option (lm-eval's HFLM passes gguf_file=None, max_memory=None, …)
    kwargs = {key: value for key, value in kwargs.items()
              if value is not None and key not in HUB_KWARGS and key not in _ACCEPTED_NOOPS}
    if model_args:
        raise ValueError(f"positional model arguments {model_args!r} are not accepted for the authors' layout.")
    config = kwargs.pop("config", None)
    if not isinstance(config, LoopFormerConfig):  # Auto passes the config it translated already
        config = LoopFormerConfig.from_dict(config_dict)
    dtype = kwargs.pop("dtype", None) or kwargs.pop("torch_dtype", None)
    device = kwargs.pop("device_map", None)
    if isinstance(device, dict) and len(set(map(str, device.values()))) == 1:  # {"": "cpu"}: one device
        device = next(iter(device.values()))
    if device in ("auto", None):
        device = "cpu"
    elif not isinstance(device, (str, torch.device)):
        raise ValueError(f"`device_map`={device!r}: the authors' layout loads onto one device; give a device string or a map onto one device.")
    attn_implementation = kwargs.pop("attn_implementation", None)
    output_loading_info = kwargs.pop("output_loading_info", False)
    unknown = sorted(key for key in kwargs if not hasattr(config, key))
    if unknown:
        raise ValueError(f"from_pretrained got keyword arguments that are neither config fields nor loading options: "
                         f"{unknown}.")
    for key, value in kwargs.items():  # config overrides, as transformers applies them (validated on assignment)
        setattr(config, key, value)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    config._name_or_path = os.fspath(path)
    from .modeling_loopformer import LoopFormerForCausalLM

    causal_lm = cls if issubclass(cls, LoopFormerForCausalLM) else LoopFormerForCausalLM
    model = load_reference_model(causal_lm, path, config, dtype=dtype, hub_kwargs=hub_kwargs, device=device)
    load_generation_config(model, path, hub_kwargs)
    if causal_lm is not cls:  # LoopFormerModel (AutoModel): the base model of the translated causal LM
        model = model.model
    if output_loading_info:
        return model, {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    return model
