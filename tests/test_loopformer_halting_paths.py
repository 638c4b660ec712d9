"""Halting that skips the halted tokens' work (exact against computing every token), and the exit criteria
`halt_criterion` chooses."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

from support.instruments import CountOps
from tiny_models import cache_of
import loopformer_hf
from loopformer_hf import halting_loopformer

EPS = 0.5  # as in test_loopformer_halting.py: with the tiny random model, tokens halt after 1-4 steps


@pytest.fixture
def model(tiny_model):
    return tiny_model


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
