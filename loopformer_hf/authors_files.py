"""The files of a repo in the authors' layout, read without loading a tensor: config.json as a dict, and the weights'
names and shapes from the safetensors header (or its shard index, or a memory-mapped pytorch_model.bin)."""

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


def read_weight_shapes(path, hub_kwargs):
    """{tensor name: shape} of a repo's weights, from the safetensors header (of each shard named by the index) or
    a memory-mapped pytorch_model.bin: no tensor is read. A truncated or missing file is an OSError naming it."""
    for filename in WEIGHT_FILES:
        resolved = resolve_file(path, filename, hub_kwargs)
        if resolved is None:
            continue
        if filename.endswith(".index.json"):
            with open(resolved, encoding="utf-8") as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            shapes = {}
            for shard in shards:
                file = resolve_file(path, shard, hub_kwargs)
                if file is None:
                    raise OSError(
                        f"{os.fspath(path)!r}: {filename} names the shard {shard!r}, which the repo does "
                        "not hold. Nothing was loaded; download the repo again."
                    )
                shapes.update(_header(file))
            return shapes
        if filename.endswith(".safetensors"):
            return _header(resolved)
        try:
            state_dict = torch.load(resolved, map_location="meta", weights_only=True, mmap=True)
        except Exception as error:  # torch raises RuntimeError / UnpicklingError for a damaged file
            raise OSError(f"{resolved!r} could not be read ({error}). Nothing was loaded.") from None
        return {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    raise OSError(f"{os.fspath(path)!r} holds none of {WEIGHT_FILES}: there are no weights to load.")
