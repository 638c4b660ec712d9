"""loopformer_hf/authors/config.py: an authors' config.json translated into `LoopFormerConfig` keyword arguments, every value from
the first source that determines it (the weights' shapes, config.json, their code's defaults, the repo's name, their
GitHub defaults), and a contradiction between the weights and a file refused. Loading whole stand-in repos is in
test_authors_checkpoints.py."""

import pytest

from loopformer_hf import LoopFormerConfig
from loopformer_hf.authors.auto import AUTHORS_CONFIG_CLASSES
from loopformer_hf.authors.model_types import is_reference_config
from loopformer_hf.authors.config import GITHUB_DEFAULTS, resolve_config, weight_family, weight_values

SHAPES = {  # a LoopFormer with 2 blocks, d 48, FFN 96, 50 tokens, 32 positions, biases, 64 sinusoid features
    "transformer.wte.weight": (50, 48),
    "transformer.wpe.weight": (32, 48),
    "transformer.h.blocks.0.attn.c_attn.weight": (144, 48),
    "transformer.h.blocks.0.attn.c_attn.bias": (144,),
    "transformer.h.blocks.0.mlp.c_fc.weight": (96, 48),
    "transformer.h.blocks.1.mlp.c_fc.weight": (96, 48),
    "time_embedder.mlp.0.weight": (48, 64),
    "dt_embedder.mlp.0.weight": (48, 64),
}


def test_a_reference_config_is_one_of_their_model_types_without_our_fields():
    assert is_reference_config({"model_type": "loopformer", "n_embd": 48})
    assert is_reference_config({"model_type": "base_loop"})
    assert not is_reference_config({"model_type": "loopformer", "num_loops": 4})  # ours
    assert not is_reference_config({"model_type": "llama"})


def test_the_weight_names_show_the_family():
    assert weight_family(SHAPES) == "loopformer"
    assert weight_family([n for n in SHAPES if not n.startswith("dt_")]) == "tmlt"
    assert weight_family(["transformer.h.blocks.0.mlp.c_fc.weight"]) == "base_loop"
    assert weight_family(["transformer.h.3.mlp.c_fc.weight"]) == "base"
    assert weight_family(["model.layers.0.mlp.up_proj.weight"]) is None


def test_the_shapes_give_sizes_and_say_which_tensor_shows_each():
    values = {name: value for name, (value, _) in weight_values(SHAPES).items()}
    assert values == {
        "vocab_size": 50,
        "n_embd": 48,
        "block_size": 32,
        "n_layer": 2,
        "intermediate_dim": 96,
        "bias": True,
        "frequency_embedding_size": 64,
    }
    assert "transformer.wpe.weight has shape (32, 48)" in weight_values(SHAPES)["block_size"][1]


def test_the_weights_decide_and_config_json_fills_what_no_shape_gives():
    kwargs = resolve_config({"model_type": "loopformer", "n_head": 4, "steps": [0.25, 0.75]}, SHAPES)
    assert (kwargs["vocab_size"], kwargs["hidden_size"], kwargs["num_hidden_layers"]) == (50, 48, 2)
    assert kwargs["intermediate_size"] == 96 and kwargs["attention_bias"] is kwargs["mlp_bias"] is True
    assert (
        kwargs["num_attention_heads"] == 4 and kwargs["authors_config_sources"]["num_attention_heads"] == "config.json"
    )
    assert (kwargs["num_loops"], kwargs["default_step_schedule"]) == (2, [0.25, 0.75])
    assert kwargs["loop_conditioning"] == "shortcut" and kwargs["frequency_embedding_size"] == 64
    config = LoopFormerConfig(**kwargs)  # the keyword arguments make a valid config
    assert config.num_loops == 2


def test_a_file_that_contradicts_the_weights_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"`n_embd`: config.json says 64, but the weights say 48"):
        resolve_config({"model_type": "loopformer", "n_embd": 64, "n_head": 4}, SHAPES)
    with pytest.raises(ValueError, match="the weights hold a 'loopformer' model"):
        resolve_config({"model_type": "base_loop"}, SHAPES)


def test_without_weights_config_json_then_the_code_then_the_repos_name_then_github():
    stated = {"model_type": "tmlt", "n_embd": 64, "n_head": 2, "vocab_size": 10, "block_size": 16}
    kwargs = resolve_config(stated, code_defaults={"n_head": 8, "n_layer": 5}, code_source="model.py's default")
    assert kwargs["num_attention_heads"] == 2 and kwargs["num_hidden_layers"] == 5  # config.json first, then code
    assert kwargs["intermediate_size"] == GITHUB_DEFAULTS["intermediate_dim"]
    by_name = resolve_config(stated, name_or_path="someone/TMLT-2blocks-12iterations")
    assert by_name["num_loops"] == 12 and by_name["loop_conditioning"] == "timestep"
    assert resolve_config(stated)["num_loops"] == 8  # their forward's default


def test_base_runs_one_pass_and_counts_are_not_step_sizes():
    base = resolve_config({"model_type": "base", "n_embd": 8, "n_head": 2})
    assert base["num_loops"] == 1 and base["num_hidden_layers"] == 24 and base["block_norm_weight"] is True
    with pytest.raises(ValueError, match="only counts its loop steps"):
        resolve_config({"model_type": "tmlt", "n_embd": 8, "n_head": 2, "steps": [0.25, 0.75]})
    with pytest.raises(ValueError, match="sum to 0.5, not 1"):
        resolve_config({"model_type": "loopformer", "n_embd": 8, "n_head": 2, "steps": [0.25, 0.25]})
    with pytest.raises(ValueError, match="do not divide the width"):
        resolve_config({"model_type": "loopformer", "n_embd": 10, "n_head": 4})


def test_their_model_types_are_config_classes_of_ours():
    types = [cls.model_type for cls in AUTHORS_CONFIG_CLASSES]
    assert types == ["tmlt", "tmlt_ee", "base_loop", "base_loop_ee", "base"]
    assert all(issubclass(cls, LoopFormerConfig) for cls in AUTHORS_CONFIG_CLASSES)
