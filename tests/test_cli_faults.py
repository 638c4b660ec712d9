"""Issue 13, "Faults not met": command-line faults that ended silently or in a raw traceback, each reproduced here."""

import pytest
import torch

from loopformer_hf.convert_reference import main as convert_main
from looped_training.loopformer import evaluate as evaluate_elastic
from looped_training.loopformer import train as train_loopformer

from test_evaluate_elastic import TINY  # the tiny training run both files train checkpoints with


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    for variant in ("loopformer", "base"):
        train_loopformer.main(["--output_dir", str(root / variant), "--variant", variant, *TINY])
    return root


def test_convert_reference_refuses_an_existing_file_as_output(tmp_path, capsys):
    # save_pretrained only logs an error for a file path, so the converter printed "saved" and wrote nothing
    target = tmp_path / "taken.bin"
    target.write_bytes(b"keep me")
    missing_ckpt = tmp_path / "never-read.pt"  # the check must come before any work, so the checkpoint is not needed
    with pytest.raises(SystemExit) as exit_info:
        convert_main(["--checkpoint", str(missing_ckpt), "--output", str(target), "--n-layer", "1", "--n-loops", "2",
                      "--n-embd", "8", "--n-head", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(target) in err and "not a folder" in err and "saved" not in err
    assert target.read_bytes() == b"keep me"


def test_evaluate_without_uniform_schedule_still_scores_and_summarises(checkpoints, tmp_path, capsys):
    # the tables and the Base comparison are at the uniform schedule; without it the summary ended in IndexError
    paths = [str(checkpoints / "loopformer"), str(checkpoints / "base")]
    records = evaluate_elastic.main([*paths, "--output_dir", str(tmp_path), "--max_rows", "8", "--repr_rows", "4",
                                     "--schedules", "coarse_to_fine"])
    loop = {(r["schedule"], r["budget"]) for r in records[0]["results"]}
    assert {("coarse_to_fine", m) for m in range(1, 5)} <= loop
    assert {("uniform", m) for m in range(1, 5)} <= loop  # added as the reference the tables are read against
    assert "fine_to_coarse" not in {s for s, _ in loop}
    captured = capsys.readouterr()
    assert "uniform" in captured.err and "Exact match" in captured.out


@pytest.mark.parametrize("budget", ["0", "-2"])
def test_evaluate_rejects_a_generate_budget_below_one_before_any_work(tmp_path, budget):
    # it failed only after the whole evaluation; a checkpoint that does not exist shows the check comes first
    with pytest.raises(ValueError, match=rf"--generate_budgets.*{budget}.*>= 1"):
        evaluate_elastic.main([str(tmp_path / "no-such-checkpoint"), "--output_dir", str(tmp_path / "out"),
                               "--generate_budgets", "2", budget])
    assert not (tmp_path / "out").exists()


def test_evaluate_rejects_a_generate_budget_above_num_loops_before_any_work(checkpoints, tmp_path, capsys):
    # a budget above L was silently dropped from the generations
    paths = [str(checkpoints / "loopformer"), str(checkpoints / "base")]
    with pytest.raises(ValueError, match=r"--generate_budgets \[9\]: .*loopformer.* num_loops L=4, so the allowed "
                                         r"budgets are 1\.\.4"):
        evaluate_elastic.main([*paths, "--output_dir", str(tmp_path / "out"), "--generate_budgets", "2", "9"])
    assert not (tmp_path / "out").exists() and "evaluating" not in capsys.readouterr().err


@pytest.mark.parametrize("task_folder", [False, True])
def test_report_no_train_without_runs_refuses_and_keeps_the_docs(tmp_path, task_folder):
    # it overwrote docs/results.md with "not run" stubs (or, with an empty task folder, died in argparse)
    from looped_training.loopformer import report

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "results.md").write_text("earlier results\n")
    runs = tmp_path / "runs"
    if task_folder:  # a task folder with no finished run in it
        (runs / "synthetic").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--no_train.*synthetic.*loopformer") as error:
        report.main(["--no_train", "--runs_dir", str(runs), "--docs_dir", str(docs), "--tasks", "synthetic"])
    assert str(runs / "synthetic" / "base_loop") in str(error.value)
    assert (docs / "results.md").read_text() == "earlier results\n"
    assert not (docs / "plots").exists()
