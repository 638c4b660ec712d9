"""Per-token adaptive depth (`halt_eps`) with a KV cache that stays right for tokens that halted early."""

import threading

import pytest
import torch

from tiny_models import cache_of
import loopformer_hf

EPS = 0.5  # with these random weights some tokens halt after 1-3 steps and others run all 4


@pytest.fixture
def model(tiny_model):  # conftest's tiny model
    return tiny_model


def decode_token_by_token(model, ids, prefix, **kw):
    out = model(ids[:, :prefix], **kw)
    cache, logits, counts = cache_of(out), [out.logits], [out.loop_counts]
    for i in range(prefix, ids.shape[1]):
        out = model(ids[:, i : i + 1], cache=cache, **kw)
        cache = cache_of(out)
        logits.append(out.logits)
        counts.append(out.loop_counts)
    return torch.cat(logits, 1), torch.cat(counts, 1)


@pytest.mark.parametrize("fill", ["recompute", "reuse"])
def test_cached_adaptive_decode_equals_uncached_adaptive_forward(model, fill):
    model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 30))
    full = model(ids, halt_eps=EPS, use_cache=False)
    assert full.loop_counts.min() < full.loop_counts.max(), "test needs tokens that halt at different steps"
    logits, counts = decode_token_by_token(model, ids, 10, halt_eps=EPS)
    assert torch.equal(counts, full.loop_counts)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=0)


def test_the_two_fill_strategies_differ_once_a_token_halts(model):
    ids = torch.randint(3, 97, (1, 30))
    model.config.halt_kv_fill = "recompute"
    a = model(ids, halt_eps=EPS)
    model.config.halt_kv_fill = "reuse"
    b = model(ids, halt_eps=EPS)
    assert not torch.allclose(a.logits, b.logits)


def test_halting_never_exceeds_the_budget_and_freezes_halted_tokens(model):
    ids = torch.randint(3, 97, (2, 20))
    out = model(ids, halt_eps=EPS, loop_budget=4, output_hidden_states=True)
    counts = out.loop_counts
    assert counts.min() >= 1 and counts.max() <= 4
    for step in range(1, 4):  # a token that ran `step` steps keeps that state afterwards
        frozen = counts == step
        if frozen.any():
            torch.testing.assert_close(out.hidden_states[4][frozen], out.hidden_states[step][frozen])
    assert model(ids, halt_eps=EPS, loop_budget=2).loop_counts.max() <= 2
    # without halting every token runs the full budget; a tiny eps halts nothing
    assert model(ids).loop_counts is None
    assert torch.all(model(ids, halt_eps=1e-12).loop_counts == 4)


def test_halt_eps_combines_with_a_schedule(model):
    ids = torch.randint(3, 97, (1, 12))
    a = model(ids, halt_eps=EPS, step_schedule=[0.5, 0.25, 0.25])
    b = model(ids, halt_eps=EPS, step_schedule=[0.25, 0.25, 0.5])
    assert a.loop_counts.max() <= 3
    assert not torch.allclose(a.logits, b.logits)


def test_loop_counts_fall_as_eps_grows(model):
    ids = torch.randint(3, 97, (2, 20))
    means = [model(ids, halt_eps=e).loop_counts.float().mean().item() for e in (1e-6, 0.4, 0.6, 5.0)]
    assert means == sorted(means, reverse=True) and means[0] == 4 and means[-1] == 1


def test_batched_equals_one_by_one_with_left_padding(model):
    prompts = [torch.randint(3, 97, (n,)) for n in (4, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros((3, width), dtype=torch.long)
    mask = torch.zeros((3, width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, halt_eps=EPS, pad_token_id=0,
              return_dict_in_generate=True)
    batched = model.generate(ids, attention_mask=mask, **kw)
    assert batched.loop_counts.shape == (3, width + 9)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], **kw)
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, len(p):]), f"prompt {row}: tokens"
        assert torch.equal(batched.loop_counts[row, width - len(p):], alone.loop_counts[0]), f"prompt {row}: counts"


def test_generate_returns_loop_counts(model):
    ids = torch.randint(3, 97, (2, 5))
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, halt_eps=EPS, return_dict_in_generate=True)
    out = model.generate(ids, **kw)
    assert isinstance(out, loopformer_hf.LoopFormerGenerateDecoderOnlyOutput)
    assert out.sequences.shape == (2, 11) and out.loop_counts.shape == (2, 10)
    uncached = model.generate(ids, use_cache=False, **kw)
    assert torch.equal(uncached.sequences, out.sequences) and torch.equal(uncached.loop_counts, out.loop_counts)
    # the counts are those of a forward over the generated sequence (position i produced token i + 1)
    torch.testing.assert_close(out.loop_counts, model(out.sequences[:, :-1], halt_eps=EPS).loop_counts)
    assert model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True).get("loop_counts") \
        is None  # without halt_eps every position runs the full budget
    assert not any(isinstance(v, torch.Tensor) for v in vars(model).values())  # nothing kept on the model


def test_sampling_reports_the_counts_of_the_sampled_tokens(model):
    ids = torch.randint(3, 97, (2, 5))
    torch.manual_seed(3)
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=True, top_k=0, halt_eps=EPS,
                         num_return_sequences=2, return_dict_in_generate=True)
    assert out.sequences.shape == (4, 11) and out.loop_counts.shape == (4, 10)
    torch.testing.assert_close(out.loop_counts, model(out.sequences[:, :-1], halt_eps=EPS).loop_counts)


def test_two_threads_generating_on_one_model_keep_their_own_counts(model):
    """Each generate call keeps its counts to itself: two threads decoding in lock step (a barrier in a logits
    processor interleaves their steps) with different budgets get what each gets alone."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class LockStep(LogitsProcessor):
        def __init__(self, barrier):
            self.barrier = barrier

        def __call__(self, input_ids, scores):
            self.barrier.wait(timeout=60)
            return scores

    ids = torch.randint(3, 97, (2, 6))
    jobs = {"a": dict(loop_budget=2, halt_eps=EPS), "b": dict(loop_budget=4, halt_eps=0.3)}
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    alone = {name: model.generate(ids, **job, **kw) for name, job in jobs.items()}
    barrier, together = threading.Barrier(2), {}

    def run(name):
        together[name] = model.generate(ids, logits_processor=LogitsProcessorList([LockStep(barrier)]),
                                        **jobs[name], **kw)

    threads = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not torch.equal(alone["a"].loop_counts, alone["b"].loop_counts)  # the two jobs are distinguishable
    for name in jobs:
        assert torch.equal(together[name].sequences, alone[name].sequences), name
        assert torch.equal(together[name].loop_counts, alone[name].loop_counts), name


@pytest.mark.parametrize("kwargs, needle", [({"prefill_chunk_size": 2}, "chunked prefill")])
def test_decoding_modes_without_loop_counts_are_refused_with_halting(model, kwargs, needle):
    # beam search, assisted and prompt-lookup decoding report loop counts (test_loopformer_generate_modes.py)
    with pytest.raises(ValueError, match=needle):
        model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, halt_eps=EPS, **kwargs)
    model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, do_sample=False, **kwargs)  # fine without halting


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, float("nan"), float("inf"), True, "0.1", [0.1]])
def test_bad_halt_eps_raises(model, bad):
    with pytest.raises(ValueError, match="halt_eps") as info:
        model(torch.randint(3, 97, (1, 4)), halt_eps=bad)
    assert repr(bad) in str(info.value)


def test_cache_built_with_another_halt_eps_is_refused(model):
    ids = torch.randint(3, 97, (1, 6))
    out = model(ids, halt_eps=EPS)
    with pytest.raises(ValueError, match="halt_eps"):
        model(ids[:, :1], cache=cache_of(out))
    model(ids[:, :1], cache=cache_of(out), halt_eps=EPS)


@pytest.mark.parametrize("use_cache", [True, False])
def test_everyone_halted_still_reports_every_step_and_fills_every_slot(model, use_cache):
    ids = torch.randint(3, 97, (1, 6))
    out = model(ids, halt_eps=1e9, output_hidden_states=True, use_cache=use_cache)
    assert torch.all(out.loop_counts == 1) and len(out.hidden_states) == 5
    for h in out.hidden_states[2:]:
        torch.testing.assert_close(h, out.hidden_states[1])
    if use_cache:
        assert len(cache_of(out).layers) == 4 * 2 and cache_of(out).get_seq_length(7) == 6
