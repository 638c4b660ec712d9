"""configuration_loopformer.py: LoopFormerConfig's derived values (the key/value heads, the largest loop budget, RoPE
or learned positions), the baselines as configurations, the rules between fields, and a saved config.json that must
name its loop count."""

import json

import pytest
from huggingface_hub.errors import StrictDataclassError
from support.tiny_models import tiny_loopformer_config

from loopformer_hf import LoopFormerConfig


def test_derived_values_follow_the_fields():
    config = tiny_loopformer_config(num_loops=3, max_loop_budget_factor=5)
    assert config.num_key_value_heads == config.num_attention_heads  # no grouped-query attention unless asked
    assert config.max_loop_budget == 15
    assert config.rope_parameters is None  # learned positions (the reference)
    rope = tiny_loopformer_config(position_embedding_type="rope", rope_parameters={"rope_type": "default"})
    assert rope.rope_parameters["partial_rotary_factor"] == 1.0 and rope.rope_parameters["rope_type"] == "default"


def test_the_trajectory_methods_are_the_trajectory_modules():
    config = tiny_loopformer_config(num_loops=4)
    assert config.resolve_trajectory(2) == (0.5, 0.5)
    assert config.step_schedule_preset("fine_to_coarse", 3) == [0.25, 0.25, 0.5]


@pytest.mark.parametrize(
    "overrides",
    [
        {"loop_conditioning": "timestep"},  # TMLT
        {"loop_conditioning": "none", "block_norm_weight": True},  # Base-Loop
        {"loop_conditioning": "none", "block_norm_weight": True, "num_loops": 1, "num_hidden_layers": 8},  # Base
    ],
)
def test_the_baselines_are_configurations_of_one_class(overrides):
    config = tiny_loopformer_config(**overrides)
    assert type(config) is LoopFormerConfig and all(getattr(config, k) == v for k, v in overrides.items())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 66}, "divisible by `num_attention_heads`"),
        ({"num_key_value_heads": 3}, "must divide `num_attention_heads`"),
        ({"default_loop_budget": 33}, "max_loop_budget"),
        ({"loop_conditioning": "film"}, "film"),
        ({"default_step_schedule": [0.5, 0.6]}, "sum to 1"),
        ({"hidden_act": "relu7"}, "relu7"),
    ],
)
def test_values_that_break_a_rule_are_refused(overrides, message):
    with pytest.raises((ValueError, StrictDataclassError), match=message):
        tiny_loopformer_config(**overrides)


def test_a_saved_config_reloads_equal_and_one_without_num_loops_is_refused(tmp_path):
    config = tiny_loopformer_config(num_loops=3, default_step_schedule="coarse_to_fine")
    config.save_pretrained(tmp_path)
    assert LoopFormerConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["num_loops"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="must give `num_loops`"):
        LoopFormerConfig.from_pretrained(tmp_path)
    assert LoopFormerConfig.from_pretrained(tmp_path, num_loops=3).num_loops == 3
