"""inputs_loopformer.py: what a forward call accepts as masks, positions and token inputs (transformers' conventions,
anything else a `ValueError` naming the value), the default positions, and the embeddings, positions and mask that
`call_inputs` makes of them."""

import pytest
import torch
from support.tiny_models import tiny_loopformer_config

from loopformer_hf.inputs_loopformer import (
    attention_mask_for,
    call_inputs,
    check_mask_and_positions,
    check_token_inputs,
    default_position_ids,
)

VOCAB, HIDDEN = 97, 64


def test_default_positions_count_tokens_from_a_left_padded_mask_or_from_the_cache():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert default_position_ids(mask, 2, 5, 0, "cpu").tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert default_position_ids(mask, 2, 2, 3, "cpu").tolist() == [[1, 2], [3, 4]]  # the last q_len of the mask
    assert default_position_ids(None, 2, 2, 3, "cpu").tolist() == [[3, 4], [3, 4]]


def test_check_token_inputs_takes_exactly_one_well_formed_input():
    ids, embeds = torch.tensor([[1, 2]]), torch.zeros(1, 2, HIDDEN)
    check_token_inputs(ids, None, VOCAB, HIDDEN, torch.float32)
    check_token_inputs(None, embeds, VOCAB, HIDDEN, torch.float32)
    for args, message in (
        ((ids, embeds), "exactly one"),
        ((None, None), "exactly one"),
        ((torch.zeros(1, 0, dtype=torch.long), None), "at least one"),
        ((torch.tensor([1, 2]), None), "at least one"),
        ((torch.tensor([[1.0]]), None), "integer tensor"),
        ((torch.tensor([[True]]), None), "integer tensor"),
        ((torch.tensor([[VOCAB]]), None), rf"\[0, {VOCAB - 1}\], got values in \[{VOCAB}, {VOCAB}\]"),
        ((torch.tensor([[-1, 3]]), None), r"got values in \[-1, 3\]"),
        ((None, torch.zeros(1, 2, HIDDEN + 1)), "hidden_size=64"),
        ((None, torch.zeros(1, 2, HIDDEN, dtype=torch.float64)), "torch.float32 tensor"),
    ):
        with pytest.raises(ValueError, match=message):
            check_token_inputs(*args, VOCAB, HIDDEN, torch.float32)


def test_check_mask_and_positions_follows_transformers_conventions():
    batch, q_len, kv_len = 2, 3, 5
    check_mask_and_positions(torch.ones(batch, kv_len), torch.zeros(1, q_len, dtype=torch.long), batch, q_len, kv_len)
    check_mask_and_positions(torch.ones(1, 1, q_len, kv_len, dtype=torch.bool), None, batch, q_len, kv_len)
    check_mask_and_positions(torch.zeros(batch, 1, q_len, kv_len), None, batch, q_len, kv_len)
    for mask, message in (
        (torch.ones(batch, 1, kv_len), "2-D"),
        ([[1, 1]], "got list"),
        (torch.ones(batch, 1, q_len, kv_len, dtype=torch.long), "must be bool"),
        (torch.ones(3, 1, q_len, kv_len, dtype=torch.bool), r"got \(3, 1, 3, 5\)"),
        (torch.ones(batch, 1, q_len, kv_len + 1, dtype=torch.bool), "kv_len=5"),
        (torch.tensor([[1, 2, 1, 1, 1], [1, 1, 1, 1, 1]]), r"only 0 \(padding\) and 1"),
    ):
        with pytest.raises(ValueError, match=message):
            check_mask_and_positions(mask, None, batch, q_len, kv_len)
    for positions, message in (
        (torch.zeros(batch, q_len), "integer tensor"),
        (torch.zeros(batch, q_len + 1, dtype=torch.long), "new tokens=3"),
        (torch.zeros(q_len, dtype=torch.long), "integer tensor of shape"),
        (torch.tensor([[0, -1, 2]]), ">= 0, got -1"),
    ):
        with pytest.raises(ValueError, match=message):
            check_mask_and_positions(None, positions, batch, q_len, kv_len)


def test_a_2d_mask_must_cover_the_cached_and_the_new_tokens():
    config = tiny_loopformer_config(attn_implementation="eager")
    embeds = torch.zeros(2, 3, HIDDEN)
    positions = torch.arange(3)[None].expand(2, 3)
    with pytest.raises(ValueError, match=r"\(batch, past \+ new tokens\) = \(2, 5\), got \(2, 3\)"):
        attention_mask_for(config, embeds, torch.ones(2, 3, dtype=torch.long), positions, None, past_len=2)


def test_call_inputs_embeds_positions_and_masks_padding_as_a_causal_mask_would():
    config = tiny_loopformer_config(attn_implementation="eager")
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    embeds, positions, attention = call_inputs(config, embed, ids, None, mask, None, None)
    torch.testing.assert_close(embeds, embed(ids))
    assert positions.tolist() == [[0, 0, 1], [0, 1, 2]]
    # eager: an additive (batch, 1, q, kv) mask in the embeddings' dtype; a query attends to key j <= i, not padding
    assert attention.shape == (2, 1, 3, 3) and attention.dtype == embeds.dtype
    allowed = attention[:, 0] == 0
    causal = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert torch.equal(allowed[1], causal)
    assert torch.equal(allowed[0][1:], causal[1:] & mask[0].bool())  # the padded query's row is transformers' own


def test_call_inputs_takes_shared_positions_and_embeddings():
    config = tiny_loopformer_config()
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    embeds = torch.randn(2, 4, HIDDEN)
    out, positions, _ = call_inputs(config, embed, None, embeds, None, torch.tensor([[3, 4, 5, 6]]), None)
    assert out is embeds and positions.shape == (2, 4) and positions.tolist() == [[3, 4, 5, 6]] * 2
