"""Checks that a checkpoint folder is a complete save before it is loaded or resumed, shared by both models'
training code: a truncated or corrupt file raises `CheckpointError` naming the file instead of a deep load error."""

import json
import os
import struct

import torch


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, truncated or corrupt."""


def _check_safetensors(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated ({size} bytes): not a safetensors file.")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{path} is truncated or corrupt: header of {header_len} bytes in a {size}-byte file.")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{path} is corrupt: its safetensors header is not valid JSON ({e}).") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + header_len + end != size:
        raise CheckpointError(
            f"{path} is truncated or corrupt: the header describes {8 + header_len + end} bytes, the file has {size}."
        )


def _check_json(file, missing_message):
    """Raise `CheckpointError` if `file` is missing (with `missing_message`) or not valid JSON (naming it)."""
    try:
        with open(file) as f:
            json.load(f)
    except FileNotFoundError:
        raise CheckpointError(missing_message) from None
    except ValueError as e:
        raise CheckpointError(f"{file} is corrupt: {e}.") from None


def check_checkpoint(path, for_resume=False):
    """Raise `CheckpointError` naming the file if `path` is not a complete model (and, `for_resume`, trainer) save."""
    if not os.path.isdir(path):
        raise CheckpointError(f"Checkpoint {path!r} is not a folder.")
    _check_json(os.path.join(path, "config.json"), f"Checkpoint {path!r} has no config.json.")
    weights = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    if not weights and not os.path.exists(os.path.join(path, "pytorch_model.bin")):
        raise CheckpointError(f"Checkpoint {path!r} holds no weights (model.safetensors).")
    for name in weights:
        _check_safetensors(os.path.join(path, name))
    if for_resume:
        _check_json(os.path.join(path, "trainer_state.json"),
                    f"{path!r} is not a Trainer checkpoint: it has no trainer_state.json.")
        for name in ("optimizer.pt", "scheduler.pt"):
            file = os.path.join(path, name)
            if not os.path.exists(file):
                raise CheckpointError(f"Trainer checkpoint {path!r} lacks {name}; it cannot be resumed exactly.")
            try:
                torch.load(file, map_location="cpu", weights_only=True)
            except Exception as e:  # torch raises several types for a bad archive
                raise CheckpointError(f"{file} is truncated or corrupt ({type(e).__name__}: {e}).") from None
