"""Solving many puzzles with FPRM, batch by batch: the three ways a batch's rows are filled and emptied.

- `"batch"`: fixed batches, every row halts at once (`halt_scope="batch"`, the authors' evaluation): a batch costs
  as many iterations as its slowest puzzle needs, for every row.
- `"sample"`: fixed batches, each row halts on its own and is frozen (`halt_scope="sample"`, this package's default):
  the batch shrinks as its puzzles finish, so an accelerator runs emptier and emptier until the slowest one halts.
- `"continuous"`: continuous batching: when a puzzle halts (or reaches the cap), the next puzzle takes its row, with
  its own z0 and a fresh η, patience and counters, so the batch stays full until the puzzles run out.

Each puzzle's answer and iteration count are the same in every mode and the same as solving it alone from the same
z0 (tests/fprm/test_batching.py): a row's iteration reads only its own row. With a `generator`, z0 is drawn per
puzzle in puzzle order (on CPU the same values as one draw per fixed batch).

    from fprm_hf.batching_fprm import solve_all
    solutions = solve_all(model.eval(), input_ids, batch_size=256, mode="continuous")
    solutions.answers, solutions.iterations   # (puzzles, tokens), (puzzles,), in puzzle order

Relative imports only, as the other modules of this package.
"""

from dataclasses import replace
from typing import NamedTuple

import torch

from .inputs_fprm import check_inputs
from .solver_fprm import SolverSettings, solve


BATCHING_MODES = ("batch", "sample", "continuous")


class Solved(NamedTuple):
    """One puzzle's result, as `iter_solve` yields it."""

    index: int  # the puzzle's position in `puzzles`
    answer: torch.Tensor  # (tokens,) the predicted token of every input token (argmax of the logits), on CPU
    iterations: int  # solver iterations this puzzle ran
    converged: bool  # halted because r < halt_eps
    diverged: bool  # stopped on a non-finite residual


class Solutions(NamedTuple):
    """Every puzzle's result in puzzle order, as `solve_all` returns it (CPU tensors)."""

    answers: torch.Tensor  # (puzzles, tokens) long
    iterations: torch.Tensor  # (puzzles,) long
    converged: torch.Tensor  # (puzzles,) bool
    diverged: torch.Tensor  # (puzzles,) bool


def check_batching(mode, batch_size, name="mode"):
    """`mode` (None: the config's `halt_scope`, so "batch" or "sample") and `batch_size` of `iter_solve`; `name`
    is how the message calls `mode` (a command's flag)."""
    if mode is not None and mode not in BATCHING_MODES:
        raise ValueError(f"`{name}` must be one of {BATCHING_MODES} (or None: the config's halt_scope), got {mode!r}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}.")


def iter_solve(model, puzzles, batch_size, mode=None, puzzle_identifiers=None, generator=None, **solver_kwargs):
    """Solves `puzzles` ((puzzles, tokens) token ids: a tensor, array or nested list) with the `FPRMForReasoning`
    `model` in evaluation mode, `batch_size` rows at a time, and yields a `Solved` per puzzle as it finishes: in
    puzzle order for "batch" and "sample", in the order puzzles halt for "continuous". `mode` is one of
    `BATCHING_MODES` (None: the config's `halt_scope`); `puzzle_identifiers` ((puzzles,)) and `generator` (z0 drawn
    fresh per puzzle from it) are the forward's; `solver_kwargs` the solver's (`halt_eps`, `max_loops`, `eta`,
    `gamma`, `patience`, `min_eta`, `halting`), `max_loops` being each puzzle's cap. The arguments are checked
    here, before the first puzzle is solved."""
    check_batching(mode, batch_size)
    if model.config.recursion == "trm" and (mode or model.config.halt_scope) == "continuous":
        raise ValueError(
            "mode='continuous' refills the rows a fixed point has halted; a TRM model (recursion='trm') runs every "
            "row its halt_max_steps ACT steps: pass mode='batch'."
        )
    if "halt_scope" in solver_kwargs:
        raise ValueError(
            f"`halt_scope` is set by the batching `mode` ({BATCHING_MODES}), got halt_scope="
            f"{solver_kwargs['halt_scope']!r}: pass mode='batch' or mode='sample' instead."
        )
    if model.training:
        raise ValueError(
            "`iter_solve` solves in evaluation mode: call `model.eval()` first (got a model in training)."
        )
    device = next(model.parameters()).device
    ids = torch.as_tensor(puzzles, device=device)
    pids = None if puzzle_identifiers is None else torch.as_tensor(puzzle_identifiers, device=device)
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"`puzzles` must be (puzzles, tokens) token ids with >= 1 puzzle, got {tuple(ids.shape)}.")
    check_inputs(model.config, ids, pids, None)
    settings = SolverSettings.from_config(model.config, training=False, halt_scope="sample", **solver_kwargs)
    mode = mode or model.config.halt_scope
    if mode == "continuous":
        return _continuous(model, ids, pids, batch_size, generator, settings)
    return _fixed_batches(model, ids, pids, batch_size, mode, generator, solver_kwargs)


@torch.no_grad()
def _fixed_batches(model, ids, pids, batch_size, mode, generator, solver_kwargs):
    """Fixed batches of `batch_size` puzzles, each run to its end with `halt_scope=mode`."""
    for start in range(0, len(ids), batch_size):
        rows = slice(start, start + batch_size)
        out = model(
            ids[rows],
            puzzle_identifiers=None if pids is None else pids[rows],
            halt_scope=mode,
            generator=generator,
            **solver_kwargs,
        )
        yield from _results(range(start, start + len(ids[rows])), out.logits.argmax(-1), out)


def solve_all(model, puzzles, batch_size, mode=None, puzzle_identifiers=None, generator=None, **solver_kwargs):
    """`iter_solve`'s results gathered in puzzle order (`Solutions`)."""
    return gather(iter_solve(model, puzzles, batch_size, mode, puzzle_identifiers, generator, **solver_kwargs))


def gather(solved):
    """`Solutions` in puzzle order of `Solved` results in any order (`iter_solve`'s, e.g. through a progress bar)."""
    results = sorted(solved, key=lambda s: s.index)
    return Solutions(
        answers=torch.stack([s.answer for s in results]),
        iterations=torch.tensor([s.iterations for s in results], dtype=torch.long),
        converged=torch.tensor([s.converged for s in results], dtype=torch.bool),
        diverged=torch.tensor([s.diverged for s in results], dtype=torch.bool),
    )


def _results(indices, answers, out):
    """`Solved` of each row of a forward's output `out` (anything with iterations, converged, diverged)."""
    answers, iterations = answers.cpu(), out.iterations.tolist()
    converged, diverged = out.converged.tolist(), out.diverged.tolist()
    for row, index in enumerate(indices):
        yield Solved(int(index), answers[row], iterations[row], converged[row], diverged[row])


@torch.no_grad()
def _continuous(model, ids, pids, batch_size, generator, settings):
    """Continuous batching: one solver iteration at a time over a full batch; after each, the rows that halted or
    reached the cap are read out and the next puzzles take their rows (the batch shrinks only once none are left)."""
    inner, prefix = model.model, model.config.num_prefix_tokens
    cap, one_step = settings.max_loops, replace(settings, max_loops=1)

    def admit(index):  # x and a fresh solver state (z0, η0, patience, counters) of the puzzles at `index`
        x = inner.embed(ids[index], None if pids is None else pids[index])
        return x, inner.initial_solver_state(x, settings.eta, generator)

    def step(y, x_rows):
        return inner.fixed_point_map(y, x_rows, position_embeddings)

    queued = torch.arange(len(ids), device=ids.device)
    puzzle_of_row, queued = queued[:batch_size], queued[batch_size:]
    x, state = admit(puzzle_of_row)
    position_embeddings = inner.position_embeddings(x)  # every puzzle has the same length
    while len(puzzle_of_row):
        state = solve(step, x, state, one_step)[0]
        done = (state.halted | (state.iterations >= cap)).nonzero().squeeze(1)
        if not len(done):
            continue
        answers = model.lm_head(state.hidden[done, prefix:]).argmax(-1)
        yield from _results(puzzle_of_row[done].tolist(), answers, state.select(done))
        refill, drop = done[: len(queued)], done[len(queued) :]
        if len(refill):  # the next puzzles take the finished rows
            new, queued = queued[: len(refill)], queued[len(refill) :]
            x_new, state_new = admit(new)
            x = x.index_copy(0, refill, x_new)
            state = state.put(refill, state_new)
            puzzle_of_row = puzzle_of_row.index_copy(0, refill, new)
        if len(drop):  # none left to take them: the batch shrinks
            keep = torch.ones(len(puzzle_of_row), dtype=torch.bool, device=ids.device)
            keep[drop] = False
            keep = keep.nonzero().squeeze(1)
            x, state, puzzle_of_row = x[keep], state.select(keep), puzzle_of_row[keep]


__all__ = ["BATCHING_MODES", "Solved", "Solutions", "check_batching", "gather", "iter_solve", "solve_all"]
