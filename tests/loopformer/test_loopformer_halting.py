"""Per-token adaptive depth (`halt_eps`) with a KV cache that stays right for tokens that halted early."""

import threading

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

from support.instruments import CountOps
from support.tiny_data import left_padded
from support.tiny_models import cache_of, tiny_loopformer_config
import loopformer_hf
from loopformer_hf import halting_loopformer
from loopformer_hf.modeling_loopformer import rms_norm

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
    ids, mask = left_padded(prompts)
    width = ids.shape[1]
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


# ---- the gathered and dense paths, and the exit criteria -------------------------------------------------------------
# Halting that skips the halted tokens' work (exact against computing every token), and the exit criteria
# `halt_criterion` chooses.


def run(model, gather, monkeypatch, *args, **kwargs):
    """The model's output with halted tokens gathered out (`gather`) or computed and discarded (the dense path)."""
    monkeypatch.setattr(halting_loopformer, "GATHER_ACTIVE_FRACTION", 1.0 if gather else -1.0)
    monkeypatch.setattr(halting_loopformer, "GATHER_MIN_GRID", 0)  # the tests' grids are small
    return model(*args, **kwargs)


def mlp_tokens(model):
    """A list that records how many token rows each MLP call of the first block computes."""
    seen = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0][..., 0].numel()))
    return seen


@pytest.mark.parametrize("fill", ["recompute", "reuse"])
def test_gathered_prefill_and_decode_equal_the_dense_path(model, monkeypatch, fill):
    model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (3, 24))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    outs = {}
    for gather in (False, True):
        out = run(model, gather, monkeypatch, ids[:, :16], attention_mask=mask[:, :16], halt_eps=EPS)
        logits, counts, cache = [out.logits], [out.loop_counts], cache_of(out)
        for i in range(16, 24):  # batched decode: rows halt at different steps
            out = run(model, gather, monkeypatch, ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache,
                      halt_eps=EPS)
            logits.append(out.logits)
            counts.append(out.loop_counts)
        outs[gather] = torch.cat(logits, 1), torch.cat(counts, 1), cache
    (dense_logits, dense_counts, dense_cache), (logits, counts, cache) = outs[False], outs[True]
    assert dense_counts.min() < dense_counts.max(), "test needs tokens that halt at different steps"
    assert torch.equal(counts, dense_counts)
    torch.testing.assert_close(logits, dense_logits, atol=1e-5, rtol=0)
    for a, b in zip(cache.layers, dense_cache.layers):  # the frozen tokens' keys/values are filled as before
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=0)


def test_halted_tokens_are_not_computed(model, monkeypatch):
    ids = torch.randint(3, 97, (2, 20))
    seen = mlp_tokens(model)
    counts = run(model, True, monkeypatch, ids, halt_eps=EPS).loop_counts
    expected = []  # per step: every token while none has halted, then (rows with an active token) x (most in a row)
    for step in range(int(counts.max())):
        alive = counts > step
        expected.append(ids.numel() if alive.all() else int(alive.any(-1).sum()) * int(alive.sum(-1).max()))
    assert seen == expected and expected[-1] < ids.numel()


def test_small_grids_compute_every_token_instead_of_gathering(model, monkeypatch):
    """Gathering adds tensor ops per block and step that a grid of fewer than GATHER_MIN_GRID (tokens x hidden)
    elements does not win back: there every token is computed (and halted ones discarded); from that size on the
    active ones are gathered."""
    ids = torch.randint(3, 97, (2, 20))
    grid = ids.numel() * model.config.hidden_size
    seen, seen_by_threshold = mlp_tokens(model), {}
    for threshold in (grid + 1, grid):
        monkeypatch.setattr(halting_loopformer, "GATHER_MIN_GRID", threshold)
        before = len(seen)
        counts = model(ids, halt_eps=EPS).loop_counts
        seen_by_threshold[threshold] = seen[before:]
    assert counts.min() < counts.max(), "test needs tokens that halt at different steps"
    assert seen_by_threshold[grid + 1] == [ids.numel()] * int(counts.max())
    assert seen_by_threshold[grid][-1] < ids.numel()


def test_batched_decode_skips_halted_rows(model, monkeypatch):
    ids = torch.randint(3, 97, (4, 9))
    out = model(ids[:, :8], halt_eps=EPS)
    seen = mlp_tokens(model)
    step = run(model, True, monkeypatch, ids[:, 8:], cache=cache_of(out), halt_eps=EPS)
    counts = step.loop_counts[:, 0]
    assert counts.min() < counts.max(), "test needs rows that halt at different steps"
    assert seen == [int((counts > s).sum()) for s in range(int(counts.max()))]


def test_decode_keeps_the_loops_adaln_vectors_on_the_cache(model):
    ids = torch.randint(3, 97, (1, 6))
    calls = []
    model.model.layers[0].adaLN_modulation.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        out = model(ids[:, :5])
        decoded = model(ids[:, 5:], cache=cache_of(out)).logits
    assert calls == [1]  # once for every step of the prefill, then read from the cache
    torch.testing.assert_close(decoded[:, -1], model(ids).logits[:, -1], atol=1e-5, rtol=0)


# ---- exit criteria -------------------------------------------------------------------------------------------------


def split_threshold(scores):
    """A threshold that halts about half the tokens, midway between the two middle scores: a median is itself one of
    the scores, and a score equal to the threshold halts or not by float rounding, which cached and uncached runs do
    differently."""
    s = scores.flatten().sort().values
    i = (len(s) - 1) // 2
    assert s[i] < s[i + 1], "the two middle scores tie: these inputs cannot split the tokens"
    return float((s[i] + s[i + 1]) / 2)


def decode_stepwise(model, ids, prefix, attention_mask=None, **kwargs):
    """(logits, loop counts) of a prefill over `ids[:, :prefix]`, then one forward per later token on the cache."""
    def masked(end):
        return {} if attention_mask is None else {"attention_mask": attention_mask[:, :end]}

    out = model(ids[:, :prefix], **masked(prefix), **kwargs)
    logits, counts, cache = [out.logits], [out.loop_counts], cache_of(out)
    for i in range(prefix, ids.shape[1]):
        out = model(ids[:, i:i + 1], cache=cache, **masked(i + 1), **kwargs)
        logits.append(out.logits)
        counts.append(out.loop_counts)
    return torch.cat(logits, 1), torch.cat(counts, 1)


def step_scores(model, ids):
    """Per loop step i = 1..4 of the full budget: the entropy H(p_i) and KL(p_i || p_{i-1}) of every token."""
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        log_p = [torch.log_softmax(model.lm_head(model.model.norm(h)), -1) for h in hidden]
    entropy = [-(lp.exp() * lp).sum(-1) for lp in log_p[1:]]
    kl = [(log_p[i].exp() * (log_p[i] - log_p[i - 1])).sum(-1) for i in range(1, len(log_p))]
    return {"entropy": entropy, "kl": kl}


@pytest.mark.parametrize("criterion", ["kl", "entropy"])
def test_each_criterion_decodes_cached_as_uncached(model, criterion):
    ids = torch.randint(3, 97, (2, 16))
    eps = split_threshold(step_scores(model, ids)[criterion][1])
    full = model(ids, halt_eps=eps, halt_criterion=criterion, use_cache=False)
    assert full.loop_counts.min() < full.loop_counts.max(), "test needs tokens that halt at different steps"
    logits, counts = decode_stepwise(model, ids, 8, halt_eps=eps, halt_criterion=criterion)
    assert torch.equal(counts, full.loop_counts)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=0)


def test_cache_filled_under_one_criterion_refuses_another(model):
    """Another criterion halts other tokens, so their skipped slots differ: the cache names both criteria."""
    ids = torch.randint(3, 97, (1, 9))
    cache = cache_of(model(ids[:, :8], halt_eps=0.1, halt_criterion="kl"))
    assert cache.spec.halt_criterion == "kl"
    with pytest.raises(ValueError, match=r"filled under halt_eps=0.1 .*halt_criterion=kl.* this call runs "
                                         r"halt_eps=0.1 \(kv fill \w+\)"):
        model(ids[:, 8:], cache=cache, halt_eps=0.1, halt_criterion="state_change")
    assert cache_of(model(ids[:, :8])).spec.halt_criterion is None  # recorded only with halt_eps


@pytest.mark.parametrize("criterion", ["kl", "entropy"])
def test_criteria_halt_on_their_own_scores(model, criterion):
    ids = torch.randint(3, 97, (2, 16))
    first = step_scores(model, ids)[criterion][0]  # after step 1, before anyone halts
    ordered = first.flatten().sort().values
    middle = ordered.numel() // 2  # halfway between two neighbours, so round-off cannot move a token across
    eps = float(ordered[middle - 1] + ordered[middle]) / 2
    counts = model(ids, halt_eps=eps, halt_criterion=criterion).loop_counts
    assert torch.equal(counts == 1, first < eps) and 0 < int((counts == 1).sum()) < ids.numel()
    means = [model(ids, halt_eps=e, halt_criterion=criterion).loop_counts.float().mean() for e in (1e-9, eps, 99.0)]
    assert means[0] == 4 and 1 < means[1] < 4 and means[2] == 1  # larger thresholds halt sooner


def test_halt_criterion_is_a_config_default_and_a_generate_kwarg(model):
    ids = torch.randint(3, 97, (1, 5))
    eps = split_threshold(step_scores(model, ids)["entropy"][1])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, halt_eps=eps, return_dict_in_generate=True)
    by_kwarg = model.generate(ids, halt_criterion="entropy", **kw)
    default = model.generate(ids, **kw)
    assert not torch.equal(by_kwarg.loop_counts, default.loop_counts)
    model.config.halt_criterion = "entropy"
    assert torch.equal(model.generate(ids, **kw).loop_counts, by_kwarg.loop_counts)
    torch.testing.assert_close(by_kwarg.loop_counts, model(by_kwarg.sequences[:, :-1], halt_eps=eps).loop_counts)


def test_bad_halt_criterion_raises(model):
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(ValueError, match=r"halt_criterion.*'entropie'"):
        model(ids, halt_eps=0.1, halt_criterion="entropie")
    with pytest.raises(StrictDataclassError, match=r"(?s)halt_criterion.*got kl2"):
        loopformer_hf.LoopFormerConfig(halt_criterion="kl2")
    with pytest.raises(ValueError, match="LM head"):
        model.model(ids, halt_eps=0.1, halt_criterion="kl")


def test_cache_filled_under_another_criterion_is_refused(model):
    ids = torch.randint(3, 97, (1, 6))
    out = model(ids, halt_eps=0.1, halt_criterion="kl")
    with pytest.raises(ValueError, match="halt_criterion"):
        model(ids[:, :1], cache=cache_of(out), halt_eps=0.1)
    model(ids[:, :1], cache=cache_of(out), halt_eps=0.1, halt_criterion="kl")


def _decode_ops(model, **kwargs):
    """ATen calls of one cached single-token decode step (after an 8-token prefill) under `kwargs`."""
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = cache_of(model(ids[:, :8], use_cache=True, **kwargs))
        with CountOps() as ops:
            model(ids[:, 8:], cache=cache, use_cache=True, **kwargs)
    return ops.count


@pytest.mark.filterwarnings("ignore:LoopFormer trajectory")
def test_a_token_that_halts_early_pays_little_for_the_steps_it_skips(model):
    """Halting's bookkeeping must not eat what it saves: a decode step whose token halts after one loop step costs the
    same number of tensor ops whatever the budget (with the default reuse fill, the skipped slots are written without
    a concatenation each), and only a few more than a fixed budget of 1: the score (7 ops), one read of it, the
    active mask and the counts."""
    assert model.config.halt_kv_fill == "reuse"
    halting = {budget: _decode_ops(model, loop_budget=budget, halt_eps=1e9) for budget in (4, 8)}
    fixed = _decode_ops(model, loop_budget=1)
    assert halting[4] == halting[8] <= fixed + 12, (halting, fixed)


def test_deferred_slot_writes_are_seen_by_every_cache_operation():
    """`LoopFormerCache.write` (halting's skipped slots) joins its pieces when the slot is next read: by `update`,
    by reading `keys`/`values`, and by transformers' cache methods (crop, beam reordering, length)."""
    import copy

    from loopformer_hf.cache_loopformer import LoopFormerCache, LoopFormerCacheSpec

    def kv(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 4, n, 8, generator=g), torch.randn(2, 4, n, 8, generator=g)

    cache = LoopFormerCache(LoopFormerCacheSpec((0.5, 0.5), num_blocks=1))
    first, second, third = kv(3, 0), kv(1, 1), kv(1, 2)
    cache.update(*first, 0)
    cache.update(*first, 1)
    cache.write(*second, 1)
    cache.write(*third, 1)
    expected_keys = torch.cat([first[0], second[0], third[0]], dim=-2)
    later = copy.deepcopy(cache)
    assert cache.get_seq_length(1) == 5
    torch.testing.assert_close(cache.layers[1].keys, expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(cache.layers[1].values, torch.cat([first[1], second[1], third[1]], dim=-2),
                               rtol=0, atol=0)
    new = kv(1, 3)
    keys, _ = later.update(*new, 1)  # one concatenation of the history, both pieces and the new keys
    torch.testing.assert_close(keys, torch.cat([expected_keys, new[0]], dim=-2), rtol=0, atol=0)
    cropped = copy.deepcopy(later)
    cropped.write(*kv(1, 4), 1)
    cropped.layers[1].crop(-1)
    torch.testing.assert_close(cropped.layers[1].keys, keys, rtol=0, atol=0)
    reordered = copy.deepcopy(later)
    reordered.write(*kv(1, 5), 1)
    reordered.reorder_cache(torch.tensor([1, 0]))
    assert reordered.layers[1].keys.shape[-2] == 7
    torch.testing.assert_close(reordered.layers[1].keys[:, :, :6], keys.flip(0), rtol=0, atol=0)


def test_a_slot_that_is_never_read_does_not_keep_one_tensor_per_token():
    """A slot whose tokens always halt before its step is only ever written: its pieces join every `max_pending`
    appends, so a long generation holds a bounded number of tensors, and the slot's keys are still every piece in
    order."""
    from loopformer_hf.cache_loopformer import LoopFormerCache, LoopFormerCacheSpec

    cache = LoopFormerCache(LoopFormerCacheSpec((1.0,), num_blocks=1))
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(1, 2, 1, 4, generator=g) for _ in range(150)]
    for piece in pieces:
        cache.write(piece, -piece, 0)
    layer = cache.layers[0]
    assert len(layer._pending) < layer.max_pending
    assert layer._keys.shape[-2] == 150 - len(layer._pending)
    torch.testing.assert_close(layer.keys, torch.cat(pieces, dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(layer.values, -torch.cat(pieces, dim=-2), rtol=0, atol=0)


# ---- the shortcut exit rules -----------------------------------------------------------------------------------------
# The "_shortcut" exit rules and "probe_entropy" (`halt_criterion="kl_shortcut"`, ...): a token whose score falls below
# `halt_eps` after step i takes one step Δ = 1 − t_i to t = 1 before it freezes, so its path is a shortcut trajectory
# of i + 1 steps. Exact against the fixed trajectory, cached as uncached, static as dynamic, padded and gathered.

RULES = ["state_change_shortcut", "kl_shortcut", "entropy_shortcut"]


def first_scores(model, ids, rule):
    """Every token's score after loop step 1 of the full budget (before any token exits)."""
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        log_p = [torch.log_softmax(model.lm_head(model.model.norm(h)), -1) for h in hidden[:2]]
    if rule == "state_change_shortcut":
        return halting_loopformer.state_change_score(hidden[0], hidden[1])
    if rule == "kl_shortcut":
        return (log_p[1].exp() * (log_p[1] - log_p[0])).sum(-1)
    return -(log_p[1].exp() * log_p[1]).sum(-1)


@pytest.mark.parametrize("rule", RULES)
def test_a_token_that_stops_after_step_1_ends_on_the_shortcut_trajectory(model, rule):
    """Everyone below halt_eps after step 1: the output is the 2-step shortcut trajectory [1/L, 1 − 1/L]'s, exactly
    what `step_schedule` runs, at 2 loop steps per token; a threshold below every score runs the full budget."""
    ids = torch.randint(3, 97, (2, 12))
    with torch.no_grad():
        out = model(ids, halt_eps=1e9, halt_criterion=rule, use_cache=False)
        fixed = model(ids, step_schedule=[0.25, 0.75], use_cache=False)
        full = model(ids, halt_eps=1e-12, halt_criterion=rule, use_cache=False)
    assert (out.loop_counts == 2).all()
    torch.testing.assert_close(out.logits, fixed.logits, atol=1e-5, rtol=0)
    assert (full.loop_counts == 4).all()
    torch.testing.assert_close(full.logits, model(ids, use_cache=False).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rule", RULES)
def test_tokens_exit_where_their_score_falls_and_pay_one_more_step(model, rule):
    ids = torch.randint(3, 97, (2, 16))
    first = first_scores(model, ids, rule)
    eps = split_threshold(first)
    counts = model(ids, halt_eps=eps, halt_criterion=rule).loop_counts
    # below after step 1: one exit step (2 in all); the others decide again after step 2 (3 in all, or 4); never 1
    assert torch.equal(counts == 2, first < eps)
    assert set(counts.flatten().tolist()) <= {2, 3, 4} and (counts[first >= eps] >= 3).all()


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
@pytest.mark.parametrize("rule", RULES)
def test_cached_decode_equals_the_uncached_forward(model, rule, fill):
    """The cache stays exact: decoding token by token gives the counts and logits of one uncached forward, with the
    exiting tokens' slots written at their exit step and the later ones filled as for any halted token."""
    model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 16))
    eps = split_threshold(first_scores(model, ids, rule))
    full = model(ids, halt_eps=eps, halt_criterion=rule, use_cache=False)
    assert full.loop_counts.min() < full.loop_counts.max(), "test needs tokens that exit at different steps"
    logits, counts = decode_stepwise(model, ids, 8, halt_eps=eps, halt_criterion=rule)
    assert torch.equal(counts, full.loop_counts)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("gather", [False, True])
def test_padded_batch_decodes_as_the_dense_path(model, monkeypatch, gather):
    """A left-padded batch, rows exiting at different steps, with the halted tokens gathered out or computed."""
    monkeypatch.setattr(halting_loopformer, "GATHER_ACTIVE_FRACTION", 1.0 if gather else -1.0)
    monkeypatch.setattr(halting_loopformer, "GATHER_MIN_GRID", 0)
    ids = torch.randint(3, 97, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    eps = split_threshold(first_scores(model, ids, "kl_shortcut")[mask.bool()])
    full = model(ids, attention_mask=mask, halt_eps=eps, halt_criterion="kl_shortcut", use_cache=False)
    logits, counts = decode_stepwise(model, ids, 12, attention_mask=mask, halt_eps=eps, halt_criterion="kl_shortcut")
    assert len(set(counts[:, 12:].flatten().tolist())) > 1  # decoded rows exit at different steps
    assert torch.equal(counts, full.loop_counts)
    real = mask.bool()
    torch.testing.assert_close(logits[real], full.logits[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
def test_generate_with_a_static_cache_matches_the_dynamic_cache(model, fill):
    model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eps = split_threshold(first_scores(model, ids, "entropy_shortcut")[mask.bool()])
    runs = [model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, halt_eps=eps,
                           halt_criterion="entropy_shortcut", return_dict_in_generate=True, output_logits=True, **kw)
            for kw in ({}, {"cache_implementation": "static"})]
    dynamic, static = runs
    assert dynamic.loop_counts.min() < dynamic.loop_counts.max()
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.loop_counts, dynamic.loop_counts)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)


def test_shortcut_rules_refuse_a_model_without_step_conditioning():
    """TMLT (t only) and Base-Loop were never trained on a step Δ = 1 − t: the rule names the criterion to use."""
    for mode in ("timestep", "none"):
        model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning=mode)).eval()
        ids = torch.randint(3, 97, (1, 6))
        with pytest.raises(ValueError, match=r"loop_conditioning='shortcut'.*use halt_criterion='kl'"):
            model(ids, halt_eps=0.1, halt_criterion="kl_shortcut")
        assert model(ids, halt_eps=0.1, halt_criterion="kl").loop_counts is not None


def test_the_exit_steps_adaln_is_kept_on_the_cache_for_decoding(model):
    ids = torch.randint(3, 97, (1, 8))
    calls = []
    model.model.layers[0].adaLN_modulation.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        out = model(ids[:, :6], halt_eps=1e9, halt_criterion="kl_shortcut")
        for i in (6, 7):
            out = model(ids[:, i:i + 1], cache=cache_of(out), halt_eps=1e9, halt_criterion="kl_shortcut")
    assert len(calls) == 2  # the trajectory's steps and the exit steps, once each, at the prefill


def test_per_token_norm_weights_equal_the_shared_weight():
    """The exit step's per-token adaLN folds into the norm as (batch, seq, d) weights: the same values as a shared
    (d,) weight where they agree."""
    x, w = torch.randn(2, 5, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm(x, w.expand(2, 5, 64)), rms_norm(x, w), atol=1e-6, rtol=0)


def test_without_halt_eps_nothing_changes(model):
    """`halt_eps=None`: the rule is not read; the output equals the plain full budget."""
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        plain = model(ids)
        model.config.halt_criterion = "kl_shortcut"
        ruled = model(ids)
    assert ruled.loop_counts is None
    assert torch.equal(plain.logits, ruled.logits)


# ---- "probe_entropy": the one-step trajectory first, the budget only where it is unsure -------------------------------


def probe_entropy(model, ids, **kwargs):
    with torch.no_grad():
        log_p = model(ids, step_schedule=[1.0], use_cache=False, **kwargs).logits.log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


def test_probe_keeps_the_one_step_output_where_sure_and_runs_the_budget_elsewhere(model):
    ids = torch.randint(3, 97, (2, 16))
    entropy = probe_entropy(model, ids)
    eps = split_threshold(entropy)
    with torch.no_grad():
        out = model(ids, halt_eps=eps, halt_criterion="probe_entropy", use_cache=False)
        one = model(ids, step_schedule=[1.0], use_cache=False)
        everyone_sure = model(ids, halt_eps=1e9, halt_criterion="probe_entropy", use_cache=False)
        nobody_sure = model(ids, halt_eps=1e-12, halt_criterion="probe_entropy", use_cache=False)
    sure = entropy < eps
    assert 0 < int(sure.sum()) < ids.numel()
    assert torch.equal(out.loop_counts, torch.where(sure, 1, 5))  # the probe, then 1 + M for the unsure
    torch.testing.assert_close(out.logits[sure], one.logits[sure], atol=1e-5, rtol=0)
    torch.testing.assert_close(everyone_sure.logits, one.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nobody_sure.logits, model(ids, use_cache=False).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("fill", ["reuse", "recompute"])
def test_probe_decodes_cached_as_uncached_and_static_as_dynamic(model, fill):
    """The probe step's keys/values have slots of their own (M + 1 per block); decode equals one forward, and a
    static cache sized by generate equals the dynamic one, left-padded batch included."""
    model.config.halt_kv_fill = fill
    ids = torch.randint(3, 97, (2, 16))
    eps = split_threshold(probe_entropy(model, ids))
    full = model(ids, halt_eps=eps, halt_criterion="probe_entropy", use_cache=False)
    logits, counts = decode_stepwise(model, ids, 8, halt_eps=eps, halt_criterion="probe_entropy")
    assert torch.equal(counts, full.loop_counts) and counts.min() < counts.max()
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=0)
    prompt, mask = ids[:, :7], torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    runs = [model.generate(prompt, attention_mask=mask, max_new_tokens=8, do_sample=False, halt_eps=eps,
                           halt_criterion="probe_entropy", return_dict_in_generate=True, output_logits=True, **kw)
            for kw in ({}, {"cache_implementation": "static"})]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].loop_counts, runs[1].loop_counts)
    torch.testing.assert_close(torch.stack(runs[0].logits), torch.stack(runs[1].logits), atol=1e-5, rtol=0)


def test_probe_refuses_models_without_step_conditioning_and_a_shared_cache():
    model = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning="timestep")).eval()
    with pytest.raises(ValueError, match=r"use halt_criterion='entropy'"):
        model(torch.randint(3, 97, (1, 6)), halt_eps=0.1, halt_criterion="probe_entropy")
    shared = loopformer_hf.LoopFormerForCausalLM(tiny_loopformer_config(cache_sharing="modulo")).eval()
    with pytest.raises(ValueError, match="cache_sharing='none'"):
        shared(torch.randint(3, 97, (1, 6)), halt_eps=0.1, halt_criterion="probe_entropy")
