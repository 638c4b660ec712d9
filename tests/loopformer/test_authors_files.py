"""loopformer_hf/authors/files.py: a repo's files in the authors' layout read without loading a tensor: config.json, the weights'
names and shapes (a safetensors header, a shard index, a pytorch_model.bin mapped to "meta"), the special tokens'
ids; a truncated or missing file is an OSError naming it."""

import json

import pytest
import torch
from safetensors.torch import save_file

from loopformer_hf.authors.files import read_config_dict, read_special_token_ids, read_weight_shapes


def test_config_json_is_read_as_a_dict_and_a_folder_without_one_gives_none(tmp_path):
    assert read_config_dict(tmp_path, {}) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "loopformer", "n_embd": 8}))
    assert read_config_dict(tmp_path, {}) == {"model_type": "loopformer", "n_embd": 8}
    assert read_config_dict(tmp_path / "config.json", {}) is None  # a file is not a repo


def test_shapes_come_from_a_safetensors_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 5), "b": torch.zeros(7)}, tmp_path / "model.safetensors")
    assert read_weight_shapes(tmp_path, {}) == {"a.weight": (3, 5), "b": (7,)}


def test_shapes_come_from_every_shard_an_index_names_and_a_missing_one_is_named(tmp_path):
    save_file({"a": torch.zeros(2)}, tmp_path / "part-1.safetensors")
    save_file({"b": torch.zeros(4, 1)}, tmp_path / "part-2.safetensors")
    index = {"weight_map": {"a": "part-1.safetensors", "b": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert read_weight_shapes(tmp_path, {}) == {"a": (2,), "b": (4, 1)}
    (tmp_path / "part-2.safetensors").unlink()
    with pytest.raises(OSError, match="'part-2.safetensors'"):
        read_weight_shapes(tmp_path, {})


def test_a_pickled_state_dict_and_the_errors_of_damaged_or_absent_weights(tmp_path):
    torch.save({"w": torch.zeros(2, 3)}, tmp_path / "pytorch_model.bin")
    assert read_weight_shapes(tmp_path, {}) == {"w": (2, 3)}
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(OSError, match="could not be read"):
        read_weight_shapes(tmp_path, {})
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(OSError, match="holds none of"):
        read_weight_shapes(tmp_path, {})
    save_file({"a": torch.zeros(100)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="not a whole safetensors file"):
        read_weight_shapes(tmp_path, {})


def test_special_token_ids_from_the_tokenizers_files(tmp_path):
    assert read_special_token_ids(tmp_path, {}) == {}
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>"}, "bos_token": "<s>"})
    )
    (tmp_path / "vocab.json").write_text(json.dumps({"<|endoftext|>": 7, "a": 0}))
    assert read_special_token_ids(tmp_path, {}) == {"eos_token_id": 7}  # "<s>" has no id: left out
    tokenizer = {"model": {"vocab": {"a": 0}}, "added_tokens": [{"content": "<|endoftext|>", "id": 9}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))  # read before vocab.json
    assert read_special_token_ids(tmp_path, {}) == {"eos_token_id": 9}
