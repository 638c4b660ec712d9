"""Loop counts (`halt_eps`) under beam search (reordered with the beams), assisted and prompt-lookup
decoding; each checked against a forward over the returned sequences (position i produced token i + 1)."""

import copy

import pytest
import torch
from transformers import GenerationConfig

import loopformer_hf
from loopformer_hf.modeling_loopformer import CACHE_FIELD
from support.tiny_models import cache_of, randomize_modulation, tiny_loopformer_config

EPS = 0.5  # as in test_halting.py: with the tiny model's random weights tokens halt after 1-4 steps


@pytest.fixture
def model(tiny_model):
    return tiny_model


def counts_of_a_forward(model, sequences):
    return model(sequences[:, :-1], halt_eps=EPS).loop_counts


def test_beam_search_counts_follow_the_beams(model):
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (2, 5))
    out = model.generate(
        ids,
        max_new_tokens=8,
        min_new_tokens=8,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        halt_eps=EPS,
        return_dict_in_generate=True,
    )
    assert isinstance(out, loopformer_hf.LoopFormerGenerateBeamDecoderOnlyOutput)
    # it was (batch x beams, ...) in the order of the running beams: (6, 12) here
    assert out.sequences.shape == (4, 13) and out.loop_counts.shape == (4, 12)
    assert (out.beam_indices % 3 != out.beam_indices[:, :1] % 3).any(), "test needs beams that were reordered"
    expected = counts_of_a_forward(model, out.sequences)
    assert expected.min() < expected.max()
    assert torch.equal(out.loop_counts, expected)
    uncached = model.generate(
        ids,
        max_new_tokens=8,
        min_new_tokens=8,
        num_beams=3,
        num_return_sequences=2,
        do_sample=False,
        halt_eps=EPS,
        use_cache=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(uncached.sequences, out.sequences) and torch.equal(uncached.loop_counts, out.loop_counts)


def test_beam_search_counts_are_zero_after_a_sequence_finished(model):
    torch.manual_seed(1)
    ids = torch.randint(3, 97, (1, 4))
    # token 2 ends two of the three best beams early; length_penalty=0 keeps the short ones among the returned
    out = model.generate(
        ids,
        max_new_tokens=6,
        num_beams=3,
        num_return_sequences=3,
        do_sample=False,
        eos_token_id=2,
        pad_token_id=0,
        length_penalty=0.0,
        halt_eps=EPS,
        return_dict_in_generate=True,
    )
    finished = (out.beam_indices < 0).any(dim=1)
    assert finished.any() and not finished.all(), "test needs one sequence shorter than another"
    for row in range(out.sequences.shape[0]):
        length = 4 + int((out.beam_indices[row] >= 0).sum())
        expected = counts_of_a_forward(model, out.sequences[row : row + 1, :length])[0]
        assert torch.equal(out.loop_counts[row, : length - 1], expected)
        assert (out.loop_counts[row, length - 1 :] == 0).all()


def test_beam_search_with_halt_eps_from_generation_config(model):
    ids = torch.randint(3, 97, (1, 5))
    out = model.generate(
        ids,
        max_new_tokens=4,
        return_dict_in_generate=True,
        generation_config=GenerationConfig(halt_eps=EPS, num_beams=2, do_sample=False),
    )
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
        extra = dict(
            assistant_model=randomize_modulation(
                loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()), seed=5
            ).eval()
        )
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


def test_continuing_from_a_cache_counts_every_position_held_ones_zero(model):
    """Generation continued from a returned cache: `loop_counts` still has one column per position (length - 1); the
    positions the cache already held count 0 (this call ran no loop step for them), the others are a forward's."""
    torch.manual_seed(3)
    ids = torch.randint(3, 97, (2, 6))
    first = model.generate(
        ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, halt_eps=EPS, return_dict_in_generate=True
    )
    cache = cache_of(first)
    held = cache.get_seq_length()
    out = model.generate(
        first.sequences,
        **{CACHE_FIELD: cache},
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        halt_eps=EPS,
        return_dict_in_generate=True,
    )
    assert out.loop_counts.shape == (2, out.sequences.shape[1] - 1)  # it was (2, 3)
    assert (out.loop_counts[:, :held] == 0).all()
    assert torch.equal(out.loop_counts[:, held:], counts_of_a_forward(model, out.sequences)[:, held:])


def test_classifier_free_guidance_runs_both_forwards_at_the_call_loop_budget(model):
    """`guidance_scale`: transformers runs the unconditional forward by calling the model with the ids alone; it must
    run under the call's loop budget too (it ran the config's default before)."""
    import torch.nn.functional as F

    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    scale = 1.5
    out = model.generate(
        ids,
        max_new_tokens=1,
        guidance_scale=scale,
        loop_budget=1,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        conditional = F.log_softmax(model(ids, loop_budget=1).logits[:, -1], dim=-1)
        unconditional = F.log_softmax(model(ids[:, -1:], loop_budget=1).logits[:, -1], dim=-1)
        default_budget = F.log_softmax(model(ids[:, -1:]).logits[:, -1], dim=-1)
    assert (unconditional - default_budget).abs().max() > 1e-3, "test needs budgets that change the logits"
    expected = scale * (conditional - unconditional) + unconditional
    torch.testing.assert_close(out.scores[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("knobs", [dict(loop_budget=2), dict(halt_eps=EPS)])
def test_an_assistant_runs_under_its_own_settings_not_the_main_models_loop_knobs(model, knobs):
    """Assisted decoding copies the call's model kwargs for the assistant: a Llama draft used to fail on the
    LoopFormer-only `loop_budget` / `halt_eps` ("model_kwargs are not used by the model"). Greedy assisted decoding
    equals greedy decoding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    draft = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
        )
    ).eval()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, **knobs)
    out = model.generate(ids, assistant_model=draft, **kw)
    assert torch.equal(out.sequences, model.generate(ids, **kw).sequences)


@pytest.mark.filterwarnings("ignore:LoopFormer trajectory")
def test_a_loopformer_assistant_keeps_its_own_loop_budget(model):
    """A LoopFormer draft runs at its own `generation_config.loop_budget`, not at the budget of the main model's call
    (a budget it may not even allow)."""
    draft = copy.deepcopy(model)
    draft.config.max_loop_budget_factor = 1  # at most num_loops = 4 steps: the main call's 6 would be refused
    draft.generation_config.loop_budget = 1
    budgets = []
    handle = draft.register_forward_pre_hook(
        lambda module, args, kwargs: budgets.append(kwargs.get("loop_budget")), with_kwargs=True
    )
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(8))
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, loop_budget=6)
    try:
        out = model.generate(ids, assistant_model=draft, **kw)
    finally:
        handle.remove()
    assert budgets and set(budgets) == {1}
    assert torch.equal(out, model.generate(ids, **kw))


def test_continuous_batching_and_paged_attention_are_refused_clearly(model):
    """transformers' continuous batching uses a paged cache with one slot per layer: refused up front (it failed every
    request with a shape error), as is `attn_implementation="paged|eager"`."""
    with pytest.raises(NotImplementedError, match="continuous batching"):
        model.generate_batch(inputs=[[5, 6, 7], [8, 9]], generation_config=GenerationConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="paged"):
        model.set_attn_implementation("paged|eager")
    assert model.config._attn_implementation != "paged|eager"


# The private `GenerationMixin` methods `LoopFormerGenerationMixin` overrides (the comment above each says why no public
# hook serves): (the leading parameters the override takes by position, the parameters it reads by name).
PRIVATE_GENERATION_HOOKS = {
    "_prepare_generation_config": (("generation_config",), ()),
    "_prepare_cache_for_generation": (("generation_config", "model_kwargs"), ()),
    "_get_logits_processor": ((), ("model_kwargs",)),
    "_get_candidate_generator": ((), ("assistant_model", "model_kwargs")),
}


def test_the_private_generate_hooks_it_overrides_exist_in_the_installed_transformers():
    """A release that renamed one of these methods, or a parameter the override relies on, would leave the override
    dead and the behaviour it adds silently gone: fail here instead (run against the declared floor and the pin)."""
    import inspect

    from transformers.generation import GenerationMixin

    from loopformer_hf.generation_loopformer import LoopFormerGenerationMixin

    overridden = {
        name
        for name in vars(LoopFormerGenerationMixin)
        if name.startswith("_") and not name.startswith("__") and hasattr(GenerationMixin, name)
    }
    assert overridden == set(PRIVATE_GENERATION_HOOKS) and len(overridden) <= 4
    for name, (leading, named) in PRIVATE_GENERATION_HOOKS.items():
        parameters = list(inspect.signature(getattr(GenerationMixin, name)).parameters)[1:]  # after self
        assert parameters[: len(leading)] == list(leading), (name, parameters)
        assert set(named) <= set(parameters), (name, parameters)
