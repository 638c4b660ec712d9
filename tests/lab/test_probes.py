"""The lab's probes and benchmarks that run on the library's training code: the S5 recipe probe and the exit-rule
benchmark on a trained checkpoint."""

import json

import pytest
import torch

from looped_training.loopformer import train as train_loopformer
from support.tiny_runs import TINY


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    train_loopformer.main(["--output_dir", str(root / "loopformer"), "--variant", "loopformer", *TINY])
    return root


@pytest.mark.usefixtures("one_thread")
def test_s5_recipe_probe_runs_and_reports_per_prefix_accuracy():
    """The probe behind benchmarks/writeups/fprm.md's S5 ablations, on S3 for a few seconds: S3 is learned within
    that time."""
    from benchmarks.s5_recipe_probe import main as probe

    result = probe(
        [
            "--group",
            "S3",
            "--minutes",
            "0.25",
            "--batch",
            "64",
            "--d",
            "32",
            "--ff",
            "64",
            "--num_test",
            "16",
            "--lr",
            "3e-3",
            "--curriculum",
            "0.9",
        ]
    )
    assert set(result["accuracy_at_k"]) == {2, 4, 8, 16, 32, 64, 128}
    assert result["accuracy_at_k"][2] > 0.9 and result["steps"] > 50


def test_exit_criteria_benchmark_on_a_trained_checkpoint(checkpoints, tmp_path):
    """benchmarks.bench_halt_criteria --checkpoints: fixed budgets 1..L, then every criterion at every threshold on
    the checkpoint's own held-out problems, each against the fixed budgets interpolated at its mean loops."""
    from benchmarks import bench_halt_criteria

    out = tmp_path / "criteria.json"
    # --threads as the process has it: main() sets torch's global thread count, and a changed count would change
    # later tests' float reductions (test_publish compares logits across processes bit for bit)
    bench_halt_criteria.main(
        [
            "--checkpoints",
            str(checkpoints / "loopformer"),
            "--eval_problems",
            "8",
            "--threads",
            str(torch.get_num_threads()),
            "--output",
            str(out),
        ]
    )
    result = json.loads(out.read_text())["checkpoints"][str(checkpoints / "loopformer")]
    assert result["task"] == "synthetic" and result["rows"] == 8
    assert [f["loop_budget"] for f in result["fixed"]] == [1, 2, 3, 4]
    rules = {
        **bench_halt_criteria.THRESHOLDS,
        **bench_halt_criteria.SHORTCUT_RULES,
        "probe_entropy": bench_halt_criteria.PROBE_THRESHOLDS,  # LoopFormer: every exit rule
        "probe_entropy_context": bench_halt_criteria.PROBE_THRESHOLDS,
    }
    assert {(r["criterion"], r["halt_eps"]) for r in result["criteria"]} == {
        (c, e) for c, values in rules.items() for e in values
    }
    assert all(
        1 <= r["mean_loops"] <= (5 if r["criterion"].startswith("probe") else 4) and 0 <= r["em"] <= 1 and r["ppl"] > 1
        for r in result["criteria"]
    )  # the probe's unsure tokens pay 1 + L
    assert set(result["targets"]) == set(rules) and [e["loops"] for e in result["shortcut_exits"]] == [2, 3]
