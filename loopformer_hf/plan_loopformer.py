"""What one forward call runs, resolved once: [`LoopFormerPlan`], made by `LoopFormerPlan.for_call` from the call's
loop knobs (`loop_budget`, `step_schedule`, `halt_eps`) and the config, and read everywhere else: the loop (its
trajectory or per-row trajectories, the halting state it runs), the cache (its layout, `spec`: the slots it
needs and what it refuses to mix) and `generate` (which builds it once per call and hands it to the cache it makes;
the decode steps reuse it).

Relative imports only: `save_pretrained` copies this file next to the weights for `trust_remote_code` loading.
"""

from typing import NamedTuple

import torch

from .halting_loopformer import LoopFormerHaltingState, check_halt_eps
from .trajectory_loopformer import LoopFormerRows, per_row_budget, resolve_call


class LoopFormerCacheSpec(NamedTuple):
    """What a cache was filled under. A tuple of constants (no tensors, no custom `__eq__`), so that a compiled
    forward can guard on it and a static cache can be sized from it (`num_slots`)."""

    trajectory: tuple  # step sizes Δ_1..Δ_M
    num_blocks: int  # k
    halt_eps: float | None = None
    halt_kv_fill: str | None = None  # only recorded with halt_eps: it changes what the skipped slots hold
    # The `LoopFormerHaltingState` (sub)class the loop runs, only recorded with halt_eps: another rule halts other
    # tokens (a model subclass may run one: `LoopFormerModel._plan`)
    halting: type | None = None
    # Per-row trajectories (`LoopFormerRows`): the largest budget, and `trajectory` is (). Their values stay on the
    # plan, out of the spec, so that a compiled forward guards on the largest budget alone, not on the mix of rows.
    row_steps: int | None = None

    @property
    def loop_steps(self):
        """Loop steps a call runs: M, or the largest budget of per-row trajectories."""
        return len(self.trajectory) if self.row_steps is None else self.row_steps

    @property
    def num_steps(self):
        """Loop-step slots per block that the cache stores."""
        return self.loop_steps + (0 if self.halting is None else self.halting.extra_slots)

    @property
    def num_slots(self):
        return self.num_steps * self.num_blocks

    def describe(self):
        if self.row_steps is not None:
            return f"per-row trajectories (largest loop budget {self.row_steps})"
        return f"trajectory {list(self.trajectory)} (loop budget {len(self.trajectory)})"


def _plain(value):
    """`value` as a plain value that a later call's can be compared with, or `NotImplemented` if it is none (compared
    by identity: a compiled forward traces this). A 1-D integer tensor (per-row budgets) stands as its shape: a
    compiled forward guards on that, and its values are compared in eager code (`LoopFormerPlan.for_call`)."""
    if value is None or type(value) in (int, float, str):
        return value
    if isinstance(value, torch.Tensor) and value.ndim == 1 and per_row_budget(value):
        return ("tensor", tuple(value.shape))
    if isinstance(value, (list, tuple)):
        items = tuple(_plain(v) for v in value)
        return NotImplemented if any(item is NotImplemented for item in items) else items
    return NotImplemented


def _plan_request(config, loop_budget, step_schedule, halt_eps, halting):
    """A call's loop knobs, with the config fields they default to, as a tuple of plain values that a later call
    can be compared with (None when a knob is not such a value, e.g. a tensor schedule: that call resolves its own
    plan)."""
    loop_budget, step_schedule = _plain(loop_budget), _plain(step_schedule)
    if loop_budget is NotImplemented or step_schedule is NotImplemented or isinstance(loop_budget, str):
        return None
    if not (halt_eps is None or type(halt_eps) in (int, float)):
        return None
    return (
        loop_budget,
        step_schedule,
        halt_eps,
        halting,
        config.num_loops,
        config.default_loop_budget,
        config.default_step_schedule,
        config.halt_kv_fill,
        config.loop_conditioning,
        config.max_loop_budget_factor,
    )


class LoopFormerPlan(NamedTuple):
    """One call's loop, resolved and validated once and never changed: the call's knobs as given (`request`, with
    the batch size they were checked against) and what they resolve to: the trajectory, halting rule and cache layout
    in `spec`, and per-row trajectories in `rows`. `generate` builds it once per call and binds it to the cache it
    makes; a cache keeps the plan of the calls that fill it (`bind`), so every forward of that call reuses it."""

    request: tuple | None  # None: knobs that cannot be compared as values (e.g. a tensor schedule), never reused
    spec: LoopFormerCacheSpec
    rows: LoopFormerRows | None = None  # per-row trajectories (`trajectory_loopformer.resolve_call`)
    batch_size: int | None = None  # per-row knobs were checked against it (None: not checked)

    @classmethod
    def for_call(
        cls,
        config,
        cache,
        loop_budget=None,
        step_schedule=None,
        halt_eps=None,
        batch_size=None,
        halting=LoopFormerHaltingState,
    ):
        """The plan of a call with these knobs: the one `cache` holds if the call asks the same (a decode step of the
        call that filled it), else the knobs resolved and validated here (`ValueError` naming a bad one, or the row
        of a bad per-row value). `halting`: the halting state class to run with `halt_eps`."""
        request = _plan_request(config, loop_budget, step_schedule, halt_eps, halting)
        kept = getattr(cache, "plan", None)
        if (
            request is not None
            and kept is not None
            and kept.request == request
            and kept.batch_size == batch_size
            and (torch.compiler.is_compiling() or _same_budgets(kept, loop_budget))
        ):
            return kept
        halt_eps = check_halt_eps(halt_eps)
        halts = halt_eps is not None
        trajectory, rows = resolve_call(config, loop_budget, step_schedule, batch_size)
        spec = LoopFormerCacheSpec(
            trajectory=tuple(trajectory),
            num_blocks=config.num_hidden_layers,
            halt_eps=halt_eps,
            halt_kv_fill=config.halt_kv_fill if halts else None,
            halting=halting if halts else None,
            row_steps=None if rows is None else rows.num_steps,
        )
        return cls(request, spec, rows, batch_size)

    @property
    def trajectory(self):
        return self.spec.trajectory

    @property
    def halt_eps(self):
        return self.spec.halt_eps

    @property
    def halting(self):
        return self.spec.halting


def _same_budgets(kept, loop_budget):
    """Whether per-row budgets given as a tensor hold the values of the plan `kept` (compared by `request` otherwise)."""
    if not isinstance(loop_budget, torch.Tensor):
        return True
    return kept.rows is not None and torch.equal(kept.rows.budgets, loop_budget.detach().cpu().long())


__all__ = ["LoopFormerCacheSpec", "LoopFormerPlan"]
