"""Issue 13: loop counts (`halt_eps`) under beam search (reordered with the beams), assisted and prompt-lookup
decoding; each checked against a forward over the returned sequences (position i produced token i + 1)."""

import copy

import pytest
import torch
from transformers import GenerationConfig

import loopformer_hf
from conftest import randomize_modulation, tiny_loopformer_config

EPS = 0.5  # as in test_loopformer_halting.py: with the tiny model's random weights tokens halt after 1-4 steps


@pytest.fixture
def model(tiny_model):
    return tiny_model


def counts_of_a_forward(model, sequences):
    return model(sequences[:, :-1], halt_eps=EPS).loop_counts


def test_beam_search_counts_follow_the_beams(model):
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=2,
                         do_sample=False, halt_eps=EPS, return_dict_in_generate=True)
    assert isinstance(out, loopformer_hf.LoopFormerGenerateBeamDecoderOnlyOutput)
    # it was (batch x beams, ...) in the order of the running beams: (6, 12) here
    assert out.sequences.shape == (4, 13) and out.loop_counts.shape == (4, 12)
    assert (out.beam_indices % 3 != out.beam_indices[:, :1] % 3).any(), "test needs beams that were reordered"
    expected = counts_of_a_forward(model, out.sequences)
    assert expected.min() < expected.max()
    assert torch.equal(out.loop_counts, expected)
    uncached = model.generate(ids, max_new_tokens=8, min_new_tokens=8, num_beams=3, num_return_sequences=2,
                              do_sample=False, halt_eps=EPS, use_cache=False, return_dict_in_generate=True)
    assert torch.equal(uncached.sequences, out.sequences) and torch.equal(uncached.loop_counts, out.loop_counts)


def test_beam_search_counts_are_zero_after_a_sequence_finished(model):
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (1, 4))
    # token 2 ends two of the three best beams early; length_penalty=0 keeps the short ones among the returned
    out = model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                         eos_token_id=2, pad_token_id=0, length_penalty=0.0, halt_eps=EPS,
                         return_dict_in_generate=True)
    finished = (out.beam_indices < 0).any(dim=1)
    assert finished.any() and not finished.all(), "test needs one sequence shorter than another"
    for row in range(out.sequences.shape[0]):
        length = 4 + int((out.beam_indices[row] >= 0).sum())
        expected = counts_of_a_forward(model, out.sequences[row : row + 1, :length])[0]
        assert torch.equal(out.loop_counts[row, : length - 1], expected)
        assert (out.loop_counts[row, length - 1 :] == 0).all()


def test_beam_search_with_halt_eps_from_generation_config(model):
    ids = torch.randint(3, 97, (1, 5))
    out = model.generate(ids, max_new_tokens=4, return_dict_in_generate=True,
                         generation_config=GenerationConfig(halt_eps=EPS, num_beams=2, do_sample=False))
    assert torch.equal(out.loop_counts, counts_of_a_forward(model, out.sequences))


def _forwards(model):
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    return calls, handle


@pytest.mark.parametrize("mode", ["prompt_lookup", "same_assistant", "other_assistant"])
def test_assisted_and_prompt_lookup_counts_are_those_of_greedy(model, mode):
    torch.manual_seed(2)
    prompt = torch.randint(3, 97, (1, 6))
    ids = torch.cat([prompt, prompt], dim=1)  # repeats for the prompt lookup to draft from
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, halt_eps=EPS, return_dict_in_generate=True)
    greedy = model.generate(ids, **kw)
    if mode == "prompt_lookup":
        extra = dict(prompt_lookup_num_tokens=3)
    elif mode == "same_assistant":  # every draft is accepted: several tokens per forward of the main model
        extra = dict(assistant_model=copy.deepcopy(model))
    else:  # another model's drafts are mostly rejected: the counts of rejected positions must be dropped
        torch.manual_seed(5)
        extra = dict(assistant_model=randomize_modulation(
            loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()), seed=5).eval())
    calls, handle = _forwards(model)
    try:
        out = model.generate(ids, **kw, **extra)
    finally:
        handle.remove()
    assert torch.equal(out.sequences, greedy.sequences)
    assert out.loop_counts.shape == (1, out.sequences.shape[1] - 1)  # it was one column short
    assert torch.equal(out.loop_counts, greedy.loop_counts)
    assert torch.equal(out.loop_counts, counts_of_a_forward(model, out.sequences))
    if mode == "same_assistant":
        assert len(calls) < 10, "test needs forwards that accepted several drafted tokens"
