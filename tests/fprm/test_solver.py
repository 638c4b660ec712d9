"""solver_fprm.py: Algorithm 1, the damped fixed-point iteration y ← η·f(y) + (1 − η)·y with its relative residual,
step decay and per-sample halting, on maps whose iterates are computed by hand here (no model); the settings and the
carried state."""

import dataclasses

import pytest
import torch
from support.tiny_models import tiny_fprm_config

from fprm_hf.solver_fprm import FPRMSolverState, SolverSettings, check_solver_state, input_fingerprint, solve


def _settings(**overrides):
    values = {"halt_eps": 1e-3, "max_loops": 50, "eta": 1.0, "gamma": 0.5, "patience": 100, "min_eta": 1e-6}
    values.update(overrides)
    return SolverSettings(**values)


def _half_plus_x(y, x):  # f(y) = y/2 + x: fixed point 2x
    return 0.5 * y + x


def test_a_contraction_converges_to_its_fixed_point_after_the_hand_counted_iterations():
    # from y0 = 0, y_{k-1} = 2x(1 - 2^-(k-1)), so iteration k sees r = 2^-k / (1 - 2^-k): first below 1e-3 at k = 10
    x = torch.full((1, 3, 4), 0.7)
    state = FPRMSolverState.start(torch.zeros_like(x), eta=1.0, patience=100)
    out, ran, trace, iterates = solve(_half_plus_x, x, state, _settings(), True, True)
    assert ran.tolist() == [10] and out.converged.tolist() == [True] and out.halted.tolist() == [True]
    torch.testing.assert_close(out.hidden, 2 * x * (1 - 2.0**-10))
    expected = [2.0**-k / (1 - 2.0**-k) for k in range(1, 11)]
    torch.testing.assert_close(trace[0], torch.tensor(expected), rtol=1e-4, atol=0)
    assert len(iterates) == 11 and torch.equal(iterates[0], torch.zeros_like(x)) and iterates[-1] is out.hidden


def test_each_sample_halts_on_its_own_and_halted_rows_are_not_evaluated():
    x = torch.stack([torch.zeros(2, 4), torch.ones(2, 4)])  # row 0 is at its fixed point 0 from the start
    seen = []

    def step(y, x_rows):
        seen.append(y.shape[0])
        return _half_plus_x(y, x_rows)

    state = FPRMSolverState.start(torch.zeros_like(x), eta=1.0, patience=100)
    out, ran, _, _ = solve(step, x, state, _settings())
    assert ran.tolist() == [1, 10] and seen == [2] + [1] * 9
    assert out.converged.all() and not out.diverged.any()


def test_halting_off_runs_every_sample_to_the_cap_and_batch_scope_stops_them_together():
    x = torch.stack([torch.zeros(2, 4), torch.ones(2, 4)])
    start = FPRMSolverState.start(torch.zeros_like(x), eta=1.0, patience=100)
    _, ran, _, _ = solve(_half_plus_x, x, start, _settings(halting=False, max_loops=4))
    assert ran.tolist() == [4, 4]
    _, ran, _, _ = solve(_half_plus_x, x, start, _settings(halt_scope="batch"))
    assert ran.tolist() == [10, 10]  # row 0 waits for the batch's largest residual


def test_damping_decays_after_patience_without_improvement():
    # f(y) = c - y at η = 1 oscillates 0, c, 0, ...: r = 1, huge, 1 (no improvement twice) -> η ← γ·η after the
    # third iteration with P = 2; at η = 1/2, y ← c/2, the fixed point, in one step.
    c = torch.full((1, 1, 2), 3.0)
    state = FPRMSolverState.start(torch.zeros_like(c), eta=1.0, patience=2)
    out, ran, _, _ = solve(lambda y, x: x - y, c, state, _settings(max_loops=3, patience=2))
    assert ran.tolist() == [3] and out.eta.tolist() == [0.5] and out.patience.tolist() == [2]
    out, _, _, _ = solve(lambda y, x: x - y, c, out, _settings(max_loops=5, patience=2))
    torch.testing.assert_close(out.hidden, c / 2)
    assert out.converged.tolist() == [True]


def test_eta_below_min_eta_halts_without_convergence():
    c = torch.full((1, 1, 2), 3.0)
    state = FPRMSolverState.start(torch.zeros_like(c), eta=1.0, patience=1)
    out, _, _, _ = solve(lambda y, x: x - y, c, state, _settings(patience=1, gamma=0.1, min_eta=0.5))
    assert out.halted.tolist() == [True] and out.converged.tolist() == [False] and out.eta.item() < 0.5


def test_a_non_finite_step_is_discarded_and_the_sample_stops_as_diverged():
    x = torch.ones(2, 1, 3)

    def nan_for_row_one(y, x_rows):
        f = _half_plus_x(y, x_rows)
        if y.shape[0] == 2 and (y != 0).any():
            f = f.clone()
            f[1] = float("nan")
        return f

    state = FPRMSolverState.start(torch.zeros_like(x), eta=1.0, patience=100)
    out, ran, _, _ = solve(nan_for_row_one, x, state, _settings())
    assert out.diverged.tolist() == [False, True] and out.halted.tolist() == [True, True]
    assert ran.tolist() == [10, 2] and out.residuals[1] == float("inf")
    torch.testing.assert_close(out.hidden[1], x[1])  # its last finite iterate, y_1 = x


def test_settings_are_checked_and_filled_from_the_config():
    config = tiny_fprm_config()
    settings = SolverSettings.from_config(config, training=True, max_loops=7)
    assert settings.max_loops == 7 and settings.gamma == config.gamma_train and settings.halt_scope == "sample"
    assert SolverSettings.from_config(config).gamma == config.gamma_eval
    with pytest.raises(ValueError, match="Unknown solver settings \\['beta'\\]"):
        SolverSettings.from_config(config, beta=1)
    for bad in ({"eta": 1.5}, {"max_loops": 0}, {"halting": 1}, {"halt_scope": "token"}):
        with pytest.raises(ValueError):
            _settings(**bad)


def test_state_rows_are_taken_put_and_selected():
    a = FPRMSolverState.start(torch.zeros(3, 2, 4), eta=1.0, patience=5)
    b = FPRMSolverState.start(torch.ones(3, 2, 4), eta=0.5, patience=2)
    mixed = a.where(torch.tensor([False, True, False]), b)
    assert mixed.hidden[:, 0, 0].tolist() == [0, 1, 0] and mixed.eta.tolist() == [1.0, 0.5, 1.0]
    put = a.put(torch.tensor([2]), b.select(torch.tensor([0])))
    assert put.hidden[:, 0, 0].tolist() == [0, 0, 1] and put.patience.tolist() == [5, 5, 2]
    assert a.select(torch.tensor([0, 2])).hidden.shape == (2, 2, 4)


def test_fingerprints_tell_inputs_apart_and_a_state_is_not_carried_onto_others():
    ids = torch.tensor([[1, 2, 3], [1, 2, 3], [3, 2, 1]])
    fp = input_fingerprint(ids)
    assert fp[0] == fp[1] != fp[2] and torch.equal(fp, input_fingerprint(ids.clone()))
    assert input_fingerprint(ids, torch.tensor([0, 1, 0]))[1] != fp[1]
    x = torch.zeros(3, 3, 4)
    state = dataclasses.replace(FPRMSolverState.start(x, eta=1.0, patience=2), fingerprint=fp)
    check_solver_state(state, x, fp)
    with pytest.raises(ValueError, match=r"rows \[2\] differ"):
        check_solver_state(state, x, input_fingerprint(torch.tensor([[1, 2, 3], [1, 2, 3], [0, 0, 0]])))
    with pytest.raises(ValueError, match="previous call on inputs of this shape"):
        check_solver_state(state, torch.zeros(3, 4, 4), fp)
    with pytest.raises(ValueError, match="`solver_state.eta` must be a torch.float32"):
        check_solver_state(dataclasses.replace(state, eta=state.eta.double()), x, fp)
