"""The files of a repo in the authors' layout: config.json as a dict, the weights' names and shapes from the
safetensors header (or its shard index, or a memory-mapped pytorch_model.bin) without loading a tensor, the weights
themselves as stored (`read_weights`, once every check has passed), and the ids of the tokenizer's special tokens."""

import json
import os

import torch
from transformers.utils import cached_file

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def resolve_file(path, filename, hub_kwargs):
    """The local path of `filename` in a folder or Hub repo (downloaded into transformers' cache), or None."""
    return cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **hub_kwargs)


def read_config_dict(path, hub_kwargs):
    """config.json of a folder or Hub repo as a dict, or None when there is none."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        return None  # a single file is not a repo
    resolved = resolve_file(path, "config.json", hub_kwargs)
    if resolved is None:
        return None
    with open(resolved, encoding="utf-8") as handle:
        return json.load(handle)


def _header(file):
    """{name: shape} of one safetensors file, from its header."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, "pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (SafetensorError, OSError) as error:
        raise OSError(
            f"{file!r} is not a whole safetensors file ({error}): it may be truncated or still "
            "downloading. Nothing was loaded; download it again."
        ) from None


def _weight_files(path, hub_kwargs):
    """(kind, local files) of a repo's weights: ("safetensors", the file or each shard its index names) or ("bin",
    [pytorch_model.bin]). A shard the index names that the repo lacks, or no weights at all, is an OSError."""
    for filename in WEIGHT_FILES:
        resolved = resolve_file(path, filename, hub_kwargs)
        if resolved is None:
            continue
        if not filename.endswith(".index.json"):
            return ("safetensors" if filename.endswith(".safetensors") else "bin"), [resolved]
        with open(resolved, encoding="utf-8") as handle:
            shards = sorted(set(json.load(handle)["weight_map"].values()))
        files = []
        for shard in shards:
            if (file := resolve_file(path, shard, hub_kwargs)) is None:
                raise OSError(
                    f"{os.fspath(path)!r}: {filename} names the shard {shard!r}, which the repo does "
                    "not hold. Nothing was loaded; download the repo again."
                )
            files.append(file)
        return "safetensors", files
    raise OSError(f"{os.fspath(path)!r} holds none of {WEIGHT_FILES}: there are no weights to load.")


def _load_bin(file, device):
    try:
        return torch.load(file, map_location=device, weights_only=True, mmap=True)
    except Exception as error:  # torch raises RuntimeError / UnpicklingError for a damaged file
        raise OSError(f"{file!r} could not be read ({error}). Nothing was loaded.") from None


def read_weight_shapes(path, hub_kwargs):
    """{tensor name: shape} of a repo's weights, from the safetensors header (of each shard named by the index) or
    a memory-mapped pytorch_model.bin: no tensor is read. A truncated or missing file is an OSError naming it."""
    kind, files = _weight_files(path, hub_kwargs)
    if kind == "bin":
        return {name: tuple(tensor.shape) for name, tensor in _load_bin(files[0], "meta").items()}
    return {name: shape for file in files for name, shape in _header(file).items()}


def read_weights(path, hub_kwargs):
    """{tensor name: tensor} of a repo's weights as stored (every shard; a pytorch_model.bin memory-mapped, read with
    `weights_only=True`: no object is unpickled)."""
    from safetensors.torch import load_file

    kind, files = _weight_files(path, hub_kwargs)
    if kind == "bin":
        return _load_bin(files[0], "cpu")
    return {name: tensor for file in files for name, tensor in load_file(file).items()}


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def read_special_token_ids(path, hub_kwargs):
    """{"eos_token_id": id, "bos_token_id": id} of the repo's tokenizer (GPT-2's: both <|endoftext|>): the token
    as tokenizer_config.json or special_tokens_map.json names it, its id from tokenizer.json or vocab.json. {} without
    tokenizer files; a token they do not give an id is left out."""
    named = {}
    for filename in ("special_tokens_map.json", "tokenizer_config.json"):
        if (resolved := resolve_file(path, filename, hub_kwargs)) is not None:
            with open(resolved, encoding="utf-8") as handle:
                data = json.load(handle)
            named.update({k: _token_text(data[k]) for k in ("eos_token", "bos_token") if data.get(k)})
    if not named:
        return {}
    ids = {}
    if (resolved := resolve_file(path, "tokenizer.json", hub_kwargs)) is not None:
        with open(resolved, encoding="utf-8") as handle:
            data = json.load(handle)
        ids.update((data.get("model") or {}).get("vocab") or {})
        ids.update({token["content"]: token["id"] for token in data.get("added_tokens") or []})
    elif (resolved := resolve_file(path, "vocab.json", hub_kwargs)) is not None:
        with open(resolved, encoding="utf-8") as handle:
            ids.update(json.load(handle))
    return {f"{key}_id": ids[text] for key, text in named.items() if isinstance(ids.get(text), int)}
