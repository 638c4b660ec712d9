"""The lab's shared loop cache (benchmarks/cache_sharing.py): n loop-step slots per block whatever the budget, exact
within one call, an approximation across decode steps, the same in both storages; what it cannot hold is refused."""

import pytest
import torch
from loopformer.test_cache import _model, _prefill_then_decode, assert_logits_match
from support.tiny_models import cache_of

from benchmarks.cache_sharing import ModuloSharedCache, ModuloSharedStaticCache
from loopformer_hf import LoopFormerCache


@pytest.fixture(scope="module")
def model():
    return _model()


def _shared(storage, model, share_n=2):
    if storage == "dynamic":
        return ModuloSharedCache(model.config, share_n)
    return ModuloSharedStaticCache(model.config, max_cache_len=20, share_n=share_n)


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_shared_cache_holds_n_step_slots_and_is_exact_within_a_call(model, storage):
    ids = torch.randint(3, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    # one call (the prompt) attends within itself: exact
    prompt = model(ids, cache=_shared(storage, model), use_cache=True, loop_budget=4)
    assert_logits_match(prompt.logits, model(ids, use_cache=False, loop_budget=4).logits)
    assert len(cache_of(prompt).layers) == 2 * 2  # n x k slots for budget 4 (the exact cache has 4 x 2)
    # budget <= n never wraps: decoding is exact
    shared_2, _ = _prefill_then_decode(model, ids, _shared(storage, model), loop_budget=2)
    exact_2, _ = _prefill_then_decode(model, ids, LoopFormerCache(), loop_budget=2)
    assert_logits_match(shared_2, exact_2)
    # budget 4 > n: decode steps read earlier tokens' later steps; an approximation, equal in both storages
    shared_4, cache = _prefill_then_decode(model, ids, _shared(storage, model), loop_budget=4)
    exact_4, _ = _prefill_then_decode(model, ids, LoopFormerCache(), loop_budget=4)
    assert not torch.allclose(shared_4[:, 10:], exact_4[:, 10:], atol=1e-3)
    assert_logits_match(shared_4[:, :10], exact_4[:, :10])
    assert int(cache.get_seq_length()) == 20 and cache.share_n == 2
    other, _ = _prefill_then_decode(
        model, ids, _shared("dynamic" if storage == "static" else "static", model), 10, loop_budget=4
    )
    assert_logits_match(other, shared_4)


def test_shared_cache_in_generate_in_both_storages(model):
    ids = torch.randint(3, 97, (1, 5), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=4, do_sample=False, loop_budget=4, return_dict_in_generate=True)
    out = model.generate(ids, cache=ModuloSharedCache(model.config, 2), **kwargs)
    static = model.generate(
        ids, cache=ModuloSharedStaticCache(model.config, 16, share_n=2, max_loop_budget=4), **kwargs
    )
    assert len(cache_of(out).layers) == 2 * 2 and len(cache_of(static).layers) == 2 * 2
    assert torch.equal(static.sequences, out.sequences)
    exact = model.generate(ids, **kwargs)
    assert len(cache_of(exact).layers) == 4 * 2 and not isinstance(cache_of(exact), ModuloSharedCache)


@pytest.mark.parametrize("storage", ["dynamic", "static"])
def test_per_row_budgets_and_a_bad_share_n_are_refused(model, storage):
    ids = torch.randint(3, 97, (2, 4))
    with pytest.raises(ValueError, match=r"Per-row loop budgets or schedules need a slot per \(loop step, block\)"):
        model(ids, cache=_shared(storage, model), loop_budget=[1, 2])
    with pytest.raises(ValueError, match="`share_n` must be an integer >= 1, got 0"):
        _shared(storage, model, share_n=0)
