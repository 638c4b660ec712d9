"""trajectory_loopformer.py: the budget M and step sizes Δ_1..Δ_M a call runs. The named schedules on the 1/L grid,
the checks of a budget and of an explicit schedule, `resolve_trajectory` with the config's defaults, and per-row
trajectories (`resolve_rows`, `resolve_call`). Per-row trajectories run through the model are in
test_trajectory_per_row.py."""

import math
import warnings

import pytest
import torch
from support.tiny_models import tiny_loopformer_config

from loopformer_hf import trajectory_loopformer
from loopformer_hf.trajectory_loopformer import (
    STEP_SCHEDULE_PRESETS,
    LoopFormerRows,
    check_budget,
    check_schedule,
    resolve_call,
    resolve_rows,
    resolve_trajectory,
    step_schedule_preset,
)


@pytest.fixture(autouse=True)
def no_trajectory_warned_yet(monkeypatch):  # each warning is given once per process: this file checks them
    monkeypatch.setattr(trajectory_loopformer, "_warned_trajectories", set())


@pytest.fixture
def config():
    return tiny_loopformer_config(num_loops=4)  # L = 4, loop_conditioning "shortcut"


@pytest.mark.parametrize("name", STEP_SCHEDULE_PRESETS)
@pytest.mark.parametrize("num_loops, budget", [(4, 1), (4, 2), (4, 3), (4, 4), (8, 3), (8, 5), (4, 6)])
def test_every_preset_has_budget_positive_steps_summing_to_one_and_ramps_stay_on_the_grid(name, num_loops, budget):
    steps = step_schedule_preset(num_loops, name, budget)
    assert len(steps) == budget and all(s > 0 for s in steps)
    assert math.isclose(math.fsum(steps), 1.0, abs_tol=1e-12)
    if name != "uniform" and budget <= num_loops:  # the ramps: positive multiples of 1/L
        assert all(abs(s * num_loops - round(s * num_loops)) < 1e-9 for s in steps), steps


@pytest.mark.parametrize("num_loops, budget", [(4, 3), (8, 3), (8, 5), (4, 6)])
def test_ramps_run_the_way_their_names_say_and_mirror_each_other(num_loops, budget):
    coarse = step_schedule_preset(num_loops, "coarse_to_fine", budget)
    fine = step_schedule_preset(num_loops, "fine_to_coarse", budget)
    assert coarse == sorted(coarse, reverse=True) and coarse[0] > coarse[-1]
    assert fine == coarse[::-1]


def test_hand_computed_ramps():
    # L = 4, M = 2: each step one grid unit; the 2 spare units shared 2:1 (shares 4/3, 2/3, floors 1, 0), the one left
    # to the larger remainder (2/3) -> units 1, 1 -> steps 2/4, 2/4.
    assert step_schedule_preset(4, "coarse_to_fine", 2) == [0.5, 0.5]
    # L = 8, M = 3: 5 spare units by weights 3:2:1 -> shares 2.5, 1.67, 0.83 -> floors 2, 1, 0 (2 left) -> remainders
    # .83 (third) and .67 (second) get them -> units 2, 2, 1 -> steps 3/8, 3/8, 2/8.
    assert step_schedule_preset(8, "coarse_to_fine", 3) == [3 / 8, 3 / 8, 2 / 8]
    assert step_schedule_preset(4, "uniform", 4) == [0.25] * 4
    # above the grid (M > L): the continuous ramp M, M-1, ..., 1 normalised
    assert step_schedule_preset(2, "coarse_to_fine", 3) == [3 / 6, 2 / 6, 1 / 6]


def test_an_unknown_preset_is_refused_by_name():
    with pytest.raises(ValueError, match="'cosine'"):
        step_schedule_preset(4, "cosine", 2)


def test_check_budget_takes_integers_up_to_the_models_maximum(config):
    assert check_budget(config, 3) == 3 and type(check_budget(config, torch.tensor(3).item())) is int
    assert check_budget(config, config.max_loop_budget) == config.max_loop_budget
    for bad in (0, -1, 2.0, True, "3", None):
        with pytest.raises(ValueError, match="integer >= 1"):
            check_budget(config, bad)
    with pytest.raises(ValueError, match="max_loop_budget"):
        check_budget(config, config.max_loop_budget + 1)
    with pytest.raises(ValueError, match="0-dim tensor"):
        check_budget(config, torch.tensor(2))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        check_budget(config, torch.ones(2, 2, dtype=torch.long))


def test_check_schedule_returns_floats_and_refuses_what_is_not_a_distribution():
    assert check_schedule((0.25, 0.75)) == [0.25, 0.75]
    assert check_schedule(torch.tensor([0.5, 0.5], dtype=torch.float64)) == [0.5, 0.5]
    assert all(type(s) is float for s in check_schedule([1]))
    for bad, message in (
        ([], "empty"),
        ([0.5, 0.6], "sum to 1"),
        ([1.5, -0.5], "bad entry -0.5"),
        ([0.5, float("nan")], "bad entry nan"),
        ([0.0, 1.0], "bad entry 0.0"),
        (0.5, "preset name"),
    ):
        with pytest.raises(ValueError, match=message):
            check_schedule(bad)


def test_resolve_trajectory_defaults_to_the_config_and_a_schedule_sets_the_budget(config):
    assert resolve_trajectory(config) == (0.25,) * 4  # default: uniform over num_loops
    assert resolve_trajectory(config, loop_budget=2) == (0.5, 0.5)
    assert resolve_trajectory(config, step_schedule=[0.25, 0.75]) == (0.25, 0.75)
    assert resolve_trajectory(config, 3, "coarse_to_fine") == tuple(step_schedule_preset(4, "coarse_to_fine", 3))
    with pytest.raises(ValueError, match="disagrees"):
        resolve_trajectory(config, loop_budget=3, step_schedule=[0.5, 0.5])
    assert resolve_trajectory(tiny_loopformer_config(default_loop_budget=2)) == (0.5, 0.5)


def test_without_step_size_conditioning_only_uniform_steps_are_taken():
    config = tiny_loopformer_config(loop_conditioning="timestep")
    with pytest.warns(UserWarning, match="loop_budget=2 is a loop count it never ran"):
        assert resolve_trajectory(config, step_schedule=[0.5, 0.5]) == (0.5, 0.5)
    with pytest.raises(ValueError, match="loop_conditioning='shortcut'"):
        resolve_trajectory(config, step_schedule=[0.25, 0.75])


def test_a_trajectory_off_what_was_trained_warns_once_and_the_papers_elastic_budgets_do_not(config):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_trajectory(config, loop_budget=2)  # uniform M <= L: interpolated, silent
    with pytest.warns(UserWarning, match="budget 5 > num_loops 4"):
        resolve_trajectory(config, loop_budget=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_trajectory(config, loop_budget=5)  # the same trajectory again: no second warning


def test_rows_hold_each_rows_steps_padded_with_zeros():
    rows = LoopFormerRows.from_trajectories([(0.5, 0.5), (1.0,), (0.25, 0.25, 0.5)])
    assert rows.num_steps == 3 and rows.budgets.tolist() == [2, 1, 3]
    assert rows.steps.dtype == torch.float64
    assert rows.steps.tolist() == [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.25, 0.5]]


def test_resolve_rows_gives_each_row_what_it_alone_would_run(config):
    assert resolve_rows(config, 2, None) is None  # one value for the batch
    rows = resolve_rows(config, [1, 3], "coarse_to_fine", batch_size=2)
    assert rows.trajectories == tuple(resolve_trajectory(config, m, "coarse_to_fine") for m in (1, 3))
    rows = resolve_rows(config, None, [None, [0.25, 0.75]])
    assert rows.trajectories == (resolve_trajectory(config), (0.25, 0.75))
    # rows given as a list that all agree are one trajectory; a tensor of budgets always stays rows
    assert resolve_rows(config, [2, 2], None) == (0.5, 0.5)
    assert isinstance(resolve_rows(config, torch.tensor([2, 2]), None), LoopFormerRows)


def test_resolve_rows_names_the_bad_row_and_a_wrong_count(config):
    with pytest.raises(ValueError, match="Row 1 of the batch"):
        resolve_rows(config, [2, 0], None)
    with pytest.raises(ValueError, match="3 values, one per row, but the batch has 2"):
        resolve_rows(config, [1, 2, 3], None, batch_size=2)
    with pytest.raises(ValueError, match="empty"):
        resolve_rows(config, [], None)


def test_resolve_call_is_a_trajectory_or_rows(config):
    assert resolve_call(config, 2) == ((0.5, 0.5), None)
    assert resolve_call(config, [2, 2]) == ((0.5, 0.5), None)
    trajectory, rows = resolve_call(config, torch.tensor([1, 2]))
    assert trajectory == () and rows.budgets.tolist() == [1, 2]
