"""plan_loopformer.py: what one forward call runs, resolved once. `LoopFormerPlan.for_call` turns a call's loop knobs
(with the config's defaults) into a trajectory or per-row trajectories, a halting rule and a cache layout
(`LoopFormerCacheSpec`); a cache that holds the plan of the call filling it hands the same plan back."""

from types import SimpleNamespace

import pytest
import torch
from support.tiny_models import tiny_loopformer_config

from loopformer_hf.halting_loopformer import LoopFormerHaltingState
from loopformer_hf.plan_loopformer import LoopFormerCacheSpec, LoopFormerPlan
from loopformer_hf.trajectory_loopformer import resolve_trajectory


@pytest.fixture
def config():
    return tiny_loopformer_config()  # k = 2 blocks, L = 4


def test_the_spec_counts_one_slot_per_loop_step_and_block():
    spec = LoopFormerCacheSpec(trajectory=(0.5, 0.25, 0.25), num_blocks=2)
    assert (spec.loop_steps, spec.num_steps, spec.num_slots) == (3, 3, 6)
    rows = LoopFormerCacheSpec(trajectory=(), num_blocks=3, row_steps=4)
    assert (rows.loop_steps, rows.num_slots) == (4, 12)
    assert "loop budget 3" in spec.describe() and "largest loop budget 4" in rows.describe()


def test_a_plan_holds_what_the_knobs_resolve_to(config):
    plan = LoopFormerPlan.for_call(config, None, loop_budget=3, step_schedule="coarse_to_fine")
    assert plan.trajectory == resolve_trajectory(config, 3, "coarse_to_fine")
    assert plan.spec.num_blocks == config.num_hidden_layers and plan.spec.num_slots == 3 * config.num_hidden_layers
    assert plan.rows is None and plan.halt_eps is None and plan.halting is None
    default = LoopFormerPlan.for_call(config, None)
    assert default.trajectory == (1 / config.num_loops,) * config.num_loops


def test_halting_is_recorded_only_with_a_threshold(config):
    fixed = LoopFormerPlan.for_call(config, None)
    assert fixed.spec.halting is None and fixed.spec.halt_kv_fill is None
    halting = LoopFormerPlan.for_call(config, None, halt_eps=0.1)
    assert halting.halt_eps == 0.1 and isinstance(halting.halt_eps, float)
    assert halting.halting is LoopFormerHaltingState and halting.spec.halt_kv_fill == config.halt_kv_fill
    assert halting.spec != fixed.spec  # a cache filled under one layout is not the other's


def test_per_row_budgets_make_rows_and_the_spec_holds_the_largest(config):
    plan = LoopFormerPlan.for_call(config, None, loop_budget=torch.tensor([1, 3]), batch_size=2)
    assert plan.trajectory == () and plan.rows.budgets.tolist() == [1, 3]
    assert plan.spec.row_steps == 3 and plan.spec.num_slots == 3 * config.num_hidden_layers


@pytest.mark.parametrize(
    "knobs, message",
    [
        ({"loop_budget": 0}, "loop_budget"),
        ({"step_schedule": [0.5, 0.6]}, "sum to 1"),
        ({"halt_eps": -1.0}, "halt_eps"),
        ({"loop_budget": [1, 2, 3], "batch_size": 2}, "one per row"),
    ],
)
def test_a_bad_knob_is_refused_by_name(config, knobs, message):
    with pytest.raises(ValueError, match=message):
        LoopFormerPlan.for_call(config, None, **knobs)


def test_a_cache_that_holds_the_plan_of_the_same_call_hands_it_back(config):
    plan = LoopFormerPlan.for_call(config, None, loop_budget=2, batch_size=1)
    cache = SimpleNamespace(plan=plan)
    assert LoopFormerPlan.for_call(config, cache, loop_budget=2, batch_size=1) is plan
    other = LoopFormerPlan.for_call(config, cache, loop_budget=3, batch_size=1)
    assert other is not plan and len(other.trajectory) == 3
    # a tensor schedule cannot be compared as a value: resolved anew, never kept for reuse
    tensor_plan = LoopFormerPlan.for_call(config, None, step_schedule=torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert tensor_plan.request is None and tensor_plan.trajectory == (0.5, 0.5)
