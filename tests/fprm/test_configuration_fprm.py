"""configuration_fprm.py: FPRMConfig's derived values (the authors' SwiGLU width, the conv kernel per conv type, the
grid as height × width, RoPE or none), the rules between fields, and a config.json that reloads equal."""

import pytest
from huggingface_hub.errors import StrictDataclassError
from support.tiny_models import sequence_fprm_config, tiny_fprm_config

from fprm_hf import FPRMConfig
from fprm_hf.configuration_fprm import swiglu_width


@pytest.mark.parametrize("hidden, expansion, width", [(512, 4, 1536), (32, 4, 256), (384, 2.5, 768), (768, 4, 2048)])
def test_the_swiglu_width_is_two_thirds_of_the_expansion_rounded_up_to_256(hidden, expansion, width):
    # 512·4·2/3 = 1365.3 -> 1536; 32·4·2/3 = 85.3 -> 256; 384·2.5·2/3 = 640 -> 768; 768·4·2/3 = 2048 -> 2048
    assert swiglu_width(hidden, expansion) == width


def test_derived_values_follow_the_fields():
    config = tiny_fprm_config(intermediate_size=None, expansion=4, grid_size=[2, 8])
    assert config.intermediate_size == swiglu_width(32, 4)
    assert config.grid_shape == (2, 8) and config.num_grid_tokens == 16 and config.grid_size == [2, 8]
    square = tiny_fprm_config(grid_size=3)
    assert square.grid_shape == (3, 3) and square.num_grid_tokens == 9
    assert tiny_fprm_config(conv_kernel_size=None).conv_kernel_size == 3  # "2d"
    sequence = sequence_fprm_config(conv_kernel_size=None)
    assert sequence.conv_kernel_size == 4 and sequence.grid_shape is None and sequence.num_grid_tokens is None
    assert sequence.rope_parameters is None  # position_embedding_type "none"
    assert tiny_fprm_config().rope_parameters["partial_rotary_factor"] == 1.0  # the default RoPE


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"hidden_size": 30}, "divisible by `num_attention_heads`"),
        ({"grid_size": None}, "needs `grid_size`"),
        ({"conv_kernel_size": 4}, "odd `conv_kernel_size`"),
        ({"puzzle_emb_ndim": 2 * 32 + 1}, "at most num_prefix_tokens × hidden_size"),
        ({"alpha1": 1.0}, "alpha1"),
        ({"norm_type": "sandwich"}, "sandwich"),
    ],
)
def test_values_that_break_a_rule_are_refused(overrides, message):
    with pytest.raises((ValueError, StrictDataclassError), match=message):
        tiny_fprm_config(**overrides)


def test_a_saved_config_reloads_equal(tmp_path):
    config = tiny_fprm_config(residual_scaling="fixed", alpha1=0.25, grid_size=[2, 8])
    config.save_pretrained(tmp_path)
    loaded = FPRMConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict() and loaded.grid_shape == (2, 8)
