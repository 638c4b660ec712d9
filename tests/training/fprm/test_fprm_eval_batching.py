"""`python -m looped_training.fprm.evaluate --eval_batching` (and the train command's evaluation): the test set solved
with fixed batches halting together (batch, the authors'), per sample (sample, the default) or with continuous
batching (fprm_hf/batching_fprm.py), each reported as such."""

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict
from support.tiny_models import tiny_fprm

from looped_training.fprm.evaluate import evaluate


def _test_set(rows=7):
    g = torch.Generator().manual_seed(2)
    return Dataset.from_dict(
        {
            "input_ids": torch.randint(0, 7, (rows, 16), generator=g).tolist(),
            "labels": torch.randint(2, 7, (rows, 16), generator=g).tolist(),
            "num_blanks": list(range(rows)),
        }
    )


def _evaluate(model, batching):
    data_args = SimpleNamespace(task="sudoku", test_length=0, arc_max_grid=0)
    eval_args = SimpleNamespace(
        eval_max_loops=40,
        eval_halt_eps=0.1,
        eval_gamma=None,
        eval_batch_size=3,
        eval_batching=batching,
        compare_cap=batching == "continuous",
        eval_iterations_curve=None,
    )
    return evaluate(model, DatasetDict({"test": _test_set()}), data_args, eval_args, ["num_blanks"])


def test_each_batching_is_reported_and_continuous_computes_what_sample_does():
    model = tiny_fprm(seed=3)
    with torch.no_grad():
        alone = model(torch.tensor(_test_set()["input_ids"]), halt_eps=0.1, max_loops=40).iterations
    assert len(set(alone.tolist())) >= 3  # puzzles that halt at different iterations
    results = {mode: _evaluate(model, mode) for mode in (None, "sample", "continuous", "batch")}
    assert results[None]["halting"]["batching"] == "sample"  # the config's halt_scope
    for mode in ("sample", "continuous"):
        halting = results[mode]["halting"]
        assert halting["batching"] == mode
        assert halting["mean_iterations"] == pytest.approx(float(alone.float().mean()))
        assert halting["exact_accuracy"] == results[None]["halting"]["exact_accuracy"]
        assert halting["cell_accuracy"] == results[None]["halting"]["cell_accuracy"]
        assert results[mode]["iterations_vs_num_blanks"] == results[None]["iterations_vs_num_blanks"]
    # batch-wide halting: every row of a batch of 3 runs as long as the batch's slowest
    slowest = [int(alone[i : i + 3].max()) for i in range(0, 7, 3)]
    want = sum(m * len(alone[i : i + 3]) for m, i in zip(slowest, range(0, 7, 3))) / 7
    assert results["batch"]["halting"]["mean_iterations"] == pytest.approx(want)
    assert results["continuous"]["always_cap"]["mean_iterations"] == 40.0  # halting off runs the cap in every mode
