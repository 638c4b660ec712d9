"""The stability evaluation of the evidence command (benchmarks/fprm_evidence.py --part sudoku_stability):
accuracy with halting off after a list of iteration counts."""

import pytest
import torch

from looped_training.fprm.evaluate import accuracy_vs_iterations, parse_iteration_counts
from support.tiny_data import grid_dataset
from support.tiny_models import tiny_fprm

pytestmark = pytest.mark.usefixtures("one_thread")


def test_accuracy_vs_iterations_keys_shapes_and_equals_a_fresh_run_of_each_count():
    model, ds = tiny_fprm(), grid_dataset()
    counts = [1, 3, 7]
    curve = accuracy_vs_iterations(model, ds, counts, batch_size=4, halt_eps=0.1)
    assert curve["iterations"] == counts and curve["halt_eps"] == 0.1
    for key in ("cell_accuracy", "exact_accuracy", "converged_fraction", "diverged_fraction", "median_residual"):
        assert len(curve[key]) == len(counts), key
    for key in ("cell_accuracy", "exact_accuracy", "converged_fraction", "diverged_fraction"):
        assert all(0.0 <= v <= 1.0 for v in curve[key]), key
    # continuing the solver from count to count gives what a fresh run of exactly that many iterations gives
    labels = torch.tensor(ds["labels"])
    for j, count in enumerate(counts):
        with torch.no_grad():
            out = model(torch.tensor(ds["input_ids"]), max_loops=count, halting=False, halt_eps=0.1)
        assert (out.iterations == count).all()
        cell = float((out.logits.argmax(-1) == labels).float().mean())
        assert curve["cell_accuracy"][j] == pytest.approx(cell, abs=1e-6)
        assert curve["converged_fraction"][j] == pytest.approx(float((out.residuals < 0.1).float().mean()))
        assert curve["median_residual"][j] == pytest.approx(float(out.residuals.median()), rel=1e-5)


@pytest.mark.parametrize("counts", [[], [8, 4], [4, 4], [0, 8], [2.5], [True, 4], "8,16"])
def test_accuracy_vs_iterations_rejects_bad_counts(counts):
    with pytest.raises(ValueError, match="strictly increasing list of positive ints"):
        accuracy_vs_iterations(tiny_fprm(), grid_dataset(), counts)


def test_accuracy_vs_iterations_needs_labels():
    with pytest.raises(ValueError, match="`labels` column"):
        accuracy_vs_iterations(tiny_fprm(), grid_dataset(labels=False), [2])


def test_parse_iteration_counts():
    assert parse_iteration_counts("8,16,32") == [8, 16, 32]
    with pytest.raises(ValueError, match="comma-separated positive ints"):
        parse_iteration_counts("8,x")
    with pytest.raises(ValueError, match="strictly increasing"):
        parse_iteration_counts("16,8")
