"""The elastic report (issue 12): its verdicts computed from the numbers, seeds grouped with their spread, and the
document written end to end from tiny runs of every configuration it trains."""

import pytest

from looped_training.loopformer import report
from looped_training.loopformer import train as train_loopformer

L = 8


def record(name, variant, uniform, schedules=None, cka=None, entropy=None, curvature=None):
    """An elastic_eval.json record: `uniform` (and each of `schedules`) a list of exact-match values for M = 1..L."""
    results = [{"budget": m + 1, "schedule": "uniform", "em": v, "ppl": 1 / max(v, 1e-3)} for m, v in enumerate(uniform)]
    for schedule, values in (schedules or {}).items():
        results += [{"budget": m + 1, "schedule": schedule, "em": v, "ppl": 1 / max(v, 1e-3)}
                    for m, v in enumerate(values)]
    flat = [float("nan")] + [0.9] * L
    reps = {"cka_to_previous": cka or flat, "prompt_entropy": entropy or [0.5] * (L + 1),
            "curvature": curvature or [1.0] * (L + 1)}
    return {"name": name, "variant": variant, "num_loops": L, "results": results, "representations": reps}


def curve(start, step=0.05):
    return [start + step * m for m in range(L)]


@pytest.mark.parametrize("ee_seeds, status, holds", [
    ((0.30, 0.35), "ahead beyond the seed spread", True),
    ((0.30, 0.52), "ahead on the mean but within the seed spread", False),
    ((0.60, 0.70), "not ahead", False),
])
def test_small_budget_verdict_reads_the_seed_spread(ee_seeds, status, holds):
    records = [record("LoopFormer", "loopformer", curve(0.50)), record("LoopFormer (seed 1)", "loopformer", curve(0.40)),
               record("TMLT-EE", "tmlt_ee", curve(ee_seeds[0])), record("TMLT-EE (seed 1)", "tmlt_ee", curve(ee_seeds[1]))]
    verdict, lines = report.small_budget_verdict(records, "synthetic")
    assert verdict is holds
    assert [line.split(": ")[0] for line in lines] == ["M=1", "M=2"]  # M <= L/4 with L = 8
    assert lines[0].endswith(status)
    assert "0.450 (0.400–0.500)" in lines[0]  # LoopFormer's mean and range over its two seeds


@pytest.mark.parametrize("task", ["synthetic", "shakespeare"])
def test_base_loop_verdicts_compare_the_seed_mean_at_m1_and_at_full_budget(task):
    # LoopFormer seeds 0.45/0.35 at M=1 (mean 0.40), 0.70/0.60 at M=L (mean 0.65); ppl = 1/em, so lower is better
    lf = [record("LoopFormer", "loopformer", curve(0.45, 0.25 / 7)), record("LoopFormer (seed 1)", "loopformer",
                                                                           curve(0.35, 0.25 / 7))]
    for base_loop, at_m1, at_full in ((curve(0.30, 0.30 / 7), True, True),  # 0.30 -> 0.60: behind at both ends
                                      (curve(0.42, 0.28 / 7), False, False)):  # 0.42 -> 0.70: ahead at both
        records = [*lf, record("Base-Loop", "base_loop", base_loop)]
        small, small_lines = report.base_loop_verdict(records, task, at_full_budget=False)
        full, full_lines = report.base_loop_verdict(records, task, at_full_budget=True)
        assert (small, full) == (at_m1, at_full), (task, base_loop[0], base_loop[-1])
        assert small_lines[0].startswith("M=1: ") and full_lines[0].startswith(f"M={L}: ")
    level = [record("LoopFormer", "loopformer", [0.4] * (L - 1) + [0.75]),
             record("Base-Loop", "base_loop", [0.1] * (L - 1) + [0.75])]
    assert report.base_loop_verdict(level, task, at_full_budget=True)[0]  # level at M=L (0.75 both): holds
    level[1]["results"][L - 1]["em"], level[1]["results"][L - 1]["ppl"] = 0.76, 1 / 0.76
    assert not report.base_loop_verdict(level, task, at_full_budget=True)[0]  # 0.01 behind: does not hold
    assert report.base_loop_verdict(lf, task, at_full_budget=True)[0] is None  # no Base-Loop run: no verdict


def test_monotonic_verdict_uses_the_mean_over_seeds_and_flags_a_flat_curve():
    dip = curve(0.5)
    dip[4] -= 0.2
    records = [record("LoopFormer", "loopformer", curve(0.5)), record("LoopFormer (seed 1)", "loopformer", dip)]
    holds, line = report.monotonic_verdict(records, "LoopFormer", "synthetic")
    assert not holds and "largest step backwards 0.050" in line  # mean dips by 0.1 - 0.05
    assert report.monotonic_verdict(records[:1], "LoopFormer", "synthetic")[0]
    flat = [record("TMLT", "tmlt", [0.1] * L)]
    holds, line = report.monotonic_verdict(flat, "TMLT", "synthetic")
    assert not holds and "vacuous" in line


def test_schedule_verdict_skips_budgets_where_the_schedules_coincide():
    uniform = curve(0.4)
    c2f = [v + 0.02 for v in uniform]
    f2c = [v - 0.02 for v in uniform]
    for values in (c2f, f2c):  # M = 1 and M = L are one trajectory under every schedule
        values[0], values[-1] = uniform[0], uniform[-1]
    records = [record("LoopFormer", "loopformer", uniform, {"coarse_to_fine": c2f, "fine_to_coarse": f2c})]
    holds, lines = report.schedule_verdict(records, "synthetic")
    assert holds and lines[-1].startswith("coarse_to_fine is best at 6 of 6 budgets")
    c2f[3] = uniform[3] - 0.1
    records = [record("LoopFormer", "loopformer", uniform, {"coarse_to_fine": c2f, "fine_to_coarse": f2c})]
    holds, lines = report.schedule_verdict(records, "synthetic")
    assert not holds and "best at 5 of 6" in lines[-1] and "M=4:" in lines[2] and lines[2].endswith("best: uniform")


def test_representation_verdict_compares_every_seed_with_every_looped_baseline():
    moving = [float("nan")] + [0.9 - 0.05 * i for i in range(L)]  # keeps changing: CKA falls in late steps
    rising = [0.2 + 0.05 * i for i in range(L + 1)]
    zigzag = [1.0 + (0.3 if i % 2 else 0.0) for i in range(L + 1)]
    lf = [record(n, "loopformer", curve(0.5), cka=moving, entropy=rising, curvature=zigzag)
          for n in ("LoopFormer", "LoopFormer (seed 1)")]
    baselines = [record(n, v, curve(0.5)) for n, v in (("Base-Loop", "base_loop"), ("TMLT", "tmlt"))]
    holds, lines = report.representation_verdict(lf + baselines)
    assert holds and len(lines) == 3 and all(line.endswith("-> holds") for line in lines)
    lf[1] = record("LoopFormer (seed 1)", "loopformer", curve(0.5))  # one seed that stagnates like the baselines
    holds, lines = report.representation_verdict(lf + baselines)
    assert not holds and all(line.endswith("does not hold") for line in lines)


TINY = ["--hidden_size", "32", "--num_attention_heads", "2", "--num_loops", "4", "--num_blocks", "1",
        "--num_train_problems", "64", "--num_eval_problems", "24", "--max_depth", "3",
        "--per_device_train_batch_size", "8", "--use_cpu", "--report_to", "none", "--disable_tqdm", "true",
        "--max_steps", "2", "--save_strategy", "no"]


def test_report_writes_every_claim_with_a_verdict_from_tiny_runs(tmp_path):
    runs = tmp_path / "runs"
    for folder, variant, _, _, extra in report.RUNS:
        train_loopformer.main(["--output_dir", str(runs / "synthetic" / folder), "--variant", variant, *TINY, *extra])
    docs = tmp_path / "docs"
    report.main(["--no_train", "--runs_dir", str(runs), "--docs_dir", str(docs), "--tasks", "synthetic",
                 "--skip_checks", "--max_rows", "24", "--preset", "cpu"])
    text = (docs / "results.md").read_text()
    verdicts = [line for line in text.splitlines() if line.startswith("- synthetic: ")]
    assert len(verdicts) == 1
    for claim in ("monotone in M", "ahead of the early-exit baselines", "coarse-to-fine best", "representations keep",
                  "ahead of Base-Loop at M=1", "level with Base-Loop at M=L"):
        assert claim in verdicts[0]
    assert verdicts[0].count("**") == 12  # six verdicts, each a bold word
    assert "| LoopFormer (2) |" in text and "| TMLT-EE (2) |" in text  # seeds grouped, with their spread
    assert "| reference (seeds) |" in text and "| zero_adaln |" in text
    assert "## Why it does or does not reproduce" in text
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "adaLN weight std" in line)
    ref_adaln, zero_adaln = (float(line.split("|")[2]) for line in lines[header + 2:header + 4])
    assert ref_adaln == pytest.approx(0.02, rel=0.2) and zero_adaln == 0.0
    assert "| decay split | the same tensors |" in text
    assert "CE_full + 0.1·CE_short + 0.1·MSE" in text and "| Base-Loop | CE_full only |" in text
    assert (docs / "plots" / "synthetic_quality_vs_budget.png").exists()
