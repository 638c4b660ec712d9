"""The lab's exit rules for per-token halting (benchmarks/halting_rules.py: "kl", "entropy", their "_shortcut" forms,
"probe_entropy"), run by `LabLoopFormerForCausalLM` as `halt_criterion` values: exact against the fixed trajectory,
cached as uncached, static as dynamic, padded and gathered."""

import pytest
import torch
from support.tiny_models import cache_of, tiny_loopformer_config
from support.tiny_runs import TINY

from benchmarks.halting_rules import LabLoopFormerForCausalLM
from loopformer_hf import halting_loopformer


@pytest.fixture
def model(tiny_model):  # conftest's tiny model, as the lab's model that runs the lab's rules
    return LabLoopFormerForCausalLM.of(tiny_model)


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
        out = model(ids[:, i : i + 1], cache=cache, **masked(i + 1), **kwargs)
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
    assert cache.loop_key[2] == "KLHalting"
    with pytest.raises(
        ValueError,
        match=r"filled under trajectory .*halt_eps=0.1, halting KLHalting, but this call runs "
        r"trajectory .*halt_eps=0.1, halting LoopFormerHaltingState",
    ):
        model(ids[:, 8:], cache=cache, halt_eps=0.1, halt_criterion="state_change")
    assert len(cache_of(model(ids[:, :8])).loop_key) == 2  # the rule is recorded only with halt_eps


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


def test_halt_criterion_is_a_generate_kwarg(model):
    ids = torch.randint(3, 97, (1, 5))
    eps = split_threshold(step_scores(model, ids)["entropy"][1])
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, halt_eps=eps, return_dict_in_generate=True)
    by_kwarg = model.generate(ids, halt_criterion="entropy", **kw)
    default = model.generate(ids, **kw)
    assert not torch.equal(by_kwarg.loop_counts, default.loop_counts)
    model.generation_config.halt_criterion = "entropy"
    assert torch.equal(model.generate(ids, **kw).loop_counts, by_kwarg.loop_counts)
    again = model(by_kwarg.sequences[:, :-1], halt_eps=eps, halt_criterion="entropy")
    torch.testing.assert_close(by_kwarg.loop_counts, again.loop_counts)


def test_a_rule_that_reads_the_lm_head_refuses_the_base_model(model):
    with pytest.raises(ValueError, match="LM head"):
        model.model(torch.randint(3, 97, (1, 4)), halt_eps=0.1, halt_criterion="kl")


def test_cache_filled_under_another_criterion_is_refused(model):
    ids = torch.randint(3, 97, (1, 6))
    out = model(ids, halt_eps=0.1, halt_criterion="kl")
    with pytest.raises(ValueError, match="halting KLHalting"):
        model(ids[:, :1], cache=cache_of(out), halt_eps=0.1)
    model(ids[:, :1], cache=cache_of(out), halt_eps=0.1, halt_criterion="kl")


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
    runs = [
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            do_sample=False,
            halt_eps=eps,
            halt_criterion="entropy_shortcut",
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
        for kw in ({}, {"cache_implementation": "static"})
    ]
    dynamic, static = runs
    assert dynamic.loop_counts.min() < dynamic.loop_counts.max()
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(static.loop_counts, dynamic.loop_counts)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=0)


def test_shortcut_rules_refuse_a_model_without_step_conditioning():
    """TMLT (t only) and Base-Loop were never trained on a step Δ = 1 − t: the rule names the criterion to use."""
    for mode in ("timestep", "none"):
        model = LabLoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning=mode)).eval()
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
            out = model(ids[:, i : i + 1], cache=cache_of(out), halt_eps=1e9, halt_criterion="kl_shortcut")
    assert len(calls) == 2  # the trajectory's steps and the exit steps, once each, at the prefill


def test_without_halt_eps_nothing_changes(model):
    """`halt_eps=None`: the rule is not read; the output equals the plain full budget."""
    ids = torch.randint(3, 97, (2, 10))
    with torch.no_grad():
        plain = model(ids)
        ruled = model(ids, halt_criterion="kl_shortcut")
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
    runs = [
        model.generate(
            prompt,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            halt_eps=eps,
            halt_criterion="probe_entropy",
            return_dict_in_generate=True,
            output_logits=True,
            **kw,
        )
        for kw in ({}, {"cache_implementation": "static"})
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences) and torch.equal(runs[0].loop_counts, runs[1].loop_counts)
    torch.testing.assert_close(torch.stack(runs[0].logits), torch.stack(runs[1].logits), atol=1e-5, rtol=0)


def test_probe_refuses_models_without_step_conditioning_and_a_shared_cache():
    model = LabLoopFormerForCausalLM(tiny_loopformer_config(loop_conditioning="timestep")).eval()
    with pytest.raises(ValueError, match=r"use halt_criterion='entropy'"):
        model(torch.randint(3, 97, (1, 6)), halt_eps=0.1, halt_criterion="probe_entropy")
    from benchmarks.cache_sharing import ModuloSharedCache

    model = LabLoopFormerForCausalLM(tiny_loopformer_config()).eval()
    with pytest.raises(ValueError, match="keeps its extra step in cache slots of its own.*use a LoopFormerCache"):
        model(
            torch.randint(3, 97, (1, 6)),
            cache=ModuloSharedCache(model.config, 2),
            halt_eps=0.1,
            halt_criterion="probe_entropy",
        )


def test_each_row_computes_its_solo_call_under_a_lab_rule(tiny_model):
    """Per-row budgets combine with a rule that keeps one trajectory's conditioning ("kl"), as with "state_change"."""
    from loopformer.test_trajectory_per_row import BUDGETS, EPS, L, check_rows_match_solo

    model = LabLoopFormerForCausalLM.of(tiny_model)
    out = check_rows_match_solo(model, {"loop_budget": BUDGETS}, halt_eps=EPS, halt_criterion="kl")
    assert out.loop_counts[2].min() < L and out.loop_counts[0].max() == 1


def test_per_row_budgets_refuse_a_rule_with_an_exit_step(tiny_model):
    ids = torch.randint(3, 97, (2, 5))
    with pytest.raises(ValueError, match=r"halt_criterion='kl_shortcut' runs an exit step of one trajectory; per-row"):
        LabLoopFormerForCausalLM.of(tiny_model)(ids, loop_budget=[1, 2], halt_eps=0.1, halt_criterion="kl_shortcut")


def test_evaluate_sweeps_each_rule_and_prints_its_table_and_verdict(tmp_path, capsys):
    """`python -m benchmarks.halting_rules` (evaluate with the lab's rules) `--halt_criteria`: each rule at each halt_eps, the '_shortcut' one only on a model conditioned on Δ;
    the printed table has the fixed budgets at equal compute and a verdict per rule."""
    from looped_training.loopformer import train

    from benchmarks import halting_rules

    for variant in ("loopformer", "base_loop"):
        train.main(["--output_dir", str(tmp_path / variant), "--variant", variant, *TINY])
    lf, bl = halting_rules.main(
        [
            str(tmp_path / "loopformer"),
            str(tmp_path / "base_loop"),
            "--output_dir",
            str(tmp_path / "eval"),
            "--schedules",
            "uniform",
            "--halt_eps",
            "1e-9",
            "1e9",
            "--halt_criteria",
            "state_change",
            "state_change_shortcut",
        ]
    )
    assert [(h["criterion"], h["halt_eps"]) for h in lf["halting"]] == [
        ("state_change", 1e-9),
        ("state_change", 1e9),
        ("state_change_shortcut", 1e-9),
        ("state_change_shortcut", 1e9),
    ]
    assert [h["criterion"] for h in bl["halting"]] == ["state_change", "state_change"]  # no Δ: no shortcut rule
    assert lf["halting"][3]["mean_loops"] == 2  # every token exits after step 1, through one shortcut step
    out = capsys.readouterr().out
    assert out.count("halt_criterion='state_change_shortcut'") == 1 and out.count("Verdict: ") == 3
    assert "fixed budget at equal compute (exact match) | adaptive better? |" in out
    with pytest.raises(ValueError, match="halt_criteria"):
        halting_rules.main(
            [str(tmp_path / "loopformer"), "--output_dir", str(tmp_path / "x"), "--halt_criteria", "kll"]
        )
