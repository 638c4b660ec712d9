"""Per-token adaptive depth (`halt_eps`) with a KV cache that stays right for tokens that halted early."""

import sys
import threading

import pytest
import torch
from support.instruments import CountOps
from support.tiny_data import left_padded
from support.tiny_models import cache_of

import loopformer_hf
from loopformer_hf import halting_loopformer
from loopformer_hf.looped_common import rms_norm

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
    kw = dict(
        max_new_tokens=10,
        min_new_tokens=10,
        do_sample=False,
        halt_eps=EPS,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    batched = model.generate(ids, attention_mask=mask, **kw)
    assert batched.loop_counts.shape == (3, width + 9)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], **kw)
        assert torch.equal(batched.sequences[row, width:], alone.sequences[0, len(p) :]), f"prompt {row}: tokens"
        assert torch.equal(batched.loop_counts[row, width - len(p) :], alone.loop_counts[0]), f"prompt {row}: counts"


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
    assert (
        model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True).get("loop_counts") is None
    )  # without halt_eps every position runs the full budget
    assert not any(isinstance(v, torch.Tensor) for v in vars(model).values())  # nothing kept on the model


def test_sampling_reports_the_counts_of_the_sampled_tokens(model):
    ids = torch.randint(3, 97, (2, 5))
    torch.manual_seed(3)
    out = model.generate(
        ids,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=True,
        top_k=0,
        halt_eps=EPS,
        num_return_sequences=2,
        return_dict_in_generate=True,
    )
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
        together[name] = model.generate(
            ids, logits_processor=LogitsProcessorList([LockStep(barrier)]), **jobs[name], **kw
        )

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
    # beam search, assisted and prompt-lookup decoding report loop counts (test_generation_modes.py)
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
# Halting that skips the halted tokens' work (exact against computing every token).


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
            out = run(
                model,
                gather,
                monkeypatch,
                ids[:, i : i + 1],
                attention_mask=mask[:, : i + 1],
                cache=cache,
                halt_eps=EPS,
            )
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
    """halting's `write` (its skipped slots) joins its pieces when the slot is next read: by `update`,
    by reading `keys`/`values`, and by transformers' cache methods (crop, beam reordering, length)."""
    import copy

    from loopformer_hf.halting_loopformer import use_halting_layers, write

    def kv(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 4, n, 8, generator=g), torch.randn(2, 4, n, 8, generator=g)

    cache = loopformer_hf.LoopFormerCache()
    use_halting_layers(cache, 2, halting_loopformer.LoopFormerHaltingState)
    first, second, third = kv(3, 0), kv(1, 1), kv(1, 2)
    cache.update(*first, 0)
    cache.update(*first, 1)
    write(cache, *second, 1)
    write(cache, *third, 1)
    expected_keys = torch.cat([first[0], second[0], third[0]], dim=-2)
    later = copy.deepcopy(cache)
    assert cache.get_seq_length(1) == 5
    torch.testing.assert_close(cache.layers[1].keys, expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(
        cache.layers[1].values, torch.cat([first[1], second[1], third[1]], dim=-2), rtol=0, atol=0
    )
    new = kv(1, 3)
    keys, _ = later.update(*new, 1)  # one concatenation of the history, both pieces and the new keys
    torch.testing.assert_close(keys, torch.cat([expected_keys, new[0]], dim=-2), rtol=0, atol=0)
    cropped = copy.deepcopy(later)
    write(cropped, *kv(1, 4), 1)
    cropped.layers[1].crop(-1)
    torch.testing.assert_close(cropped.layers[1].keys, keys, rtol=0, atol=0)
    reordered = copy.deepcopy(later)
    write(reordered, *kv(1, 5), 1)
    reordered.reorder_cache(torch.tensor([1, 0]))
    assert reordered.layers[1].keys.shape[-2] == 7
    torch.testing.assert_close(reordered.layers[1].keys[:, :, :6], keys.flip(0), rtol=0, atol=0)


def test_a_slot_that_is_never_read_does_not_keep_one_tensor_per_token():
    """A slot whose tokens always halt before its step is only ever written: its pieces join every `max_pending`
    appends, so a long generation holds a bounded number of tensors, and the slot's keys are still every piece in
    order."""
    from loopformer_hf.halting_loopformer import use_halting_layers, write

    cache = loopformer_hf.LoopFormerCache()
    use_halting_layers(cache, 1, halting_loopformer.LoopFormerHaltingState)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randn(1, 2, 1, 4, generator=g) for _ in range(150)]
    for piece in pieces:
        write(cache, piece, -piece, 0)
    layer = cache.layers[0]
    assert len(layer._pending) < layer.max_pending
    assert layer._keys.shape[-2] == 150 - len(layer._pending)
    torch.testing.assert_close(layer.keys, torch.cat(pieces, dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(layer.values, -torch.cat(pieces, dim=-2), rtol=0, atol=0)


def test_per_token_norm_weights_equal_the_shared_weight():
    """The exit step's per-token adaLN folds into the norm as (batch, seq, d) weights: the same values as a shared
    (d,) weight where they agree."""
    x, w = torch.randn(2, 5, 64), torch.rand(64) + 0.5
    torch.testing.assert_close(rms_norm(x, w.expand(2, 5, 64)), rms_norm(x, w), atol=1e-6, rtol=0)


def test_the_removed_halting_arguments_are_refused_naming_the_lab(model):
    """`halt_criterion` and `halt_head` left the library (the lab's model takes them): a call that gives one is
    refused, not run under another rule; `generate` refuses them as kwargs no forward takes."""
    ids = torch.randint(3, 97, (1, 4))
    for name, value in (("halt_criterion", "kl"), ("halt_head", model.lm_head)):
        with pytest.raises(TypeError, match=r"no arguments of LoopFormer.*LabLoopFormerForCausalLM"):
            model(ids, halt_eps=0.1, **{name: value})
    with pytest.raises(ValueError, match="halt_criterion"):
        model.generate(ids, max_new_tokens=1, halt_eps=0.1, halt_criterion="kl")


def test_a_saved_config_with_halt_criterion_loads_with_a_warning_naming_the_lab(tmp_path, caplog):
    """`halt_criterion` was a config field: a config.json with the library's "state_change" (every saved one but
    the lab's) loads silently to the same model; another rule loads too (the model halts on the state change), with a
    warning naming the lab's model."""
    import json
    import logging
    import warnings

    config = loopformer_hf.LoopFormerConfig(num_loops=4)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for criterion in ("state_change", "kl_shortcut"):
        (tmp_path / "config.json").write_text(json.dumps({**saved, "halt_criterion": criterion}))
        caplog.clear()
        with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
            warnings.simplefilter("error")
            loaded = loopformer_hf.LoopFormerConfig.from_pretrained(tmp_path)
        assert loaded.to_dict() == config.to_dict() and not hasattr(loaded, "halt_criterion")
        said = [r.getMessage() for r in caplog.records if "halt_criterion" in r.getMessage()]
        if criterion == "state_change":
            assert not said, said
        else:
            assert said and "LabLoopFormerForCausalLM" in said[0] and "ignored" in said[0], said


class StopAfterOne(halting_loopformer.LoopFormerHaltingState):
    def _score(self, previous, hidden_states):
        return torch.zeros(hidden_states.shape[:2])


def runs_halting(model, monkeypatch, halting):
    """`model`, whose base model's `halting_rule` (what a subclass sets for another rule) is `halting`."""
    monkeypatch.setattr(model.model, "halting_rule", halting, raising=False)
    return model


def test_another_rule_reaches_the_loop_through_the_models_halting_rule(model, monkeypatch):
    """A `LoopFormerHaltingState` subclass that the model's `halting_rule` names is what the loop runs: one whose score is 0 halts
    every token after step 1, whose output it then keeps."""
    ids = torch.randint(3, 97, (2, 7))
    with torch.no_grad():
        after_one = model(ids, output_hidden_states=True, use_cache=False).hidden_states[1]
        expected = model.lm_head(model.model.norm(after_one))
        out = runs_halting(model, monkeypatch, StopAfterOne)(ids, halt_eps=0.5, use_cache=False)
    assert (out.loop_counts == 1).all()
    torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "kwargs", [{"halt_eps": EPS}, {"halt_eps": EPS, "loop_budget": torch.tensor([2, 4])}], ids=["halt_eps", "rows"]
)
def test_the_loop_reaches_early_exit_through_four_calls(model, monkeypatch, kwargs):
    """The halting loop calls the rule's `begin`, `for_step`, `observe` and `finish` and reads nothing else of it
    (the hooks a rule overrides are called from the rule's own file). Before, the loop called nine of its hooks and
    wrote `last_kv` itself."""
    seen = set()

    class Spy(halting_loopformer.LoopFormerHaltingState):
        def __getattribute__(self, name):
            if not name.startswith("__") and sys._getframe(1).f_code is halting_loopformer.halting_loop.__code__:
                seen.add(name)
            return super().__getattribute__(name)

    runs_halting(model, monkeypatch, Spy)
    ids = torch.randint(3, 97, (2, 9))
    with torch.no_grad():
        spied = model(ids, **kwargs)
    monkeypatch.undo()
    with torch.no_grad():
        plain = model(ids, **kwargs)
    torch.testing.assert_close(spied.logits, plain.logits, atol=0, rtol=0)
    assert seen == {"for_step", "observe", "finish"}, seen  # `begin`: a classmethod, called on the rule itself
