"""The sweep's table (benchmarks/sweep_loopformer.py): the verdicts of the seed means and of each seed alone."""

import json

import pytest

from benchmarks.sweep_loopformer import CELLS, VARIANTS, main, markdown, per_seed_verdicts, seeds_on_disk, summarise
from looped_training.loopformer.report import budget_claims


def fake_runs():
    em = {
        "loopformer": ([0.40, 0.50, 0.60, 0.70], [0.25, 0.25, 0.25, 0.25]),
        "base_loop": ([0.20, 0.40, 0.60, 0.70], [0.10, 0.30, 0.50, 0.90]),
        "tmlt_ee": ([0.30, 0.40, 0.50, 0.60], [0.30, 0.40, 0.50, 0.60]),
    }
    return {
        v: [{"em": curve, "em_by_depth": [{"1": x} for x in curve], "train_runtime_s": 1.0} for curve in em[v]]
        for v in VARIANTS
    }


def cell_of(runs, seeds, flags=()):
    """A cell of the summary as `summarise` writes it, from fake runs (seed means as the curves)."""
    curves = {v: [sum(col) / len(rs) for col in zip(*(r["em"] for r in rs))] for v, rs in runs.items()}
    return {
        "flags": list(flags),
        "seeds": seeds,
        "curves": curves,
        "spread": {v: [0.0] * 4 for v in VARIANTS},
        "by_depth": {v: {"1": c} for v, c in curves.items()},
        "train_runtime_s": {v: 1.0 for v in VARIANTS},
        "runs": runs,
        "verdicts": budget_claims(curves["loopformer"], curves["base_loop"]),
        "per_seed_verdicts": per_seed_verdicts(runs),
    }


def test_per_seed_verdicts_pair_each_loopformer_seed_with_the_same_base_loop_seed():
    seed0, seed1 = per_seed_verdicts(fake_runs())
    assert [c["holds"] for c in seed0.values()] == [True, True, True]  # +0.30, +0.20, level at M=L
    assert [c["holds"] for c in seed1.values()] == [False, True, False]  # flat, +0.15, 0.65 behind at M=L
    assert seed1["c_elastic_for_free"]["gap"] == -0.65


def test_a_loopformer_far_ahead_of_base_loop_fails_c_and_the_table_says_it_is_ahead():
    runs = fake_runs()
    runs["base_loop"][0]["em"] = [0.20, 0.40, 0.50, 0.55]  # seed 0's LoopFormer ends 0.15 ahead
    claims = per_seed_verdicts(runs)[0]
    assert not claims["c_elastic_for_free"]["holds"]
    text = markdown({"base": cell_of(runs, [0, 1])}, "cmd")
    assert "seed 0: holds / holds / no (ahead by 0.150)" in text
    assert "all three hold for 0 of 2 seeds, and for 1 if (c) only asks LoopFormer to end no more than 0.05 " in text


def test_markdown_prints_the_mean_verdicts_and_each_seed_alone():
    cell = cell_of(fake_runs(), [0, 3], flags=["--max_steps", "4000"])
    text = markdown({"steps4k": cell}, "python -m benchmarks.sweep_loopformer")
    assert "## steps4k: `--max_steps 4000`" in text
    # the means: LoopFormer 0.325 -> 0.475 (+0.15), at M=1 +0.175 over Base-Loop, at M=L 0.325 behind
    assert "(a) LoopFormer improves with budget: gain +0.150, worst step back 0.000: **holds**" in text
    assert "(c) elastic for free: LoopFormer − Base-Loop at M=L -0.325: does not hold" in text
    assert "Seeds 0, 3." in text
    assert "seed 0: holds / holds / holds; seed 3: no / holds / no; all three hold for 1 of 2 seeds, and for 1" in text


def test_a_cell_averages_the_seeds_finished_for_every_model(tmp_path):
    def finished(variant, seed):
        run = tmp_path / "steps4k" / f"{variant}-s{seed}"
        run.mkdir(parents=True)
        (run / "loopformer_training.json").write_text("{}")

    for seed in (0, 1, 3, 12):
        for variant in VARIANTS:
            if (seed, variant) != (3, "tmlt_ee"):  # seed 3's TMLT-EE is missing
                finished(variant, seed)
    (tmp_path / "steps4k" / "loopformer-s7").mkdir()  # started, not finished
    assert seeds_on_disk(str(tmp_path), "steps4k") == [0, 1, 12]
    assert seeds_on_disk(str(tmp_path), "width256") == []


def test_repeated_or_negative_seeds_are_refused_before_anything_trains(tmp_path):
    for seeds in (["2", "2"], ["-1", "3"]):
        with pytest.raises(SystemExit, match="--seeds must be distinct non-negative integers"):
            main(["--seeds", *seeds, "--runs_dir", str(tmp_path), "--output_dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_the_overview_has_a_row_per_cell_with_the_three_margins_and_the_seed_counts():
    runs = fake_runs()
    runs["base_loop"][0]["em"] = [0.20, 0.40, 0.50, 0.55]  # seed 0 ends 0.15 ahead: fails (c), not behind
    text = markdown({"base": cell_of(fake_runs(), [0, 1]), "steps4k": cell_of(runs, [0, 1])}, "cmd")
    overview = text.split("## Overview")[1].split("\n## ")[0]
    rows = [line for line in overview.splitlines() if line.startswith("| base") or line.startswith("| steps4k")]
    # base: LoopFormer means 0.325 -> 0.475, Base-Loop 0.15 -> 0.80; seed 0 meets all three, seed 1 none
    assert rows[0] == "| base | 2 | 0.325 → 0.475 | 0.150 → 0.800 | +0.150 | +0.175 | -0.325 | 1 (1) of 2 |"
    assert rows[1].startswith("| steps4k | 2 |") and rows[1].endswith("| 0 (1) of 2 |")
    assert text.index("## Overview") < text.index("## base:")


def test_seeds_in_the_committed_table_stay_when_a_fresh_checkout_trains_another(tmp_path):
    for variant in VARIANTS:  # seed 2 trained and evaluated on disk; seeds 0 and 1 only in the committed table
        run = tmp_path / "steps4k" / f"{variant}-s2"
        run.mkdir(parents=True)
        (run / "loopformer_training.json").write_text("{}")
        (run / "sweep_eval.json").write_text(
            json.dumps({"em": [0.1, 0.2, 0.3, 0.4], "em_by_depth": [{"1": 0.5}] * 4, "train_runtime_s": 2.0})
        )
    committed = cell_of(fake_runs(), [0, 1], flags=CELLS["steps4k"])
    cell = summarise(str(tmp_path), ["steps4k"], 500, {"steps4k": committed})["steps4k"]
    assert cell["seeds"] == [0, 1, 2]
    assert [r["em"][0] for r in cell["runs"]["loopformer"]] == [0.40, 0.25, 0.1]
    assert cell["curves"]["base_loop"][3] == pytest.approx((0.70 + 0.90 + 0.4) / 3)
    # a committed cell whose flags have changed since is not mixed in: seed 2 alone is no mean
    stale = cell_of(fake_runs(), [0, 1], flags=["--max_steps", "3000"])
    assert summarise(str(tmp_path), ["steps4k"], 500, {"steps4k": stale}) == {}
