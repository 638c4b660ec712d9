"""The adaptivity and length-generalisation analyses of the evidence command (benchmarks/fprm_evidence.py, a lab
script); its stability evaluation is the library's (tests/training/fprm/test_fprm_evidence.py)."""

import pytest
import torch
from datasets import Dataset

from benchmarks.fprm_evidence import length_point, spearman, sudoku_point, verdict
from support.tiny_data import grid_dataset
from support.tiny_models import tiny_fprm

pytestmark = pytest.mark.usefixtures("one_thread")


def test_spearman_ranks_ties_and_degenerate_inputs():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 100]) == pytest.approx(1.0)  # monotone, not linear
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties take their mean rank: x ranks (0, 1.5, 1.5, 3), y ranks (0, 1, 2, 3) -> Pearson of the ranks
    rx, ry = torch.tensor([0, 1.5, 1.5, 3]), torch.tensor([0.0, 1, 2, 3])
    expected = float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])
    assert spearman([5, 7, 7, 9], [1, 2, 3, 4]) == pytest.approx(expected)
    assert spearman([1, 2], [1, 2]) != spearman([1, 2], [1, 2])  # fewer than 3 pairs: NaN
    assert spearman([3, 3, 3], [1, 2, 3]) != spearman([3, 3, 3], [1, 2, 3])  # a constant side: NaN
    with pytest.raises(ValueError, match=r"shapes \(3,\) and \(2,\)"):
        spearman([1, 2, 3], [1, 2])


def test_verdict_reads_the_target_and_nan():
    assert verdict(0.9, 0.9) == "holds"
    assert verdict(0.89, 0.9) == "does not hold"
    assert verdict(float("nan"), 0.5) == "does not hold"
    assert verdict(None, 0.5) == "does not hold"


def test_sudoku_point_correlates_blanks_with_the_solver_iterations_on_solved_rows():
    model = tiny_fprm()
    ds = grid_dataset(rows=8)
    with torch.no_grad():
        out = model(torch.tensor(ds["input_ids"]), max_loops=30)
    labels = torch.tensor(ds["labels"])
    labels[:5] = out.logits.argmax(-1)[:5]  # five rows "solved", three not
    blanks = [4, 5, 6, 7, 8, 9, 10, 11]
    ds = Dataset.from_dict({"input_ids": ds["input_ids"], "labels": labels.tolist(), "num_blanks": blanks})
    point = sudoku_point(model, ds, max_loops=30)
    assert point["solved"] == 5 and point["exact_accuracy"] == pytest.approx(5 / 8)
    assert point["_iterations"] == out.iterations.tolist()
    assert point["spearman_rho"] == pytest.approx(spearman(blanks[:5], out.iterations[:5].tolist()), nan_ok=True)
    assert [r["solved"] for r in point["per_blanks"]] == [1] * 5 + [0] * 3


def test_length_point_reads_the_authors_metric_at_T_and_4T():
    from support.tiny_models import sequence_fprm_config

    model = tiny_fprm(config=sequence_fprm_config())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 7, (6, 8), generator=g)
    with torch.no_grad():
        preds = model(ids, max_loops=30).logits.argmax(-1)
    labels = torch.where(torch.rand(6, 8, generator=g) < 0.6, preds, (preds % 6) + 1)  # ~60% right
    point = length_point(model, Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()}), 30, T=2)
    correct = (preds == labels).float()
    acc_T, acc_4T = correct[:, :2].mean(), correct[:, :8].mean()  # every position labelled
    assert point["in_distribution_accuracy"] == pytest.approx(float(acc_T))
    assert point["accuracy_4T"] == pytest.approx(float(acc_4T))
    assert point["ratio_4T"] == pytest.approx(float(acc_4T / acc_T))


def test_fresh_sudoku_split_is_another_seeds_test_split_without_the_training_puzzles(monkeypatch):
    import looped_training.fprm.tasks as tasks
    from benchmarks.fprm_evidence import FRESH_SEED_OFFSET, fresh_sudoku_split, test_split

    results = {
        "args": {"data": {"task": "sudoku", "sudoku_size": 4, "num_train": 100, "num_test": 50, "data_seed_offset": 0}}
    }
    other = test_split(results, 7 + FRESH_SEED_OFFSET)
    build = tasks.build_task

    def with_shared_puzzles(data_args, seed):  # the run's training split also holds 3 puzzles of the other split
        ds, config, columns = build(data_args, seed)
        if seed == 7:
            from datasets import concatenate_datasets

            ds["train"] = concatenate_datasets([ds["train"], other.select([0, 5, 9])])
        return ds, config, columns

    monkeypatch.setattr(tasks, "build_task", with_shared_puzzles)
    fresh = fresh_sudoku_split(results, 7)["puzzle"]
    assert fresh == [p for i, p in enumerate(other["puzzle"]) if i not in (0, 5, 9)]


def test_sweep_knobs_name_the_run_and_set_only_the_training_flags_given():
    from types import SimpleNamespace

    from benchmarks.fprm_evidence import STATE_KNOBS, SUDOKU_KNOBS, sweep_knobs

    plain = SimpleNamespace(seed=42, sudoku_width=None, sudoku_steps=None, sudoku_ema=None)
    assert sweep_knobs(plain, SUDOKU_KNOBS) == ([], "seed42", "")
    sudoku = SimpleNamespace(seed=1, sudoku_width=None, sudoku_steps=4000, sudoku_ema=0.999)
    flags, tag, own = sweep_knobs(sudoku, SUDOKU_KNOBS)
    # the time cap scales with the steps (24 min per 1200, the preset's)
    assert flags == ["--max_steps", "4000", "--time_budget_minutes", "80", "--ema_decay", "0.999"]
    assert (tag, own) == ("seed1_steps4000_ema0.999", " --sudoku_steps 4000 --sudoku_ema 0.999")
    state = SimpleNamespace(seed=0, state_num_train=None, state_steps=3000)
    assert sweep_knobs(state, STATE_KNOBS) == (
        ["--max_steps", "3000", "--time_budget_minutes", "45"],
        "seed0_steps3000",
        " --state_steps 3000",
    )
