"""What a forward call accepts as masks, positions and token inputs (transformers' conventions, anything else a
`ValueError` naming the value: `modeling_loopformer.check_inputs`), and the positions and mask a forward makes of
them."""

import pytest
import torch
from support.tiny_models import tiny_loopformer_config

import loopformer_hf
from loopformer_hf.modeling_loopformer import check_inputs

VOCAB, HIDDEN = 97, 64


def check_token_inputs(input_ids, inputs_embeds, vocab, hidden, dtype):
    config = tiny_loopformer_config(vocab_size=vocab, hidden_size=hidden)
    check_inputs(config, torch.nn.Embedding(vocab, hidden, dtype=dtype), input_ids, inputs_embeds, None, None, 0)


def check_mask_and_positions(mask, positions, batch, q_len, kv_len):
    ids = torch.ones(batch, q_len, dtype=torch.long)
    check_inputs(
        tiny_loopformer_config(), torch.nn.Embedding(VOCAB, HIDDEN), ids, None, mask, positions, kv_len - q_len, kv_len
    )


def test_default_positions_count_tokens_from_a_left_padded_mask_or_from_the_cache():
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()).eval()
    ids, mask = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]]), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    explicit = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, attention_mask=mask).logits, model(ids, attention_mask=mask, position_ids=explicit).logits
        )
        out = model(ids[:, :3])
        torch.testing.assert_close(
            model(ids[:, 3:], cache=out.cache).logits[:, -1],
            model(ids, use_cache=False).logits[:, -1],
            atol=1e-5,
            rtol=0,
        )


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
    ids = torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"\(batch, past \+ new tokens\) = \(2, 5\), got \(2, 3\)"):
        check_inputs(config, torch.nn.Embedding(VOCAB, HIDDEN), ids, None, torch.ones(2, 3, dtype=torch.long), None, 2)


def test_a_forward_masks_padding_as_a_causal_mask_would():
    """A left-padded row's real tokens compute what the same tokens compute unpadded."""
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(attn_implementation="eager")).eval()
    ids = torch.tensor([[0, 6, 7], [8, 9, 10]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(padded[0, 1:], model(ids[:1, 1:]).logits[0], atol=1e-5, rtol=0)


def test_a_forward_takes_shared_positions_and_embeddings():
    torch.manual_seed(0)
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()).eval()
    ids = torch.randint(3, 97, (2, 4))
    embeds = model.get_input_embeddings()(ids)
    positions = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            model(inputs_embeds=embeds, position_ids=positions).logits,
            model(ids, position_ids=positions.expand(2, 4)).logits,
        )
