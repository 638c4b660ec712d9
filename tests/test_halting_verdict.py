"""The halting table the Quickstart and the report print, with the fixed budgets at equal compute and a
verdict per exit rule computed from the evaluation's own numbers."""

import pytest

from looped_training.loopformer.evaluate import fixed_at_equal_compute, halting_table, halting_verdict


def record(task, fixed, halting):
    metric = "em" if task == "synthetic" else "ppl"
    return {"task": task, "num_loops": len(fixed), "variant": "loopformer", "name": "LoopFormer",
            "results": [{"budget": m, "schedule": "uniform", metric: v, "ppl" if metric == "em" else "em": None}
                        for m, v in enumerate(fixed, 1)],
            "halting": [dict(criterion=c, halt_eps=e, mean_loops=m, em=q if metric == "em" else None,
                             ppl=q if metric == "ppl" else 1.5) for c, e, m, q in halting]}


def test_exact_match_target_needs_half_a_loop_saved_within_0_01_and_not_below_the_fixed_curve():
    rec = record("synthetic", [0.6, 0.99, 1.0], [
        ("kl_shortcut", 0.1, 2.4, 0.995),   # fixed at 2.4: 0.994 -> pays
        ("kl_shortcut", 0.2, 2.0, 0.985),   # within 0.01 of 1.0 fails
        ("kl", 0.1, 2.2, 0.991),            # below the fixed curve (0.992)
        ("entropy", 0.1, 2.6, 1.0),         # saves less than half a loop
    ])
    assert abs(fixed_at_equal_compute(rec, 2.4, "em") - 0.994) < 1e-9
    assert halting_verdict(rec) == {"kl_shortcut": (True, [0.1]), "kl": (False, []), "entropy": (False, [])}
    text = "\n".join(halting_table(rec))
    assert "halt_criterion='kl_shortcut'" in text and "Verdict: pays" in text
    assert "| 0.1 | 2.20 | 1.50 | 0.991 | 0.992 | no |" in text
    assert text.count("Verdict: does not pay") == 2 and "fixed loop_budget is the better knob" in text


def test_perplexity_target_needs_two_settings_below_the_fixed_curve():
    rec = record("text", [100.0, 80.0, 70.0, 66.0], [
        ("entropy_shortcut", 0.5, 2.5, 74.0),   # fixed 75 -> better
        ("entropy_shortcut", 1.0, 3.5, 67.5),   # fixed 68 -> better
        ("state_change", 0.2, 2.0, 81.0),       # worse
        ("state_change", 0.4, 3.0, 69.0),       # better, once only
    ])
    assert halting_verdict(rec) == {"entropy_shortcut": (True, [0.5, 1.0]), "state_change": (False, [0.4])}


def test_evaluate_sweeps_each_rule_and_prints_its_table_and_verdict(tmp_path, capsys):
    """`evaluate --halt_criteria`: each rule at each halt_eps, the '_shortcut' one only on a model conditioned on Δ;
    the printed table has the fixed budgets at equal compute and a verdict per rule."""
    from looped_training.loopformer import evaluate, train
    from test_evaluate_elastic import TINY

    for variant in ("loopformer", "base_loop"):
        train.main(["--output_dir", str(tmp_path / variant), "--variant", variant, *TINY])
    lf, bl = evaluate.main([str(tmp_path / "loopformer"), str(tmp_path / "base_loop"), "--output_dir",
                            str(tmp_path / "eval"), "--schedules", "uniform", "--halt_eps", "1e-9", "1e9",
                            "--halt_criteria", "state_change", "state_change_shortcut"])
    assert [(h["criterion"], h["halt_eps"]) for h in lf["halting"]] == [
        ("state_change", 1e-9), ("state_change", 1e9), ("state_change_shortcut", 1e-9), ("state_change_shortcut", 1e9)]
    assert [h["criterion"] for h in bl["halting"]] == ["state_change", "state_change"]  # no Δ: no shortcut rule
    assert lf["halting"][3]["mean_loops"] == 2  # every token exits after step 1, through one shortcut step
    out = capsys.readouterr().out
    assert out.count("halt_criterion='state_change_shortcut'") == 1 and out.count("Verdict: ") == 3
    assert "fixed budget at equal compute (exact match) | adaptive better? |" in out
    with pytest.raises(ValueError, match="halt_criteria"):
        evaluate.main([str(tmp_path / "loopformer"), "--output_dir", str(tmp_path / "x"), "--halt_criteria", "kll"])
