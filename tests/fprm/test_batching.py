"""Continuous batching (fprm_hf/batching_fprm.py): when a puzzle halts, the next one takes its row. Each puzzle's answer
and iteration count must equal solving it alone from the same z0, whatever the batch size, for rows that halt early
and rows that run to the cap; and the batch must stay full while puzzles are queued."""

import functools

import pytest
import torch

from fprm_hf.batching_fprm import iter_solve, solve_all
from support.tiny_models import grid_inputs, tiny_fprm

N = 7
HALT_EPS = 0.1


@pytest.fixture(scope="module")
def model():
    return tiny_fprm(seed=3)


@pytest.fixture(scope="module")
def puzzles():
    return grid_inputs(N, seed=5)


@pytest.fixture(scope="module")
def cap(model, puzzles):
    """A cap that some puzzles halt before (r < τ) and others run to."""
    cap = 40
    with torch.no_grad():
        iterations = model(puzzles, halt_eps=HALT_EPS, max_loops=cap).iterations
    assert len(set(iterations.tolist())) >= 3 and (iterations == cap).sum() >= 2, iterations
    return cap


@functools.cache
def _alone(model, cap, seed):
    return alone(model, grid_inputs(N, seed=5), cap, None if seed is None else torch.Generator().manual_seed(seed))


def alone(model, puzzles, cap, generator=None):
    """Each puzzle solved on its own (batch 1), in puzzle order (so a generator draws each z0 in the same order)."""
    answers, iterations, converged = [], [], []
    with torch.no_grad():
        for row in puzzles:
            out = model(row[None], halt_eps=HALT_EPS, max_loops=cap, generator=generator)
            answers.append(out.logits.argmax(-1)[0])
            iterations.append(int(out.iterations[0]))
            converged.append(bool(out.converged[0]))
    return torch.stack(answers), torch.tensor(iterations), torch.tensor(converged)


def simulated_rows(iterations, batch_size):
    """The rows a continuous batch computes at each iteration, from each puzzle's iteration count: a finished row
    is refilled from the queue at once, so only the tail runs short."""
    queue, rows, calls = list(iterations), [], []
    rows, queue = queue[:batch_size], queue[batch_size:]
    while rows:
        calls.append(len(rows))
        rows = [r - 1 for r in rows]
        for i, r in enumerate(rows):
            if r == 0 and queue:
                rows[i] = queue.pop(0)
        rows = [r for r in rows if r > 0]
    return calls


@pytest.mark.parametrize("batch_size", [3, N, 10])  # smaller and not dividing N, equal, larger
@pytest.mark.parametrize("seeded", [False, True], ids=["shared-z0", "generator"])
def test_each_puzzle_is_solved_as_alone_at_any_batch_size(model, puzzles, cap, batch_size, seeded):
    want_answers, want_iterations, want_converged = _alone(model, cap, 11 if seeded else None)
    assert (want_iterations == cap).any() and (want_iterations < cap).any()  # both kinds of row
    assert (want_converged == (want_iterations < cap)).all()
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape[0]))
    try:
        got = solve_all(
            model,
            puzzles,
            batch_size,
            "continuous",
            generator=torch.Generator().manual_seed(11) if seeded else None,
            halt_eps=HALT_EPS,
            max_loops=cap,
        )
    finally:
        hook.remove()
    assert torch.equal(got.iterations, want_iterations)
    assert torch.equal(got.answers, want_answers)
    assert torch.equal(got.converged, want_converged) and not got.diverged.any()
    # the batch stays full while puzzles are queued; nothing is computed twice or for a finished row
    assert calls == simulated_rows(want_iterations.tolist(), batch_size)
    # per-sample halting in fixed batches gives the same results
    sample = solve_all(
        model,
        puzzles,
        batch_size,
        "sample",
        generator=torch.Generator().manual_seed(11) if seeded else None,
        halt_eps=HALT_EPS,
        max_loops=cap,
    )
    assert torch.equal(sample.iterations, want_iterations) and torch.equal(sample.answers, want_answers)


def test_yields_in_the_order_puzzles_finish_and_batch_mode_halts_whole_batches(model, puzzles, cap):
    finished = [s.index for s in iter_solve(model, puzzles, 3, "continuous", halt_eps=HALT_EPS, max_loops=cap)]
    assert sorted(finished) == list(range(N))
    _, want_iterations, _ = _alone(model, cap, None)
    assert finished != list(range(N))  # a later puzzle finished before an earlier one
    batch = solve_all(model, puzzles, 3, "batch", halt_eps=HALT_EPS, max_loops=cap)
    for start in range(0, N, 3):  # every row of a batch runs as long as its slowest
        rows = slice(start, start + 3)
        assert (batch.iterations[rows] == want_iterations[rows].max()).all()


def test_a_state_row_put_by_continuous_batching_starts_fresh():
    """`FPRMSolverState.put` writes every per-row field (y, η, patience, residuals, counters, flags) of the new rows."""
    from fprm_hf.solver_fprm import FPRMSolverState

    old = FPRMSolverState.start(torch.ones(3, 2, 4), 0.5, 7)
    old.eta[:], old.iterations[:], old.halted[:], old.residuals[:] = 0.01, 9, True, 0.05
    new = FPRMSolverState.start(torch.zeros(1, 2, 4), 1.0, 5)
    put = old.put(torch.tensor([1]), new)
    for name in ("hidden", "eta", "patience", "best", "residuals", "iterations", "halted", "converged", "diverged"):
        assert torch.equal(getattr(put, name)[1], getattr(new, name)[0]), name
        assert torch.equal(getattr(put, name)[[0, 2]], getattr(old, name)[[0, 2]]), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), r"`batch_size` must be an integer >= 1, got 0"),
        (dict(batch_size=2.5), r"`batch_size` must be an integer >= 1, got 2\.5"),
        (dict(mode="rows"), r"`mode` must be one of \('batch', 'sample', 'continuous'\).* got 'rows'"),
        (dict(halt_scope="batch"), r"`halt_scope` is set by the batching `mode`.* got halt_scope='batch'"),
        (dict(max_loops=0), r"max_loops"),
    ],
)
def test_bad_batching_input_is_refused_before_any_work(model, puzzles, kwargs, message):
    args = {"batch_size": 3, "mode": "continuous", **kwargs}
    with pytest.raises(ValueError, match=message):
        iter_solve(model, puzzles, **args)  # raised at the call, not at the first puzzle
