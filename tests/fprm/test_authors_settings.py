"""fprm_hf/authors/settings.py: the authors' settings derived from a checkpoint in their layout, each from the first source
that gives it (the tensors' shapes, a config file's `arch:`, the task sizes their dataset builders write, their
defaults), with where it came from; a contradiction or a value nothing determines is a `PublishedCheckpointError`.
Loading whole authors' folders is in test_authors_checkpoints_fprm.py."""

import pytest
import torch

from fprm_hf.authors.layout import COMPUTING_DEFAULTS
from fprm_hf.authors.settings import PublishedCheckpointError, data_sizes, resolve_settings, weight_settings
from fprm_hf.configuration_fprm import swiglu_width

D, VOCAB, WIDTH = 32, 11, swiglu_width(32, 4)


def _reference(prefix="model.inner.", **extra):
    """A state dict in their layout (shapes only matter): 2 layers, a 3x3 2-D conv, input-independent α."""
    shapes = {
        "embed_tokens.embedding_weight": (VOCAB, D),
        "L_level.layers.0.mlp.gate_up_proj.weight": (2 * WIDTH, D),
        "L_level.layers.1.mlp.gate_up_proj.weight": (2 * WIDTH, D),
        "L_level.conv.weight": (D, 1, 3, 3),
        "L_level.alpha_1_param": (D,),
        "L_level.alpha_2_param": (D,),
        "lm_head.weight": (VOCAB, D),
        **extra,
    }
    return {prefix + key: torch.zeros(shape) for key, shape in shapes.items()}


def test_the_shapes_show_sizes_conv_and_residual_scaling_with_their_evidence():
    found, q_head = weight_settings(_reference())
    values = {field: value for field, (value, _) in found.items()}
    assert values["vocab_size"] == VOCAB and values["hidden_size"] == D and values["L_layers"] == 2
    assert values["intermediate_size"] == WIDTH
    assert (values["conv_type"], values["conv_kernel_size"], values["conv_bias"]) == ("conv2d", 3, False)
    assert (values["residual_scale"], values["outer_only"]) == ("input-independent", False)
    assert values["puzzle_emb_ndim"] == 0 and values["fixed_init"] is False and not q_head
    assert found["hidden_size"][1] == f"embed_tokens.embedding_weight {(VOCAB, D)}"


def test_other_layouts_of_the_shapes():
    extra = {"q_head.weight": (2, D), "puzzle_emb.weights": (5, 64), "L_level.conv.bias": (D,)}
    found, q_head = weight_settings(_reference(prefix="_orig_mod.model.inner.", **extra))
    assert q_head and found["num_puzzle_identifiers"][0] == 5 and found["puzzle_emb_ndim"][0] == 64
    assert found["conv_bias"][0] is True
    fixed = _reference()
    fixed["model.inner.L_level.alpha_1_param"] = torch.tensor(0.3)
    del fixed["model.inner.L_level.alpha_2_param"]
    assert weight_settings(fixed)[0]["residual_scale"][0] == "fixed"
    none = {k: v for k, v in _reference().items() if "alpha" not in k and "conv" not in k}
    found, _ = weight_settings(none)
    assert found["residual_scale"][0] is None and found["conv_type"][0] == "none"


def test_a_state_dict_that_is_not_theirs_is_refused():
    with pytest.raises(PublishedCheckpointError, match="not their FPRM"):
        weight_settings({"model.inner.lm_head.weight": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="unknown keys"):
        weight_settings({"embed_tokens.embedding_weight": torch.zeros(3, 4)})


def test_task_sizes_come_from_the_data_paths_name():
    sizes, source = data_sizes(["/data/maze-30x30-hard-1k/"])
    assert sizes == {"seq_len": 900, "grid": (30, 30), "vocab_size": 6} and "maze-30x30" in source
    assert data_sizes(["data/sudoku-extreme-1k-aug-1000"])[0] == {"seq_len": 81, "grid": (9, 9), "vocab_size": 11}
    assert data_sizes(["data/arc-agi"]) == (None, None) and data_sizes(None) == (None, None)


def test_each_setting_comes_from_the_first_source_that_gives_it():
    arch = {"num_heads": 4, "expansion": 4, "pos_encodings": "rope", "stepsize": 0.5}
    settings, grid, sources = resolve_settings(_reference(), arch, "all_config.yaml arch", ["data/sudoku-extreme"])
    assert settings["hidden_size"] == D and sources["hidden_size"].startswith("weights: ")
    assert settings["num_heads"] == 4 and sources["num_heads"] == "all_config.yaml arch.num_heads"
    assert settings["seq_len"] == 81 and grid == [9, 9] and "build_sudoku_dataset" in sources["seq_len"]
    assert settings["stepsize"] == 0.5  # stated beats their default
    assert settings["eps"] == COMPUTING_DEFAULTS["eps"] and "fprm_config.py FPRMConfig default" in sources["eps"]
    assert settings["num_puzzle_identifiers"] == 1


@pytest.mark.parametrize(
    "arch, data, message",
    [
        ({"hidden_size": 64, "num_heads": 4, "seq_len": 81, "pos_encodings": "rope"}, None, "states hidden_size=64"),
        ({"expansion": 13, "num_heads": 4, "seq_len": 81, "pos_encodings": "rope"}, None, "states expansion=13"),
        ({"num_heads": 4, "pos_encodings": "rope"}, ["data/maze-30x30"], "gives vocab_size=6"),
        ({"num_heads": 4}, None, r"nothing determines \['seq_len', 'pos_encodings'\]"),
    ],
)
def test_a_contradiction_or_a_setting_nothing_gives_is_refused_by_name(arch, data, message):
    with pytest.raises(PublishedCheckpointError, match=message):
        resolve_settings(_reference(), arch, "all_config.yaml arch", data)
