"""Self-speculative decoding (`generate(..., assistant_loop_budget=d)`): the model drafts for itself along a shallow
trajectory of d loop steps, in cache layers of its own, and the call's trajectory verifies. Greedy output equals
plain `generate` at the call's budget token for token; sampling follows the call's distribution exactly."""

import pytest
import torch
from transformers import GenerationConfig, pipeline

from support.tiny_models import randomize_modulation, tiny_loopformer_config
import loopformer_hf

pytestmark = pytest.mark.usefixtures("one_thread")

L = 4  # the tiny config's num_loops


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return randomize_modulation(loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config()), std=0.2).eval()


def greedy(model, ids, **kw):
    return model.generate(ids, do_sample=False, loop_budget=L, **kw)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_greedy_equals_plain_generate_at_the_calls_budget(model, d):
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(d))
    kw = dict(max_new_tokens=16, min_new_tokens=16)
    out = greedy(model, ids, assistant_loop_budget=d, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, greedy(model, ids, **kw))
    assert out.drafted_tokens > 0 and 0 <= out.accepted_tokens <= out.drafted_tokens


def test_greedy_equals_plain_on_a_left_padded_row_with_a_cache_passed_in(model):
    ids = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    ids[0, :2] = 0
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(max_new_tokens=12, min_new_tokens=12, attention_mask=mask)
    plain = greedy(model, ids, **kw)
    assert torch.equal(greedy(model, ids, assistant_loop_budget=1, **kw), plain)
    cache = loopformer_hf.LoopFormerCache()
    assert torch.equal(greedy(model, ids, assistant_loop_budget=2, cache=cache, **kw), plain)
    assert cache.get_seq_length() > 0 and cache.loop_key[0] == (1 / L,) * L  # the call's cache: the call's loop


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_max_new_tokens_reached_inside_a_draft(model, max_new_tokens):
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=max_new_tokens, num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
    out = greedy(model, ids, assistant_loop_budget=1, **kw)
    assert out.shape[1] <= 5 + max_new_tokens
    assert torch.equal(out, greedy(model, ids, max_new_tokens=max_new_tokens))


def test_eos_inside_a_draft_ends_as_plain_generate_does(model):
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(11))
    plain = greedy(model, ids, max_new_tokens=12, min_new_tokens=12)
    eos = int(plain[0, 5 + 3])  # the 4th generated token ends the sequence
    kw = dict(max_new_tokens=12, eos_token_id=eos, num_assistant_tokens=6, num_assistant_tokens_schedule="constant")
    expected = greedy(model, ids, **kw)
    assert expected.shape[1] < plain.shape[1]
    assert torch.equal(greedy(model, ids, assistant_loop_budget=1, **kw), expected)


def test_the_draft_runs_the_same_weights_in_cache_layers_of_its_own(model):
    """No second model: every forward (the draft's at d, the verification's at M) is this module with its own
    parameters, and the parameters' storage is what it was; the draft's cache holds d·k layers."""
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    budgets, caches = [], []

    def spy(module, args, kwargs):
        assert module is model
        budgets.append(kwargs.get("loop_budget"))
        caches.append(kwargs.get("cache", kwargs.get("past_key_values")))

    hook = model.register_forward_pre_hook(spy, with_kwargs=True)
    try:
        greedy(model, torch.randint(3, 97, (1, 5)), assistant_loop_budget=1, max_new_tokens=8, min_new_tokens=8)
    finally:
        hook.remove()
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers
    assert set(budgets) == {1, L}
    draft = {id(c): c for c, b in zip(caches, budgets) if b == 1}
    target = {id(c): c for c, b in zip(caches, budgets) if b == L}
    assert len(draft) == 1 and len(target) == 1 and draft.keys() != target.keys()
    assert len(next(iter(draft.values())).layers) == 1 * model.config.num_hidden_layers


def test_the_calls_num_assistant_tokens_takes_effect(model):
    """transformers reads `num_assistant_tokens` from the assistant's own generation_config; here the assistant is
    the model, and the call's values are used (the confidence threshold's too)."""
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(2))
    forwards, drafted = {}, {}
    for n in (1, 6):
        calls = []
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(kwargs.get("loop_budget")), with_kwargs=True
        )
        try:
            out = greedy(
                model,
                ids,
                assistant_loop_budget=1,
                num_assistant_tokens=n,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,  # drafts stop at low confidence otherwise (default 0.4)
                max_new_tokens=12,
                min_new_tokens=12,
                return_dict_in_generate=True,
            )
        finally:
            hook.remove()
        forwards[n] = calls.count(L)
        drafted[n] = out.drafted_tokens
    # one token per draft at n=1 (the model's own generation_config would draft up to 20), more at n=6
    assert drafted[1] <= forwards[1] and forwards[6] < drafted[6] <= 6 * forwards[6], (drafted, forwards)


def test_the_generation_config_field_is_read(model):
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    config = GenerationConfig(do_sample=False, max_new_tokens=8, min_new_tokens=8, loop_budget=L)
    config.assistant_loop_budget = 2
    out = model.generate(ids, generation_config=config, return_dict_in_generate=True)
    assert out.drafted_tokens > 0
    assert torch.equal(out.sequences, greedy(model, ids, max_new_tokens=8, min_new_tokens=8))


def test_sampling_follows_the_calls_distribution():
    """Speculative sampling is exact: the first sampled token (drafted at d=1, accepted or resampled at M=L) follows
    p_M, not the draft's p_1. A 6-token vocabulary, 1200 draws: the total-variation distance to p_M is below 0.07
    (its expected size at this count is about 0.025), while p_1 is more than 0.15 away from p_M."""
    torch.manual_seed(0)
    config = tiny_loopformer_config(
        vocab_size=6, pad_token_id=0, eos_token_id=None, bos_token_id=None, initializer_range=0.2
    )
    small = randomize_modulation(loopformer_hf.LoopFormerForCausalLM(config), std=1.5).eval()
    ids = torch.tensor([[1, 4, 2, 5, 3]])
    with torch.no_grad():
        p_target = small(ids, loop_budget=L).logits[0, -1].softmax(-1)
        p_draft = small(ids, loop_budget=1).logits[0, -1].softmax(-1)
    assert 0.5 * (p_target - p_draft).abs().sum() > 0.15, "the test needs a draft unlike the target"
    counts = torch.zeros(6)
    for seed in range(1200):
        torch.manual_seed(seed)
        out = small.generate(
            ids, do_sample=True, loop_budget=L, assistant_loop_budget=1, max_new_tokens=2, min_new_tokens=2
        )
        counts[out[0, 5]] += 1
    tv = 0.5 * (counts / counts.sum() - p_target).abs().sum()
    assert tv < 0.07, (tv, counts / counts.sum(), p_target)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"assistant_loop_budget": L}, "must be below the call's loop budget 4"),
        ({"assistant_loop_budget": 5}, "must be below the call's loop budget 4"),
        ({"assistant_loop_budget": 0}, "must be an integer >= 1, got 0"),
        ({"assistant_loop_budget": 1.5}, "must be an integer >= 1, got 1.5"),
        ({"assistant_loop_budget": 1, "halt_eps": 0.1}, "with `halt_eps` is not supported"),
        ({"assistant_loop_budget": 1, "num_beams": 2}, "beam search is not supported"),
        ({"assistant_loop_budget": 2, "assistant_step_schedule": [0.5, 0.25, 0.25]}, "assistant_step_schedule"),
    ],
)
def test_what_cannot_draft_exactly_is_refused_in_one_line(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        greedy(model, torch.randint(3, 97, (1, 5)), max_new_tokens=2, **kwargs)


def test_a_batch_or_per_row_budgets_are_refused(model):
    with pytest.raises(ValueError, match="batch 1.*got a batch of 2"):
        greedy(model, torch.randint(3, 97, (2, 5)), max_new_tokens=2, assistant_loop_budget=1)
    with pytest.raises(ValueError, match="per-row loop budgets are not supported"):
        model.generate(
            torch.randint(3, 97, (1, 5)), max_new_tokens=2, loop_budget=torch.tensor([4]), assistant_loop_budget=1
        )


def test_an_assistant_step_schedule_drafts_along_it(model):
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=10, min_new_tokens=10)
    out = greedy(model, ids, assistant_loop_budget=2, assistant_step_schedule=[0.75, 0.25], **kw)
    assert torch.equal(out, greedy(model, ids, **kw))


def test_the_pipeline_takes_assistant_loop_budget(tmp_path):
    from support.hub_helpers import save_checkpoint

    save_checkpoint(tmp_path / "model", seed=0)
    generator = pipeline("text-generation", model=str(tmp_path / "model"))
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, loop_budget=3)
    drafted = generator("the cat sat", assistant_loop_budget=1, **kw)
    assert drafted[0]["generated_text"] == generator("the cat sat", **kw)[0]["generated_text"]


def test_each_draft_is_plain_greedy_generate_at_the_draft_budget(model, monkeypatch):
    """The draft runs one forward per token (no nested `generate`); what it proposes is what `generate` at loop
    budget d gives from the same prefix, round after round, and a confidence threshold above every probability ends
    each draft after one token."""
    from loopformer_hf.generation_loopformer import LoopDraftCandidateGenerator

    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(6))
    rounds = []
    get_candidates = LoopDraftCandidateGenerator.get_candidates

    def recorded(self, input_ids, **kwargs):
        candidates, logits = get_candidates(self, input_ids, **kwargs)
        rounds.append((input_ids, candidates))
        return candidates, logits

    monkeypatch.setattr(LoopDraftCandidateGenerator, "get_candidates", recorded)
    kw = dict(assistant_loop_budget=2, num_assistant_tokens=4, num_assistant_tokens_schedule="constant")
    greedy(model, ids, assistant_confidence_threshold=0.0, max_new_tokens=12, min_new_tokens=12, **kw)
    assert len(rounds) > 1
    for prefix, candidates in rounds:
        new = candidates.shape[-1] - prefix.shape[-1]
        if new:
            plain = model.generate(prefix, do_sample=False, loop_budget=2, max_new_tokens=new, min_new_tokens=new)
            assert torch.equal(candidates, plain)
    rounds.clear()
    out = greedy(model, ids, assistant_confidence_threshold=1.0, max_new_tokens=6, min_new_tokens=6, **kw)
    assert all(candidates.shape[-1] - prefix.shape[-1] <= 1 for prefix, candidates in rounds)
    assert torch.equal(out, greedy(model, ids, max_new_tokens=6, min_new_tokens=6))
