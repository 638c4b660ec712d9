"""inputs_fprm.py: the arguments of an FPRM call checked before anything runs: flags, token inputs against the
config (grid, vocabulary, positions), puzzle identifiers, the all-ones attention mask, labels; each refusal a
`ValueError` naming the argument."""

import pytest
import torch
from support.tiny_models import sequence_fprm_config, tiny_fprm_config

from fprm_hf.inputs_fprm import (
    FPRM_INPUTS_DOCSTRING,
    FPRMSolveKwargs,
    check_attention_mask,
    check_call_flags,
    check_inputs,
    check_labels,
    check_puzzle_identifiers,
    is_integer_tensor,
)


def test_integer_tensors_are_told_from_bool_float_and_other_values():
    assert is_integer_tensor(torch.zeros(2, dtype=torch.long)) and is_integer_tensor(torch.zeros(2, dtype=torch.uint8))
    for value in (torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.cfloat), [1, 2]):
        assert not is_integer_tensor(value)


def test_every_solver_knob_is_documented_once():
    assert all(f"        {name} (" in FPRM_INPUTS_DOCSTRING for name in FPRMSolveKwargs.__annotations__)


def test_call_flags_are_booleans_and_attention_maps_are_not_returned():
    check_call_flags(None, False, True, torch.Generator())
    with pytest.raises(ValueError, match="does not return attention maps"):
        check_call_flags(True, False, False, None)
    with pytest.raises(ValueError, match="`output_residual_trace` must be True or False, got 1"):
        check_call_flags(None, 1, False, None)
    with pytest.raises(ValueError, match="`generator` must be a torch.Generator"):
        check_call_flags(None, False, False, 0)


def test_grid_inputs_must_fill_the_grid_and_the_vocabulary():
    config = tiny_fprm_config()  # 4x4 grids, vocabulary 7
    assert check_inputs(config, torch.zeros(3, 16, dtype=torch.long)) == (3, 16)
    assert check_inputs(config, None, inputs_embeds=torch.zeros(2, 16, config.hidden_size)) == (2, 16)
    for args, message in (
        ((torch.zeros(3, 15, dtype=torch.long),), r"4x4 grids, i.e. 16 tokens per sample; got 15"),
        ((torch.full((1, 16), 7),), r"\[0, 6\] \(vocab_size=7\), got values in \[7, 7\]"),
        ((torch.zeros(1, 16),), "integer tensor of shape"),
        ((torch.zeros(16, dtype=torch.long),), "integer tensor of shape"),
        ((None, None, torch.zeros(1, 16, config.hidden_size + 1)), "hidden_size=32"),
        ((torch.zeros(1, 16, dtype=torch.long), None, torch.zeros(1, 16, 32)), "exactly one"),
    ):
        with pytest.raises(ValueError, match=message):
            check_inputs(config, *args)


def test_learned_positions_bound_the_tokens_plus_prefix_and_sequences_need_a_token():
    config = sequence_fprm_config(position_embedding_type="learned", num_prefix_tokens=2, max_position_embeddings=10)
    assert check_inputs(config, torch.zeros(1, 8, dtype=torch.long)) == (1, 8)
    with pytest.raises(ValueError, match="9 tokens \\+ 2 prefix tokens = 11 exceed max_position_embeddings=10"):
        check_inputs(config, torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="no tokens"):
        check_inputs(sequence_fprm_config(), torch.zeros(1, 0, dtype=torch.long))


def test_puzzle_identifiers_are_one_row_of_the_prefix_table_per_sample():
    config = tiny_fprm_config(num_puzzle_identifiers=3)
    check_puzzle_identifiers(config, torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match=r"shape \(batch,\) = \(2,\)"):
        check_puzzle_identifiers(config, torch.tensor([0, 1, 2]), 2)
    with pytest.raises(ValueError, match=r"num_puzzle_identifiers=3\), got values in \[0, 3\]"):
        check_puzzle_identifiers(config, torch.tensor([0, 3]), 2)
    with pytest.raises(ValueError, match="puzzle_identifiers"):  # through check_inputs as well
        check_inputs(config, torch.zeros(2, 16, dtype=torch.long), torch.tensor([[0], [1]]))


def test_an_attention_mask_must_be_all_ones_of_the_inputs_shape():
    check_attention_mask(None, (2, 3))
    check_attention_mask(torch.ones(2, 3, dtype=torch.long), (2, 3))
    with pytest.raises(ValueError, match="cannot honour a padded `attention_mask` \\(it has 2 entries"):
        check_attention_mask(torch.tensor([[1, 1, 0], [0, 1, 1]]), (2, 3))
    with pytest.raises(ValueError, match=r"shape of `input_ids` \(2, 3\), got Tensor \(2, 4\)"):
        check_attention_mask(torch.ones(2, 4), (2, 3))


def test_labels_are_token_ids_or_minus_100():
    check_labels(torch.tensor([[0, -100, 6]]), (1, 3), 7)
    with pytest.raises(ValueError, match=r"got \[-3, 7\]"):
        check_labels(torch.tensor([[7, -3, 0]]), (1, 3), 7)
    with pytest.raises(ValueError, match="integer tensor of the shape"):
        check_labels(torch.tensor([[0.0, 1.0, 2.0]]), (1, 3), 7)
    with pytest.raises(ValueError, match="integer tensor of the shape"):
        check_labels(torch.tensor([[0, 1]]), (1, 3), 7)
