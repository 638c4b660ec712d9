"""fprm_hf/authors/layout.py: the authors' arch fields (their names, their defaults) checked and built into an `FPRMConfig`,
and their state dict mapped onto this package's names, key by key and shape by shape. Each direction is checked
against a table written here from their code's module names; whole authors' folders load in
test_authors_checkpoints_fprm.py."""

import pytest
import torch

from fprm_hf import FPRMForReasoning
from fprm_hf.authors.layout import (
    build_config,
    check_settings,
    fixed_alphas_of,
    grid_size_of,
    map_reference_state_dict,
    prefix_rows,
    unknown_settings,
)

SETTINGS = {  # a Sudoku-like model in their field names: 4x4 grid, 16 prefix rows of a 32-wide puzzle embedding
    "vocab_size": 6,
    "seq_len": 16,
    "num_puzzle_identifiers": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "expansion": 4,
    "L_layers": 2,
    "pos_encodings": "rope",
    "puzzle_emb_ndim": 32,
    "puzzle_emb_len": 0,
    "norm_type": "pre-norm",
    "conv_type": "conv2d",
    "conv_kernel_size": 3,
    "residual_scale": "input-independent",
    "stepsize": 0.5,
    "max_iter_eval": 12,
}


def test_their_fields_become_ours():
    config = build_config(SETTINGS)
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads) == (6, 32, 4)
    assert (config.num_hidden_layers, config.norm_type, config.residual_scaling) == (2, "pre", "input_independent")
    assert (config.conv_type, config.conv_kernel_size, config.grid_shape) == ("2d", 3, (4, 4))
    assert config.num_prefix_tokens == 1 and config.max_position_embeddings == 17  # one row holds the 32 values
    assert (config.eta, config.max_loops, config.num_puzzle_identifiers) == (0.5, 12, 3)
    defaults = build_config({**SETTINGS, "stepsize": 1.0, "max_iter_eval": None})
    assert defaults.halt_eps == 0.1 and defaults.gamma_eval == 0.99 and defaults.patience == 5  # their defaults


def test_prefix_rows_and_grids():
    assert prefix_rows({"hidden_size": 16, "puzzle_emb_ndim": 40, "puzzle_emb_len": 0}) == 3  # ceil(40 / 16)
    assert prefix_rows({"hidden_size": 16, "puzzle_emb_ndim": 40, "puzzle_emb_len": 16}) == 16
    with pytest.raises(ValueError, match="no puzzle embedding to fill the 16 prefix rows"):
        prefix_rows({"hidden_size": 16, "puzzle_emb_ndim": 0, "puzzle_emb_len": 16})
    assert grid_size_of((2, 8), "2d", 16) == [2, 8] and grid_size_of(None, "2d", 81) == 9
    assert grid_size_of(None, "causal_1d", 10) is None
    with pytest.raises(ValueError, match="a 3x3 grid has 9 tokens, seq_len is 16"):
        grid_size_of((3, 3), "2d", 16)
    with pytest.raises(ValueError, match="needs a square grid, got seq_len=10"):
        grid_size_of(None, "2d", 10)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"colour": 1}, r"unknown settings \['colour'\]"),
        ({"num_heads": None}, r"missing settings \['num_heads'\]"),
        ({"mlp_t": True}, "mlp_t=True"),
        ({"additive_noise_std": 0.1}, "additive_noise_std=0.1"),
        ({"eps": 1e-6}, "eps=1e-06"),
        ({"residual_scale": "learned"}, "`residual_scale` must be one of"),
        ({"norm_type": "sandwich"}, "`norm_type` must be one of"),
        ({"mlp_t": "no"}, "`mlp_t` must be true or false"),
    ],
)
def test_what_this_model_does_not_compute_is_refused_by_field(change, message):
    with pytest.raises(ValueError, match=message):
        check_settings({**SETTINGS, **change})


def test_fields_that_change_only_training_are_accepted():
    assert unknown_settings({**SETTINGS, "H_cycles": 3, "halt_max_steps": 16, "loss": "x"}) == []
    assert check_settings(SETTINGS)["softmax_temp"] == 1.0  # their default filled in
    with pytest.raises(ValueError, match="`causal` must be true or false"):
        build_config({**SETTINGS, "causal": "yes"})


# their module name -> ours (written from their code: models/fixed_point_reasoning/fprm.py and layers.py)
THEIRS = {
    "embed_tokens.embedding_weight": "model.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "puzzle_emb.weights": "model.prefix",
    "L_level.conv.weight": "model.conv.weight",
    "L_level.alpha_1_param": "model.residual_scaling.alpha1_logit",
    "L_level.alpha_2_param": "model.residual_scaling.alpha2_logit",
    **{
        f"L_level.layers.{i}.{name}.weight": f"model.layers.{i}.{name}.weight"
        for i in range(2)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    },
}


def _their_state_dict(model):
    ours = model.state_dict()
    reference = {"_orig_mod.model.inner." + theirs: ours[mine].clone() for theirs, mine in THEIRS.items()}
    # their puzzle embedding: one row of puzzle_emb_ndim values per identifier
    reference["_orig_mod.model.inner.puzzle_emb.weights"] = ours["model.prefix"].flatten(1).clone()
    reference["_orig_mod.model.inner.lm_head.mask"] = torch.ones_like(ours["lm_head.weight"])  # DropConnect's
    return reference


def test_their_state_dict_maps_onto_every_weight_of_ours():
    config = build_config(SETTINGS)
    torch.manual_seed(0)
    model = FPRMForReasoning(config)
    assert set(model.state_dict()) == set(THEIRS.values())  # the table covers the model
    mapped, dropped = map_reference_state_dict(_their_state_dict(model), config)
    assert dropped == ["lm_head.mask"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(mapped[name], tensor.float())


def test_a_key_or_shape_that_is_not_theirs_is_refused():
    config = build_config(SETTINGS)
    reference = _their_state_dict(FPRMForReasoning(config))
    with pytest.raises(ValueError, match=r"unknown keys \['L_level.extra.weight'\]"):
        map_reference_state_dict({**reference, "model.inner.L_level.extra.weight": torch.zeros(1)}, config)
    reference["model.inner.L_level.conv.weight"] = torch.zeros(32, 1, 5, 5)
    del reference["_orig_mod.model.inner.L_level.conv.weight"]
    with pytest.raises(ValueError, match=r"wrong shapes: \['model.conv.weight: checkpoint \(32, 1, 5, 5\)"):
        map_reference_state_dict(reference, config)
    with pytest.raises(ValueError, match="every key of their checkpoint starts with 'model.inner.'"):
        map_reference_state_dict({"lm_head.weight": torch.zeros(1)}, config)


def test_fixed_alphas_are_read_from_scalars():
    reference = {
        "model.inner.L_level.alpha_1_param": torch.tensor(0.25),
        "model.inner.L_level.alpha_2_param": torch.ones(3),
    }
    assert fixed_alphas_of(reference) == {"alpha1": 0.25}
    config = build_config({**SETTINGS, "residual_scale": "fixed"}, fixed_alphas=fixed_alphas_of(reference))
    assert (config.residual_scaling, config.alpha1, config.alpha2) == ("fixed", 0.25, 0.5)
